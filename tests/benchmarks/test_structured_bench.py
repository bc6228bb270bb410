"""benchmarks.structured's pure parts: the speed and isolation summaries, the cache's hit rate, the slow
schemas (distinct per seed, and compiled by the real engine) and the report rendered from its figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tiny_models

from benchmarks import structured as sb
from benchmarks.options import StructuredOptions
from specserve.api.constraints import Constraint
from specserve.bench.timing import inter_token_latencies
from specserve.engine.grammar import GrammarEngine

pytestmark = pytest.mark.unit

SCHEMAS = Path(__file__).resolve().parents[1] / "data" / "constraints" / "long_keys.json"


def run(schema: str, repeat: int, mode: str, ms: float, tokens: int = 100, forced: int = 0, accepted: int = 0, **kw):
    return {
        "schema": schema, "repeat": repeat, "mode": mode, "ms_per_token": ms, "tokens": tokens,
        "forced_proposed": kw.get("forced_proposed", forced), "forced_accepted": forced,
        "proposed": accepted, "accepted": accepted, "identical": kw.get("identical", True), "valid": kw.get("valid", True),
    }


def test_the_speed_summary_takes_each_pairs_ratio_and_their_median():
    runs = [
        run("a", 0, sb.GAMMA0, 30.0), run("a", 0, sb.DEFAULT, 10.0, forced=60, accepted=70),  # 3x
        run("a", 1, sb.DEFAULT, 15.0, forced=50, accepted=50), run("a", 1, sb.GAMMA0, 30.0),  # 2x
        run("b", 0, sb.GAMMA0, 20.0), run("b", 0, sb.DEFAULT, 20.0, identical=False, valid=False),  # 1x
        run("b", 1, sb.GAMMA0, 99.0),  # its pair never ran: left out of every figure but the run counts
    ]
    s = sb.speed_summary(runs)
    assert s["pairs"] == 3
    assert s["median_ratio"] == pytest.approx(2.0)
    assert s["ratio_range"] == [pytest.approx(1.0), pytest.approx(3.0)]
    a, b = s["per_schema"]
    assert (a["schema"], a["pairs"], a["gamma0_ms"], a["default_ms"]) == ("a", 2, 30.0, 12.5)
    assert a["ratio"] == pytest.approx(2.5)
    assert a["forced_share"] == pytest.approx(110 / 200)
    assert a["draft_share"] == pytest.approx(10 / 200)
    assert b["ratio"] == pytest.approx(1.0) and b["forced_share"] == 0
    assert s["forced_share"] == pytest.approx(110 / 300)
    assert (s["identical"], s["valid"], s["runs"]) == (2, 6, 7)


def test_forced_acceptance_is_accepted_over_proposed_forced_tokens():
    runs = [run("a", 0, sb.GAMMA0, 30.0), run("a", 0, sb.DEFAULT, 10.0, forced=30, forced_proposed=40, accepted=30)]
    assert sb.speed_summary(runs)["per_schema"][0]["forced_acceptance"] == pytest.approx(0.75)


def test_the_isolation_summary_pools_the_phases_of_each_condition():
    phases = [
        {"condition": "solo", "itls": [0.010, 0.020, 0.030]},
        {"condition": "beside", "itls": [0.015, 0.030]},
        {"condition": "beside", "itls": [0.045]},
        {"condition": "solo", "itls": [0.040, 0.050]},
    ]
    s = sb.isolation_summary(phases)
    assert s["solo"]["n"] == 5 and s["beside"]["n"] == 3
    assert s["solo"]["median_ms"] == pytest.approx(30.0)
    assert s["beside"]["median_ms"] == pytest.approx(30.0)
    assert s["median_ratio"] == pytest.approx(1.0)
    assert s["solo"]["p90_ms"] == pytest.approx(46.0)  # 40 + 0.6 * 10, linear between ranks
    assert s["beside"]["max_ms"] == pytest.approx(45.0)
    assert s["p90_ratio"] == pytest.approx(s["beside"]["p90_ms"] / 46.0)


def test_quantile_is_linear_between_ranks():
    assert sb.quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert sb.quantile([1.0, 2.0], 0.9) == pytest.approx(1.9)
    assert sb.quantile([5.0], 0.99) == 5.0


def test_inter_token_latency_spreads_a_chunks_gap_over_its_tokens():
    # Chunks at 0.1 s (1 token), 0.3 s (2 tokens), 0.4 s (1 token): the first chunk has no gap.
    assert inter_token_latencies([(0.1, 1), (0.3, 2), (0.4, 1)]) == pytest.approx([0.1, 0.1, 0.1])
    assert inter_token_latencies([(0.5, 3)]) == []


def test_the_hit_rate_is_cached_over_cached_and_compiled_between_two_scrapes():
    before = {"cached": 2.0, "compiled": 3.0, "timeout": 0.0}
    after = {"cached": 23.0, "compiled": 10.0, "timeout": 1.0}
    h = sb.hit_rate(before, after)
    assert h["outcomes"] == {"cached": 21.0, "compiled": 7.0, "timeout": 1.0}
    assert h["hit_rate"] == pytest.approx(0.75)


def test_slow_schemas_are_distinct_per_seed_and_the_same_for_one():
    a, b = sb.slow_schema(1, 40), sb.slow_schema(2, 40)
    assert a == sb.slow_schema(1, 40)
    assert a != b
    assert len(a["patternProperties"]) == 40
    with pytest.raises(ValueError):
        sb.slow_schema(1, 26 * 26 + 1)


def test_slow_schemas_and_the_bench_set_compile_in_the_real_engine(tmp_path):
    """llguidance refuses patternProperties it cannot prove disjoint: the slow schemas must pass that check,
    and the bench set must compile."""
    engine = GrammarEngine(tiny_models.make_tiny_tokenizer(tmp_path, vocab_size=384), 384, [0])
    engine.compile(Constraint("json_schema", json.dumps(sb.slow_schema(7, 30))))
    schemas = sb.load_schemas(SCHEMAS)
    assert len(schemas) >= 6
    for s in schemas:
        engine.compile(sb._constraint(s["schema"]))
        assert s["prompt"] and s["schema"]["required"] == list(s["schema"]["properties"])
    assert [s["name"] for s in sb.load_schemas(SCHEMAS, 2)] == [s["name"] for s in schemas[:2]]


def test_the_report_renders_from_its_figures():
    runs = [run("a", 0, sb.GAMMA0, 30.0), run("a", 0, sb.DEFAULT, 10.0, forced=60, accepted=70)]
    args = StructuredOptions(command="python -m benchmarks structured --repeats 1").settings()
    run_info = {"args": args, "load_before": [1.0, 1.0, 1.0], "load_after": [1.5, 1.0, 1.0], "date_utc": "2026-12-05 07:00"}
    stages = {"first_token_s": 7.0, "draft_s": 0.1, "verify_s": 7.5, "target_outside_forward_s": 6.0}
    result = {
        "speed": {
            **run_info,
            "compiles": [{"schema": "a", "compile_ms": 4.5, "compiles": 1}],
            "cache": sb.hit_rate({}, {"cached": 1.0, "compiled": 1.0}),
            "runs": runs,
            "summary": sb.speed_summary(runs),
            "mask": {"tokens": 100, "median_us": 10, "mean_us": 20, "p99_us": 90, "step_ms": 25.0, "share": 0.0008},
        },
        "isolation": {
            **run_info,
            "slow_compile_alone_s": 3.2,
            "phases": [
                {"condition": "solo", "itls": [0.02], "slow": [], "stream_seconds": [10.0],
                 "stream_stages": [{**stages, "target_outside_forward_s": 0.5}]},
                {"condition": "beside", "itls": [0.04], "slow": [{"seed": 1, "seconds": 4.0, "outcome": "8 tokens", **stages}],
                 "compile_s": 3.0, "compiles": 1, "stream_seconds": [16.0], "stream_stages": [stages]},
            ],
            "summary": sb.isolation_summary([{"condition": "solo", "itls": [0.02]}, {"condition": "beside", "itls": [0.04]}]),
        },
    }
    text = sb.render(result)
    assert "python -m benchmarks structured --repeats 1" in text
    assert "3.00x" in text and "met" in text  # the speed-up of the one pair
    assert "median 2.00x" in text and "**missed**" in text  # isolation: 40 ms against 20 ms
    assert "50%" in text  # the hit rate
    assert "10.0 s alone and 16.0 s beside" in text and "0.50 s alone and 6.00 s beside" in text
    assert "Verifier._constrain" in text  # the streams: 5.5 s more in the target against a 3.2 s compile
    result["isolation"]["phases"][1]["stream_stages"] = [{**stages, "target_outside_forward_s": 0.7}]
    assert "SessionGrammars.prepare" in sb.render(result)  # 0.2 s more: only the slow requests waited


def test_the_flood_summary_counts_the_victim_and_the_attacker_per_condition_and_renders():
    from benchmarks import structured_flood as sf

    victim = {"outcome": "served", "seconds": 1.2, "tokens": 20, "error": ""}
    phases = [
        {"condition": "solo", "itls": [0.02, 0.03], "victim": victim, "attacker": {}, "compiler": {"compiled": 1.0}, "settle_s": 0.0},
        {"condition": "flood", "itls": [0.025, 0.06], "victim": {**victim, "seconds": 1.4}, "settle_s": 14.0,
         "attacker": {"ResourceExhausted": 30, "InvalidArgument": 1}, "compiler": {"refused": 30.0, "timeout": 1.0}},
        {"condition": "flood", "itls": [0.03], "victim": {**victim, "outcome": "InvalidArgument"}, "settle_s": 12.0,
         "attacker": {"ResourceExhausted": 5}, "compiler": {"refused": 5.0}},
    ]
    s = sf.flood_summary(phases)
    assert s["attacker"] == {"ResourceExhausted": 35, "InvalidArgument": 1}
    assert s["victim"]["flood"]["served"] == 1 and s["victim"]["flood"]["requests"] == 2
    assert s["victim"]["solo"] == {"served": 1, "requests": 1, "seconds": [1.2], "first_token_s": [None], "outcomes": ["served"]}
    assert s["streams"]["solo"]["n"] == 2 and s["streams"]["beside"]["n"] == 3
    args = StructuredOptions(command="python -m benchmarks structured --parts flood").settings()
    text = "\n".join(sf.render_flood({"phases": phases, "summary": s}, args, ["the command"]))
    assert "served 1 of 2" in text and "**missed**" in text  # a victim refused is the bar missed
    assert "35 ResourceExhausted" in text and "35 refused" in text and "14, 12 s" in text
    assert sf.outcome_of(None) == "served" and sf.outcome_of(ValueError("x")) == "ValueError"
    assert sf.victim_schema(1) != sf.victim_schema(2)


@pytest.mark.parametrize(
    "field, value",
    [("repeats", 0), ("streams", 0), ("slow_patterns", 677), ("isolation_repeats", 0), ("flood_patterns", 0),
     ("flood_requests", 0), ("flood_repeats", 0)],
)
def test_options_refuse_what_no_run_can_do(field, value):
    with pytest.raises(ValueError):
        StructuredOptions(**{field: value})


def test_the_benchmark_readme_links_every_other_report_by_its_heading(tmp_path):
    from specserve.bench.report import other_reports

    assert other_reports(tmp_path) == []
    (tmp_path / "README.md").write_text("# the report itself\n")
    (tmp_path / "structured.md").write_text("intro\n# Structured output: speed\n## a part\n")
    (tmp_path / "a.md").write_text("no heading\n")
    assert other_reports(tmp_path) == [
        "## Other reports",
        "",
        "- [a.md](a.md): a",
        "- [structured.md](structured.md): Structured output: speed",
        "",
    ]

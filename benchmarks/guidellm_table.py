"""The table docs/benchmarks/tools.md shows from guidellm's own JSON reports (``guidellm-c{1,4,8}.json``).

    python -m benchmarks guidellm-table guidellm-c1.json guidellm-c4.json guidellm-c8.json
"""

from __future__ import annotations

import json


def row(path: str) -> str:
    bench = json.load(open(path))["benchmarks"][0]
    metrics = bench["metrics"]

    def ok(name: str) -> dict:
        return metrics[name]["successful"]

    streams = bench["config"]["strategy"].get("streams", "?")
    totals = metrics["request_totals"]
    tokens = ok("output_token_count")["total_sum"]
    return (
        f"| {streams} | {totals['successful']} of {totals['total']} | {tokens / bench['duration']:.1f} "
        f"| {ok('time_to_first_token_ms')['median']:.0f} | {ok('inter_token_latency_ms')['median']:.1f} "
        f"| {ok('request_latency')['median']:.2f} |"
    )


def main(paths: list[str]) -> None:
    print("| concurrency | requests served | output tok/s | TTFT median (ms) | ITL median (ms) | latency median (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for path in paths:
        print(row(path))


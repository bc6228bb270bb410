"""aiperf (NVIDIA's benchmark tool), unchanged, against ``specserve up``: 8 streamed chat requests at
concurrency 4, temperature 0, with the server's own token counts (``--use-server-token-count``: the tiny
test model's random text does not tokenize back to the tokens it was generated from, which aiperf's own
count assumes). It must find the server's Prometheus metrics on the API's port, as it finds vLLM's."""

from __future__ import annotations

import json
import subprocess

import pytest
from compat_helpers import command_line_tool, served_again

pytestmark = pytest.mark.system


def test_aiperf_runs_and_finds_the_metrics_on_the_api_port(server, tmp_path):
    aiperf = command_line_tool("aiperf")
    artifacts = tmp_path / "artifacts"
    run = subprocess.run(
        [
            aiperf, "profile", "--model", server.model, "--url", server.root, "--endpoint-type", "chat",
            "--streaming", "--tokenizer", str(server.tokenizer_dir), "--concurrency", "4", "--request-count", "8",
            "--prompt-input-tokens-mean", "64", "--prompt-output-tokens-mean", "24",
            "--extra-inputs", "temperature:0", "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
            "--output-artifact-dir", str(artifacts), "--export-outputs-json", "--no-auto-plot",
        ],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    assert summary["error_summary"] == [] and summary["request_error_rate"]["avg"] == 0.0
    assert summary["completed_request_count"]["avg"] == 8

    scraped = json.loads((artifacts / "server_metrics_export.json").read_text())
    assert scraped["summary"]["endpoints_successful"] == [f"{server.root}/metrics"]
    assert "vllm:generation_tokens" in scraped["metrics"], sorted(scraped["metrics"])[:20]

    sent = {
        conversation["session_id"]: conversation["payloads"][0]
        for conversation in json.loads((artifacts / "inputs.json").read_text())["data"]
    }
    records = {
        r["metadata"]["conversation_id"]: r["metrics"]
        for r in map(json.loads, (artifacts / "profile_export.jsonl").read_text().splitlines())
    }
    outputs = json.loads((artifacts / "outputs.json").read_text())["data"]
    assert len(outputs) == len(records) == 8
    for out in outputs:
        body, metrics = sent[out["conversation_id"]], records[out["conversation_id"]]
        assert body["temperature"] == 0 and body["stream"] is True
        again = served_again(server.base_url, "chat/completions", body)
        assert out["response_text"] == again["choices"][0]["message"]["content"]
        assert metrics["usage_completion_tokens"]["value"] == again["usage"]["completion_tokens"] == 24
        assert metrics["output_sequence_length"]["value"] == 24
        assert metrics["usage_prompt_tokens"]["value"] == again["usage"]["prompt_tokens"]

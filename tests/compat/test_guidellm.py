"""guidellm (the vLLM project's benchmark tool), unchanged, against ``specserve up``: the run of issue 45,
16 chat requests at concurrency 4 with 128 prompt and 48 output tokens (it streams with vLLM's
``continuous_usage_stats`` and sends ``ignore_eos``), at temperature 0 so that each streamed reply can be
checked against the same request not streamed."""

from __future__ import annotations

import json
import subprocess

import pytest
from compat_helpers import command_line_tool, reply_text, served_again

pytestmark = pytest.mark.system


def test_guidellm_runs_sixteen_requests_and_each_matches_the_server(server, tmp_path):
    guidellm = command_line_tool("guidellm")
    report = tmp_path / "guidellm.json"
    run = subprocess.run(
        [
            guidellm, "run",
            "--backend", f"kind=openai_http,target={server.root},model={server.model},extras.body.temperature=0",
            "--profile", "kind=concurrent,streams=4",
            "--constraint", "kind=max_requests,count=16",
            "--data", "kind=synthetic_text,prompt_tokens=128,output_tokens=48",
            "--tokenizer", f"kind=huggingface_auto,model={server.tokenizer_dir}",
            "--output", f"kind=json,path={report}",
            "--disable-console-interactive",
        ],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    benchmark = json.loads(report.read_text())["benchmarks"][0]
    requests = benchmark["requests"]
    assert len(requests["errored"]) == 0 and len(requests["incomplete"]) == 0, requests["errored"][:1]
    assert len(requests["successful"]) == 16
    for done in requests["successful"]:
        body = json.loads(done["request_args"])["body"]
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert body["temperature"] == 0 and body["ignore_eos"] is True
        again = served_again(server.base_url, "chat/completions", body)
        assert done["output"] == reply_text(again), "streamed text differs from the same request not streamed"
        assert done["output_metrics"]["text_tokens"] == again["usage"]["completion_tokens"] == 48
        assert done["input_metrics"]["text_tokens"] == again["usage"]["prompt_tokens"]

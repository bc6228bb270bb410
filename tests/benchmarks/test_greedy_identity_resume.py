"""``python -m benchmarks greedy-identity`` continues an interrupted run of the same settings, and only that."""

from __future__ import annotations

import json

import pytest

from benchmarks.greedy_identity import CHUNK, resumed

pytestmark = pytest.mark.unit


def _run(done: int, **changes):
    data = {
        "command": "old command",
        "target": "t",
        "draft": "d",
        "n": 200,
        "done": done,
        "max_new_tokens": 32,
        "configs": {"alone": {"identical": done}, "gamma0": {"identical": done}},
    }
    data.update(changes)
    return data


def test_the_same_run_continues_after_its_last_whole_chunk(tmp_path):
    path = tmp_path / "greedy_identity.json"
    path.write_text(json.dumps(_run(4 * CHUNK)))
    got = resumed(path, _run(0, command="new command"))
    assert got["done"] == 4 * CHUNK and got["configs"]["alone"]["identical"] == 4 * CHUNK
    assert got["command"] == "new command"


def test_another_run_or_no_file_or_a_broken_file_starts_over(tmp_path):
    path = tmp_path / "greedy_identity.json"
    fresh = _run(0)
    assert resumed(path, fresh) is fresh
    for other in (_run(8, n=100), _run(8, max_new_tokens=64), _run(8, draft="x"), _run(8, configs={"alone": {}})):
        path.write_text(json.dumps(other))
        assert resumed(path, fresh) is fresh
    path.write_text(json.dumps(_run(CHUNK + 3)))  # not written after a whole chunk
    assert resumed(path, fresh) is fresh
    path.write_text("{not json")
    assert resumed(path, fresh) is fresh

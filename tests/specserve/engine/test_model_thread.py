"""specserve.engine.model_thread: torch's parallel work stays on the model thread of a worker process.

Each check runs in a fresh Python process (torch's thread settings are per process and per thread,
and pytest's own process has run torch on every thread it likes).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.skipif(
    not sys.platform.startswith("linux") or (os.cpu_count() or 1) < 2,
    reason="counts a process's threads in /proc; needs torch on more than one thread",
), pytest.mark.system]

#: A worker's life in miniature: the model's work on its ModelThread, then a request's checks on the
#: main thread (an event loop's), big enough for torch to split across threads (dense draft
#: distributions over a vocabulary of 49,152, as the default target's Verify checks them).
SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    from specserve.engine.model_thread import ModelThread, serial_torch_off_the_model_thread

    def threads():
        return len(os.listdir("/proc/self/task"))

    model = ModelThread("model")
    model.call(lambda: torch.randn(512, 512) @ torch.randn(512, 512))  # the model loads and runs
    model_threads = model.call(torch.get_num_threads)
    if sys.argv[1] == "serial":
        serial_torch_off_the_model_thread()
    before = threads()
    q = torch.rand(4, 49152, dtype=torch.float64)
    for _ in range(3):
        assert bool(torch.isfinite(q).all()) and not bool((q < 0).any())
        q = (q / q.sum(-1, keepdim=True)).exp()
    after = threads()
    again = model.call(torch.get_num_threads)
    model.call(lambda: torch.randn(512, 512) @ torch.randn(512, 512))
    print(before, after, model_threads, again, threads())
    """
)


def _run(mode: str) -> list[int]:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}  # a worker's count here (tests' own processes run with 1)
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return [int(x) for x in out.stdout.split()]


def test_a_worker_s_event_loop_runs_torch_serially_and_starts_no_second_thread_team():
    """After serial_torch_off_the_model_thread (run_role calls it once the role has started) the main
    thread's tensor work starts no OpenMP threads of its own, and the model thread keeps its count."""
    before, after, model_threads, again, end = _run("serial")
    assert after == before == end
    assert again == model_threads == 2


def test_without_it_the_main_thread_s_tensor_work_starts_a_second_team():
    """What the first test guards against, shown on this machine: the same work on the main thread
    starts OpenMP threads of its own, beside the model thread's (libgomp then stops the teams' threads
    from spinning at barriers, which slowed the default target's step from 23 to 33 ms)."""
    before, after, *_ = _run("parallel")
    assert after > before


#: A draft replica built with ``threads`` from argv[2] in a process whose OpenMP default is 2: the
#: count its model thread runs with, and the process's thread count before and after passes there
#: large enough for torch to split (a second team would show as new threads).
WORKER_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    from specserve.draft.server import build_draft
    from specserve.runtime.config import DraftSettings

    settings = DraftSettings(model=sys.argv[1], threads=int(sys.argv[2]), host="127.0.0.1", port=0, warmup=False)
    app = build_draft(settings)
    thread = app.engine.thread
    before = len(os.listdir("/proc/self/task"))
    for _ in range(3):
        thread.call(lambda: torch.randn(512, 512) @ torch.randn(512, 512))
    print(thread.call(torch.get_num_threads), before, len(os.listdir("/proc/self/task")))
    """
)


def _worker(model_dir, threads: int) -> list[int]:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", WORKER_SCRIPT, str(model_dir), str(threads)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return [int(x) for x in out.stdout.splitlines()[-1].split()]  # after the load's log lines


def test_a_worker_s_threads_setting_is_its_model_thread_s_count_and_starts_no_team(tmp_path):
    """``threads = 1`` (what `specserve up` gives its draft): the model thread runs torch serially, and
    its passes start no OpenMP threads; ``threads = 0`` keeps torch's default (2 here)."""
    from tiny_models import make_tiny_pair

    _, draft_dir = make_tiny_pair(tmp_path)
    count, before, after = _worker(draft_dir, 1)
    assert count == 1 and after == before
    count, _, _ = _worker(draft_dir, 0)
    assert count == 2

"""Every collected test is in exactly one tier, ``unit`` or ``system`` (tests/conftest.py says which is which),
and the unit guard (tests/tiers.py) sees what a unit test must not do."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tiers import TIER_PROBLEMS, UnitGuard

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_every_collected_test_is_in_exactly_one_tier(request):
    problems = request.config.stash[TIER_PROBLEMS]
    listed = "\n".join(f"  {nodeid}: {tiers or 'no tier'}" for nodeid, tiers in sorted(problems.items()))
    assert not problems, (
        f"{len(problems)} tests need exactly one of the marks unit / system "
        f"(pytestmark = pytest.mark.unit or pytest.mark.system in the module, or on the test):\n{listed}"
    )


@pytest.mark.system  # it starts a process, binds a socket, listens and reads a real model's file: on purpose
def test_the_unit_guard_sees_a_process_a_socket_a_server_and_a_real_model():
    guard = UnitGuard()
    guard.start()
    assert guard.stop() == [], "nothing done, nothing seen"

    guard.start()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        (ROOT / "models" / "specserve-demo-target" / "config.json").read_bytes()
        seen = guard.stop()
    assert [v.split(" (")[0] for v in seen] == [
        "started a process",
        "opened a socket",
        "opened a real model's file",
        "left this process listening on a new port",
    ], seen

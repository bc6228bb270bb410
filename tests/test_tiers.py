"""Every collected test is in exactly one tier, ``unit`` or ``system`` (tests/conftest.py says which is which)."""

import pytest
from tiers import TIER_PROBLEMS

pytestmark = pytest.mark.unit


def test_every_collected_test_is_in_exactly_one_tier(request):
    problems = request.config.stash[TIER_PROBLEMS]
    listed = "\n".join(f"  {nodeid}: {tiers or 'no tier'}" for nodeid, tiers in sorted(problems.items()))
    assert not problems, (
        f"{len(problems)} tests need exactly one of the marks unit / system "
        f"(pytestmark = pytest.mark.unit or pytest.mark.system in the module, or on the test):\n{listed}"
    )

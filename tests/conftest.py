import os
import sys

# tests/ holds shared helpers (tests/helpers.py) imported by unit and distributed tests.
sys.path.insert(0, os.path.dirname(__file__))
# Keep the two cores for the test itself; torch's default may oversubscribe in spawned ranks.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402  (after the path and environment above, which the imports below need)

from infinity.placement import split_choice  # noqa: E402


@pytest.fixture(autouse=True)
def _no_cached_machine_figures(monkeypatch):
    """``offload_optimizer.device: auto`` chooses its split with the figures ``infinity bench --machine`` cached on
    this machine, if any: the tests do not depend on them (a test of the choice gives its own)."""
    monkeypatch.setattr(split_choice, "split_figures", lambda: None)

import os
import sys

# tests/ holds shared helpers (tests/helpers.py) imported by unit and distributed tests.
sys.path.insert(0, os.path.dirname(__file__))
# Keep the two cores for the test itself; torch's default may oversubscribe in spawned ranks.
os.environ.setdefault("OMP_NUM_THREADS", "1")

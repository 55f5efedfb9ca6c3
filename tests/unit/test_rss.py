"""The process's own peak RSS: not its parent's, which Linux's ru_maxrss carries across exec."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from infinity.runtime.rss import peak_rss_bytes

pytestmark = pytest.mark.device_independent  # the distinct-device pass leaves it out

CHILD = "from infinity.runtime.rss import peak_rss_bytes; print(peak_rss_bytes())"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and Linux's ru_maxrss")
def test_a_child_reports_its_own_peak_not_its_parents():
    held = torch.ones(96 * 2**20)  # 384 MiB touched here, in the parent
    child = int(subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                               check=True).stdout.strip())
    assert child < held.numel() * 4 // 2  # its own: an interpreter and infinity's imports
    assert peak_rss_bytes() >= held.numel() * 4

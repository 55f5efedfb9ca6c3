"""The freed heap a step leaves behind, given back to the system: measured in the process's own RSS."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import infinity
from helpers import TinyGPT, engine_config, gpt_batches
from infinity.engine import engine as engine_module
from infinity.runtime import allocator

pytestmark = pytest.mark.device_independent  # glibc's heap, whatever the tiers: the distinct pass leaves it out

FRAGMENTED = textwrap.dedent("""
    import json, re, sys
    import torch
    from infinity.runtime import allocator

    def rss_anon():
        return int(re.search(r"RssAnon:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) << 10

    allocator.keep_large_blocks_mapped()
    blocks = [torch.ones(50_000 + 997 * i % 200_000) for i in range(1500)]  # 0.2-1 MB each: from the heap
    del blocks[::2]                                                       # every other one freed: holes
    before = rss_anon()
    freed = allocator.give_back_freed_heap()
    print(json.dumps({"freed": freed, "before": before, "after": rss_anon()}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_heap_is_given_back_and_rss_falls_by_it():
    out = subprocess.run([sys.executable, "-c", FRAGMENTED], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if r["freed"] == 0:
        pytest.skip("no glibc mallinfo2 here")
    assert r["freed"] > allocator.FREED_HEAP_TRIM_NBYTES
    assert r["before"] - r["after"] > 0.8 * r["freed"], r  # the holes' pages went back


def test_nothing_is_done_when_malloc_tuning_is_off(monkeypatch):
    monkeypatch.setenv("INFINITY_MALLOC_TUNING", "0")
    monkeypatch.setattr(allocator, "_libc", None)  # read the setting again
    assert allocator.give_back_freed_heap(0) == 0


def test_the_engine_gives_it_back_at_each_optimizer_step_on_the_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(engine_module, "give_back_freed_heap", lambda: calls.append(1) or 0)
    torch.manual_seed(0)
    config = engine_config(param="cpu", optimizer="cpu", nvme_path=None, accum=2, clip=1.0, lr=1e-3)
    with infinity.initialize(TinyGPT(), config) as engine:
        for x, y in gpt_batches(4, batch=2):  # 4 micro-batches: 2 optimizer steps
            engine.backward(engine(x, y))
            engine.step()
        assert engine.device.type == "cpu"
    assert len(calls) == 2

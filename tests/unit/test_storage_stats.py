"""TierStats: budgets refuse rather than overshoot; counters are consistent under threads."""

import threading

import pytest

from infinity.storage import TierStats

pytestmark = pytest.mark.device_independent  # the distinct-device pass leaves it out


def test_allocate_free_peak_and_snapshot_keys():
    s = TierStats("host", budget_nbytes=100)
    s.allocate(60)
    s.allocate(40)
    s.free(70)
    assert (s.live_nbytes, s.peak_nbytes) == (30, 100)
    s.reset_peak()
    assert s.peak_nbytes == 30
    s.record_read(5)
    s.record_write(7)
    s.record_wait(0.25)
    assert s.snapshot() == {
        "live_nbytes": 30, "peak_nbytes": 30, "bytes_read": 5, "bytes_written": 7, "wait_s": 0.25,
        "budget_nbytes": 100,
    }  # fmt: skip


def test_over_budget_raises_naming_tier_request_and_budget():
    s = TierStats("nvme", budget_nbytes=4096)
    s.allocate(4000)
    with pytest.raises(MemoryError, match=r"'nvme'.*4096 bytes.*budget of 4096 bytes"):
        s.allocate(4096)
    assert s.live_nbytes == 4000  # unchanged by the refused request


def test_free_more_than_live_is_an_error():
    s = TierStats("host")
    s.allocate(10)
    with pytest.raises(ValueError, match="only 10 bytes are live"):
        s.free(11)


def test_concurrent_updates_never_pass_the_budget():
    s = TierStats("host", budget_nbytes=1000)
    seen_over = []

    def worker():
        for _ in range(2000):
            try:
                s.allocate(100)
            except MemoryError:
                continue
            if s.live_nbytes > 1000:
                seen_over.append(s.live_nbytes)
            s.record_write(1)
            s.free(100)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not seen_over
    assert s.live_nbytes == 0 and s.peak_nbytes <= 1000
    assert s.bytes_written <= 8000


def test_live_bytes_are_kept_by_owner_and_a_refusal_names_them():
    host = TierStats("host memory", 1000)
    device = TierStats("device", within=host)
    device.allocate(600, "gathered parameters")
    host.allocate(300, "optimizer staging")
    device.free(200, "gathered parameters")
    assert host.live_by_owner() == {"gathered parameters": 400, "optimizer staging": 300}
    assert device.live_by_owner() == {"gathered parameters": 400}
    with pytest.raises(MemoryError) as refused:
        device.allocate(400, "gathered parameters")
    message = str(refused.value)
    assert "tier 'host memory'" in message and "gathered parameters 400 B, optimizer staging 300 B" in message
    assert device.live_nbytes == 400 and host.live_nbytes == 700  # nothing counted by the refused allocation

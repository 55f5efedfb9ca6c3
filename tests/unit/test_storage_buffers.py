"""Aligned host buffers and the budgeted pool."""

import random
import threading
import time

import pytest
import torch

from infinity.storage import ALIGNMENT, HostBufferPool, TierStats, aligned_empty, aligned_storage

pytestmark = pytest.mark.device_independent  # the distinct-device pass leaves it out


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16, torch.float64, torch.bool])
@pytest.mark.parametrize("numel", [0, 1, 1023, 4096, 3 * 1024 * 1024 + 5])
def test_aligned_empty_is_aligned_and_rounded(numel, dtype):
    t = aligned_empty(numel, dtype)
    assert t.dtype == dtype and t.shape == (numel,) and t.is_contiguous()
    assert t.data_ptr() % 4096 == 0
    nbytes = t.untyped_storage().nbytes()
    assert nbytes % 4096 == 0 and nbytes >= max(numel * t.element_size(), 4096)
    assert nbytes - numel * t.element_size() < 4096 or numel == 0
    t.view(torch.uint8).fill_(1) if numel else None  # writable through its whole length


def test_aligned_empty_pin_without_cuda_falls_back_to_pageable():
    t = aligned_empty(100, torch.float32, pin=True)
    assert t.data_ptr() % 4096 == 0
    if not torch.cuda.is_available():
        assert not t.is_pinned()


def test_pool_hands_out_aligned_buffers_and_accounts_rounded_bytes():
    stats = TierStats("host")
    pool = HostBufferPool(1 << 20, stats=stats)
    a = pool.acquire(5000)
    b = pool.acquire(4096)
    assert a.dtype == torch.uint8 and a.numel() == 5000 and a.data_ptr() % 4096 == 0
    assert pool.live_nbytes == 8192 + 4096 == stats.live_nbytes
    pool.release(a)
    assert pool.live_nbytes == 4096 and pool.peak_nbytes == 12288
    c = pool.acquire(8000)  # same rounded size: the kept buffer is reused
    assert c.data_ptr() == a.data_ptr()
    pool.release(b)
    pool.release(c)
    assert pool.live_nbytes == 0 == stats.live_nbytes


def test_pool_request_larger_than_budget_fails_at_once_naming_both():
    pool = HostBufferPool(64 * 1024)
    with pytest.raises(MemoryError, match=r"100000 bytes.*65536 bytes"):
        pool.acquire(100_000)


def test_pool_timeout_zero_raises_instead_of_overshooting():
    pool = HostBufferPool(16384)
    held = pool.acquire(12288)
    with pytest.raises(MemoryError, match="no room"):
        pool.acquire(8192, timeout=0)
    start = time.monotonic()
    with pytest.raises(MemoryError, match="after waiting 0.05 s"):
        pool.acquire(8192, timeout=0.05)
    assert time.monotonic() - start >= 0.04
    assert pool.live_nbytes == 12288
    pool.release(held)


def test_pool_blocks_until_bytes_are_released():
    pool = HostBufferPool(8192)
    held = pool.acquire(8192)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(4096)))
    t.start()
    time.sleep(0.05)
    assert not got  # still waiting: the budget is full
    pool.release(held)
    t.join(5)
    assert got and pool.live_nbytes == 4096


def test_pool_evicts_kept_buffers_rather_than_overshoot():
    pool = HostBufferPool(16384)
    for size in (4096, 8192):
        pool.release(pool.acquire(size))  # kept: 12288 bytes
    c = pool.acquire(16384)  # needs the room the kept buffers hold
    assert pool.live_nbytes == 16384 and pool._cached_nbytes == 0
    pool.release(c)


def test_pool_release_of_foreign_or_twice_released_buffer():
    pool = HostBufferPool(8192)
    a = pool.acquire(10)
    pool.release(a)
    with pytest.raises(ValueError, match="not acquired from this pool or was already released"):
        pool.release(a)
    with pytest.raises(ValueError, match="not acquired"):
        pool.release(torch.empty(10, dtype=torch.uint8))


def test_pool_never_overshoots_under_concurrency():
    budget = 64 * 4096
    pool = HostBufferPool(budget)
    over = []

    def worker(seed):
        rng = random.Random(seed)
        for _ in range(200):
            buf = pool.acquire(rng.randrange(1, 16) * 4096 - rng.randrange(0, 4096), timeout=10)
            with pool._cond:  # a consistent view of in-use plus kept bytes
                held = pool.live_nbytes + pool._cached_nbytes
            if held > budget:
                over.append(held)
            pool.release(buf)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not over and pool.peak_nbytes <= budget and pool.live_nbytes == 0


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 5000, (2 << 20) + 3])
def test_aligned_storage_is_exactly_its_size_at_a_page_aligned_address(nbytes):
    storage = aligned_storage(nbytes)
    assert storage.nbytes() == nbytes and storage.data_ptr() % ALIGNMENT == 0
    view = torch.empty(0, dtype=torch.uint8).set_(storage)
    view.fill_(7)
    assert int(view.sum()) == 7 * nbytes
    with pytest.raises(ValueError, match="nbytes must be >= 1"):
        aligned_storage(0)

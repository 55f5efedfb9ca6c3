"""BackgroundPinner: buffers are handed out before they are registered, registered in order, skipped when they
die first, unregistered when they die after, and a failed registration surfaces on wait() while the buffer stays
usable. The registration is a fake (there is no GPU here) that records what a cudaHostRegister call would get."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from infinity.storage import ALIGNMENT, BackgroundPinner, HostBufferPool, aligned_empty

pytestmark = pytest.mark.device_independent  # the distinct-device pass leaves it out


class FakeCuda:
    """Records registrations; ``hold`` makes the next registrations wait until released."""

    def __init__(self) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.fail_with: BaseException | None = None

    def hold(self) -> None:
        self.release.clear()

    def register(self, ptr: int, nbytes: int) -> None:
        self.entered.set()
        assert self.release.wait(30), "the test never released the fake registration"
        if self.fail_with is not None:
            raise self.fail_with
        self.registered.append((ptr, nbytes))

    def unregister(self, ptr: int) -> None:
        self.unregistered.append(ptr)


@pytest.fixture
def cuda():
    return FakeCuda()


@pytest.fixture
def pinner(cuda):
    p = BackgroundPinner(cuda.register, cuda.unregister)
    yield p
    cuda.release.set()
    p.close()


def test_buffers_are_handed_out_before_registration_and_registered_in_order(cuda, pinner):
    cuda.hold()
    first = aligned_empty(10_000, torch.float32, pin=True, pinner=pinner)
    assert cuda.entered.wait(30)
    second = aligned_empty(3, torch.bfloat16, pin=True, pinner=pinner)
    # Both buffers are usable while the first registration is still in progress.
    first.fill_(1.5)
    second.fill_(2.0)
    assert cuda.registered == [] and pinner.pending_nbytes == 40_960 + ALIGNMENT
    cuda.release.set()
    pinner.wait()
    assert cuda.registered == [(first.data_ptr(), 40_960), (second.data_ptr(), ALIGNMENT)]
    assert pinner.pinned_nbytes == 40_960 + ALIGNMENT and pinner.pending_nbytes == 0
    assert torch.equal(first, torch.full((10_000,), 1.5)) and torch.equal(second, torch.full((3,), 2.0,
                                                                                              dtype=torch.bfloat16))


def test_a_buffer_is_unregistered_when_it_dies(cuda, pinner):
    buf = aligned_empty(1 << 20, torch.uint8, pin=True, pinner=pinner)
    pinner.wait()
    ptr = buf.data_ptr()
    assert cuda.registered == [(ptr, 1 << 20)] and cuda.unregistered == []
    del buf
    gc.collect()
    assert cuda.unregistered == [ptr]


def test_a_buffer_that_dies_before_its_turn_is_skipped(cuda, pinner):
    cuda.hold()
    kept = aligned_empty(4096, torch.uint8, pin=True, pinner=pinner)
    assert cuda.entered.wait(30)
    dropped = aligned_empty(8192, torch.uint8, pin=True, pinner=pinner)
    del dropped
    gc.collect()
    cuda.release.set()
    pinner.wait()
    assert cuda.registered == [(kept.data_ptr(), 4096)]
    assert pinner.skipped_nbytes == 8192 and pinner.pinned_nbytes == 4096


def test_a_failed_registration_is_raised_by_wait_and_the_buffer_stays_usable(cuda, pinner):
    cuda.fail_with = MemoryError("cudaHostRegister of 4096 bytes failed with CUDA error 2")
    buf = aligned_empty(1024, torch.float32, pin=True, pinner=pinner)
    with pytest.raises(MemoryError, match="cudaHostRegister of 4096 bytes"):
        pinner.wait()
    buf.copy_(torch.arange(1024, dtype=torch.float32))
    assert torch.equal(buf, torch.arange(1024, dtype=torch.float32)) and pinner.pinned_nbytes == 0


def test_close_drops_what_is_still_queued(cuda):
    pinner = BackgroundPinner(cuda.register, cuda.unregister)
    cuda.hold()
    first = aligned_empty(4096, torch.uint8, pin=True, pinner=pinner)
    assert cuda.entered.wait(30)
    rest = [aligned_empty(4096, torch.uint8, pin=True, pinner=pinner) for _ in range(3)]
    closer = threading.Thread(target=pinner.close)
    closer.start()
    cuda.release.set()
    closer.join(30)
    assert not closer.is_alive()
    assert cuda.registered == [(first.data_ptr(), 4096)] and pinner.pending_nbytes == 0
    with pytest.raises(RuntimeError, match="after close"):
        aligned_empty(4096, torch.uint8, pin=True, pinner=pinner)
    assert len(rest) == 3


def test_host_buffer_pool_pins_through_its_pinner_and_only_new_buffers(cuda, pinner):
    pool = HostBufferPool(1 << 20, pin=True, pinner=pinner)
    a = pool.acquire(5000)
    pool.release(a)
    b = pool.acquire(5000)  # the kept buffer again: already pinned, not registered twice
    pinner.wait()
    assert b.data_ptr() == a.data_ptr()
    assert cuda.registered == [(a.data_ptr(), 8192)]


def test_unpinned_buffers_never_reach_the_pinner(cuda, pinner):
    aligned_empty(4096, torch.uint8, pinner=pinner)
    HostBufferPool(1 << 20, pinner=pinner).acquire(100)
    pinner.wait()
    assert cuda.registered == []

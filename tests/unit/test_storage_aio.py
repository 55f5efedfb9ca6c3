"""AsyncIO: both backends give the same results; every failure names file, offset and errno."""

import errno
import os

import pytest
import torch

import infinity.storage.aio as aio_module
from infinity.storage import AsyncIO, aligned_empty, libaio_unavailable_reason
from infinity.storage.swap_store import direct_io_problem

pytestmark = pytest.mark.device_independent  # the distinct-device pass leaves it out

BACKENDS = [
    "threads",
    pytest.param("libaio", marks=pytest.mark.skipif(libaio_unavailable_reason() is not None,
                                                    reason=f"libaio unavailable: {libaio_unavailable_reason()}")),
]  # fmt: skip


@pytest.fixture
def direct_dir(tmp_path):
    if direct_io_problem(tmp_path):
        pytest.skip(f"{tmp_path} does not take O_DIRECT: {direct_io_problem(tmp_path)}")
    return tmp_path


def _random(nbytes, seed=0):
    g = torch.Generator().manual_seed(seed)
    buf = aligned_empty(nbytes, torch.uint8)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
    return buf


@pytest.mark.parametrize("thread_count, single_submit, overlap_events", [(1, False, True), (2, True, False)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_roundtrip_many_requests_in_flight(direct_dir, backend, thread_count, single_submit, overlap_events):
    path = direct_dir / "data"
    chunks = [_random(n, seed=i) for i, n in enumerate([4096, 65536, 3 * 65536, 12288, 40960] * 4)]
    offsets, off = [], 0
    for c in chunks:
        offsets.append(off)
        off += c.numel()
    with AsyncIO(backend, block_size=16384, queue_depth=4, thread_count=thread_count, single_submit=single_submit,
                 overlap_events=overlap_events) as io:  # fmt: skip
        assert io.backend == backend
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            handles = [io.pwrite(fd, c, o) for c, o in zip(chunks, offsets)]
            for h in handles:
                h.wait()
                assert h.done()
            outs = [aligned_empty(c.numel(), torch.uint8) for c in chunks]
            handles = [io.pread(fd, out, o) for out, o in zip(outs, offsets)]
            for h in handles:
                h.wait()
        finally:
            os.close(fd)
    for c, out in zip(chunks, outs):
        assert torch.equal(c, out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_path_form_opens_and_closes_the_file(direct_dir, backend):
    data = _random(65536)
    out = aligned_empty(65536, torch.uint8)
    with AsyncIO(backend, block_size=8192, queue_depth=2) as io:
        io.pwrite(direct_dir / "f", data).wait()
        io.pread(str(direct_dir / "f"), out).wait()
    assert torch.equal(data, out)
    assert os.stat(direct_dir / "f").st_mode & 0o777 == 0o600


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_past_end_of_file_names_file_offset_and_errno(direct_dir, backend):
    path = direct_dir / "short"
    with AsyncIO(backend, block_size=4096, queue_depth=4) as io:
        io.pwrite(path, _random(8192)).wait()
        h = io.pread(path, aligned_empty(32768, torch.uint8), 0)
        with pytest.raises(OSError) as info:
            h.wait()
    err = info.value
    assert err.errno == errno.EIO and err.filename == str(path)
    assert "unexpected end of file" in str(err) and "at offset 8192" in str(err)


@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_request_raises_the_os_error(direct_dir, backend):
    path = direct_dir / "ro"
    path.write_bytes(b"\0" * 8192)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with AsyncIO(backend, block_size=4096, queue_depth=2) as io:
            h = io.pwrite(fd, _random(8192), 4096)
            with pytest.raises(OSError) as info:
                h.wait()
            assert h.done() and isinstance(h.error(), OSError)
    finally:
        os.close(fd)
    assert info.value.errno == errno.EBADF and info.value.filename == str(path)
    assert "write of 4096 bytes at offset 4096" in str(info.value) and info.value.offset == 4096


def test_misaligned_buffer_or_offset_is_a_value_error(direct_dir):
    with AsyncIO("threads") as io:
        buf = aligned_empty(8192, torch.uint8)
        for args in ((buf[1:4097], 0), (buf[:100], 0), (buf[:4096], 512)):
            with pytest.raises(ValueError, match="4096-aligned"):
                io.pwrite(direct_dir / "x", *args)
        with pytest.raises(ValueError, match="contiguous CPU tensor"):
            io.pwrite(direct_dir / "x", buf.view(2, 4096)[:, :2048])


def test_bad_settings_are_value_errors():
    with pytest.raises(ValueError, match="unknown backend 'spdk'"):
        AsyncIO("spdk")
    with pytest.raises(ValueError, match="block_size"):
        AsyncIO("threads", block_size=1000)
    with pytest.raises(ValueError, match="queue_depth"):
        AsyncIO("threads", queue_depth=0)


def test_auto_picks_libaio_when_it_works_and_says_why_not_otherwise(monkeypatch, caplog):
    with AsyncIO("auto") as io:
        assert io.backend == ("libaio" if libaio_unavailable_reason() is None else "threads")
    monkeypatch.setattr(aio_module, "_libaio_probe", ("the libaio package is not installed (test)", None))
    with caplog.at_level("INFO", logger="infinity.storage.aio"):
        with AsyncIO("auto") as io:
            assert io.backend == "threads"
    assert "not installed (test)" in caplog.text
    with pytest.raises(OSError, match="libaio backend was asked for"):
        AsyncIO("libaio")


def test_threads_backend_requeues_short_transfers_and_eagain(direct_dir, monkeypatch):
    """The kernel rarely returns short O_DIRECT transfers or EAGAIN; make it, and check the data."""
    real = {"preadv": os.preadv, "pwritev": os.pwritev}
    calls = {"short": 0, "again": 0}

    def flaky(name):
        def call(fd, buffers, offset):
            (view,) = buffers
            n = len(memoryview(view))
            if n >= 8192 and (offset // 4096) % 3 == 0:  # half of it, once per such block
                calls["short"] += 1
                half = (n // 2) // 4096 * 4096
                return real[name](fd, [memoryview(view)[:half]], offset)
            if (offset // 4096) % 3 == 1 and calls["again"] < 5:
                calls["again"] += 1
                raise BlockingIOError(errno.EAGAIN, "try again")
            return real[name](fd, buffers, offset)

        return call

    monkeypatch.setattr(aio_module.os, "preadv", flaky("preadv"))
    monkeypatch.setattr(aio_module.os, "pwritev", flaky("pwritev"))
    data = _random(20 * 4096)
    out = aligned_empty(data.numel(), torch.uint8)
    with AsyncIO("threads", block_size=16384, queue_depth=3) as io:
        io.pwrite(direct_dir / "flaky", data).wait()
        io.pread(direct_dir / "flaky", out).wait()
    assert calls["short"] > 0 and calls["again"] > 0
    assert torch.equal(data, out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_waits_for_requests_in_flight(direct_dir, backend):
    io = AsyncIO(backend, block_size=4096, queue_depth=2)
    data = _random(1 << 20)
    handles = [io.pwrite(direct_dir / f"f{i}", data) for i in range(4)]
    io.close()
    assert all(h.done() for h in handles)
    for h in handles:
        h.wait()
    with pytest.raises(ValueError, match="after close"):
        io.pwrite(direct_dir / "late", data)
    io.close()  # idempotent


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_cancel_drops_blocks_not_yet_issued(direct_dir, backend):
    io = AsyncIO(backend, block_size=4096, queue_depth=1)
    data = _random(4 << 20)
    handles = [io.pwrite(direct_dir / f"f{i}", data) for i in range(3)]
    io.close(cancel=True)
    outcomes = []
    for h in handles:
        assert h.done()
        try:
            h.wait()
            outcomes.append("ok")
        except OSError as exc:
            assert exc.errno == errno.ECANCELED and "cancelled by close()" in str(exc)
            outcomes.append("cancelled")
    assert "cancelled" in outcomes


def test_urgent_requests_go_ahead_of_queued_writes():
    """Reads (urgent by default) pass queued writes nobody waits for, even one already started."""
    from infinity.storage.aio import READ, WRITE, _Core, _Request

    def request(op, urgent=None):
        req = _Request(op, 0, "f", [(0, 4096, 0)], None, None, False)
        if urgent is not None:
            req.urgent = urgent
        return req

    core = _Core("threads", None, 1 << 20, 4, 1, False, True)
    started, w1, w2 = request(WRITE), request(WRITE), request(WRITE)
    started.inflight = 1
    for req in (started, w1, w2):
        core._enqueue(req)
    r1, urgent_write, r2 = request(READ), request(WRITE, urgent=True), request(READ)
    for req in (r1, urgent_write, r2):
        core._enqueue(req)
    assert list(core.queue) == [r1, urgent_write, r2, started, w1, w2]

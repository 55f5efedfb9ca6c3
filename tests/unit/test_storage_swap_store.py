"""SwapStore: round trips of every dtype and odd size through both backends, and each failure
a clear error with nothing left behind."""

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from infinity.storage import (
    AsyncIO,
    DirectIOUnsupported,
    SwapStore,
    TierStats,
    aligned_empty,
    libaio_unavailable_reason,
)
from infinity.storage.swap_store import direct_io_problem

pytestmark = pytest.mark.device_independent  # the distinct-device pass leaves it out

REPO = Path(__file__).resolve().parents[2]
BACKENDS = [
    "threads",
    pytest.param("libaio", marks=pytest.mark.skipif(libaio_unavailable_reason() is not None,
                                                    reason=f"libaio unavailable: {libaio_unavailable_reason()}")),
]  # fmt: skip
DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
    torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
]  # fmt: skip
NUMELS = [0, 1, 3, 1000, 1024, 4097, 70001]


@pytest.fixture
def swap_dir(tmp_path):
    if direct_io_problem(tmp_path):
        pytest.skip(f"{tmp_path} does not take O_DIRECT: {direct_io_problem(tmp_path)}")
    return tmp_path


def _random(numel, dtype, seed, *, aligned):
    """Random bytes as ``dtype``: aligned at 4096, or deliberately not."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    high = 2 if dtype == torch.bool else 256
    raw = torch.randint(0, high, (numel * itemsize,), dtype=torch.uint8, generator=g)
    if aligned:
        t = aligned_empty(numel, dtype)
    else:
        base = aligned_empty(numel + 1, dtype)
        t = base[1:]  # itemsize bytes past a page boundary
    t.view(torch.uint8).copy_(raw) if numel else None
    return t


def _bytes(t):
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _own_entries(directory):
    return sorted(p.name for p in Path(directory).glob("infinity-swap-*"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_roundtrip_every_dtype_and_odd_size_many_in_flight(swap_dir, backend):
    with SwapStore(swap_dir, backend=backend, block_size=16384, queue_depth=8) as store:
        tensors = {}
        for d, dtype in enumerate(DTYPES):
            for n, numel in enumerate(NUMELS):
                aligned = (d + n) % 2 == 0
                tensors[f"{dtype}/{numel}/{aligned}"] = _random(numel, dtype, seed=d * 100 + n, aligned=aligned)
        handles = [store.write(k, t) for k, t in tensors.items()]  # all in flight at once
        for h in handles:
            h.wait()
        outs = {}
        for i, (k, t) in enumerate(tensors.items()):
            outs[k] = _random(t.numel(), t.dtype, seed=-1, aligned=i % 3 == 0)  # a different alignment
        handles = [store.read(k, outs[k]) for k in tensors]
        for h in handles:
            h.wait()
        for k, t in tensors.items():
            assert torch.equal(_bytes(outs[k]), _bytes(t)), k
            assert store.nbytes(k) == t.numel() * t.element_size()
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        s = store.stats.snapshot()
        assert s["bytes_written"] == total == s["bytes_read"]
        assert s["live_nbytes"] == sum(-(-store.nbytes(k) // 4096) * 4096 for k in tensors)
        assert len(store) == len(tensors) and set(store.keys()) == set(tensors)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tail_reads_never_touch_memory_past_the_tensor(swap_dir, backend):
    with SwapStore(swap_dir, backend=backend, block_size=8192, queue_depth=4) as store:
        src = _random(10000, torch.uint8, 1, aligned=True)
        store.write("k", src).wait()
        page = aligned_empty(3 * 4096, torch.uint8)
        page.fill_(0xAB)
        out = page[:10000]
        store.read("k", out).wait()
        assert torch.equal(out, src)
        assert bool((page[10000:] == 0xAB).all())  # the bytes after the tensor are untouched


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_part_of_a_key_reads_its_own_bytes_of_the_file(swap_dir, backend):
    """``read(key, out, at=...)``: the bytes from ``at`` on, whatever ``out``'s alignment and size (a tail
    block inside the extent, a whole bounced range), after a write still in flight; bad ranges name the key."""
    with SwapStore(swap_dir, backend=backend, block_size=8192, queue_depth=4) as store:
        src = _random(50001, torch.uint8, 3, aligned=True)
        store.write("k", src)  # not waited for: the part reads queue behind it
        cases = [(0, 4096), (4096, 10000), (8192, 50001 - 8192), (40960, 1), (12288, 4096 * 3)]
        for i, (at, nbytes) in enumerate(cases):
            for aligned in (True, False):
                out = _random(nbytes, torch.uint8, seed=-i, aligned=aligned)
                store.read("k", out, at=at).wait()
                assert torch.equal(out, src[at:at + nbytes]), (at, nbytes, aligned)
        halves = torch.empty(2048, dtype=torch.bfloat16)  # any dtype: the bytes are what is read
        store.read("k", halves, at=4096).wait()
        assert torch.equal(halves.view(torch.uint8), src[4096:8192])
        page = aligned_empty(2 * 4096, torch.uint8)
        page.fill_(0xAB)
        store.read("k", page[:4100], at=45056).wait()  # 4945 bytes left in the key: the tail is bounced
        assert torch.equal(page[:4100], src[45056:45056 + 4100]) and bool((page[4100:] == 0xAB).all())
        with pytest.raises(ValueError, match=r"'k' holds 50001 bytes: cannot read 100 bytes from byte 100"):
            store.read("k", torch.empty(100, dtype=torch.uint8), at=100)
        with pytest.raises(ValueError, match=r"'k' holds 50001 bytes: cannot read 8192 bytes from byte 45056"):
            store.read("k", torch.empty(8192, dtype=torch.uint8), at=45056)
        assert store.stats.snapshot()["bytes_read"] == 2 * sum(n for _, n in cases) + 4096 + 4100


def test_rewrite_same_size_in_place_and_freed_extents_are_reused(swap_dir):
    with SwapStore(swap_dir, backend="threads", block_size=8192, queue_depth=4) as store:
        a = _random(20000, torch.uint8, 0, aligned=True)
        for k in ("a", "b", "c"):
            store.write(k, a).wait()
        size = store.file_nbytes
        offset = store._extents["b"].offset
        store.write("b", _random(20000, torch.uint8, 1, aligned=False)).wait()  # same rounded size
        assert store._extents["b"].offset == offset and store.file_nbytes == size
        store.delete("b")
        store.write("d", _random(5000, torch.uint8, 2, aligned=True)).wait()  # fits in b's hole
        assert store.file_nbytes == size
        for k in ("a", "c", "d"):
            store.delete(k)
        assert store.file_nbytes == 0 and os.path.getsize(store.directory / "swap.0") == 0
        assert store.stats.live_nbytes == 0 and store.stats.peak_nbytes == 3 * 20480


def test_read_of_a_key_never_written_is_a_key_error(swap_dir):
    with SwapStore(swap_dir, backend="threads") as store:
        with pytest.raises(KeyError, match="'nope' was never written"):
            store.read("nope", torch.empty(4))
        with pytest.raises(KeyError, match="'nope'"):
            store.delete("nope")
        with pytest.raises(KeyError, match="'nope'"):
            store.nbytes("nope")
        assert "nope" not in store


def test_size_mismatch_type_and_layout_errors_name_the_key(swap_dir):
    with SwapStore(swap_dir, backend="threads") as store:
        store.write("w", torch.ones(10)).wait()
        with pytest.raises(ValueError, match=r"'w' holds 40 bytes but the output tensor has 44 bytes"):
            store.read("w", torch.empty(11))
        with pytest.raises(ValueError, match="'x'.*contiguous"):
            store.write("x", torch.ones(4, 4).t())
        with pytest.raises(TypeError, match="swap keys are strings"):
            store.write(3, torch.ones(1))
        store.read("w", torch.empty(10, dtype=torch.int32)).wait()  # another dtype of the same size is fine


def test_nvme_budget_is_enforced_before_anything_is_written(swap_dir):
    stats = TierStats("nvme", budget_nbytes=8192)
    with SwapStore(swap_dir, backend="threads", stats=stats) as store:
        store.write("a", torch.ones(1024)).wait()  # 4096 bytes
        with pytest.raises(MemoryError, match="'nvme'.*budget of 8192 bytes"):
            store.write("b", torch.ones(2048))  # 8192 more
        assert "b" not in store and stats.live_nbytes == 4096


def test_permissions_and_private_directories(swap_dir):
    old = os.umask(0)
    try:
        a, b = SwapStore(swap_dir, backend="threads"), SwapStore(swap_dir, backend="threads")
    finally:
        os.umask(old)
    try:
        assert a.directory != b.directory and a.directory.parent == swap_dir
        a.write("k", torch.ones(3)).wait()
        for store in (a, b):
            assert os.stat(store.directory).st_mode & 0o777 == 0o700
            files = list(store.directory.iterdir())
            assert files and all(os.stat(f).st_mode & 0o777 == 0o600 for f in files)
    finally:
        a.close()
        b.close()
    assert _own_entries(swap_dir) == []


def test_missing_directory_is_a_clear_error(tmp_path):
    missing = tmp_path / "not" / "here"
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        SwapStore(missing, backend="threads")
    assert info.value.filename == str(missing)
    assert list(tmp_path.iterdir()) == []


def test_read_only_directory_is_a_clear_error_and_leaves_nothing(tmp_path):
    """A directory of mode 0555. Root writes there anyway (CAP_DAC_OVERRIDE), so the store is made
    in a child that first drops CAP_DAC_OVERRIDE from its effective capabilities: then root is held
    to the owner's r-x bits like anyone else."""
    ro = tmp_path / "read-only"
    ro.mkdir()
    ro.chmod(0o555)
    code = textwrap.dedent(f"""
        import ctypes, json, os, sys
        if os.geteuid() == 0:
            class Header(ctypes.Structure):
                _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
            class Data(ctypes.Structure):
                _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                            ("inheritable", ctypes.c_uint32)]
            libc = ctypes.CDLL(None, use_errno=True)
            header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
            if libc.capget(ctypes.byref(header), data) != 0:
                print(json.dumps({{"skip": "capget failed"}})); sys.exit(0)
            data[0].effective &= ~(1 << 1)  # CAP_DAC_OVERRIDE
            if libc.capset(ctypes.byref(header), data) != 0:
                print(json.dumps({{"skip": "cannot drop CAP_DAC_OVERRIDE"}})); sys.exit(0)
        from infinity.storage import SwapStore
        try:
            SwapStore({str(ro)!r}, backend="threads")
        except OSError as exc:
            print(json.dumps({{"type": type(exc).__name__, "errno": exc.errno, "msg": str(exc)}}))
        else:
            print(json.dumps({{"type": None}}))
    """)
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout.strip().splitlines()[-1])
        if "skip" in result:
            pytest.skip(result["skip"])
        assert result["type"] == "PermissionError" and result["errno"] == errno.EACCES, result
        assert str(ro) in result["msg"] and "private swap directory" in result["msg"]
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


def _shm():
    shm = Path("/dev/shm")
    if not shm.is_dir() or direct_io_problem(shm) is None or not os.access(shm, os.W_OK):
        pytest.skip("/dev/shm is not a writable tmpfs here")
    return shm


def test_tmpfs_is_refused_with_a_clear_error_and_leaves_nothing():
    shm = _shm()
    before = _own_entries(shm)
    with pytest.raises(DirectIOUnsupported, match="tmpfs.*buffered_fallback=True") as info:
        SwapStore(shm, backend="threads")
    assert info.value.filename == str(shm) and isinstance(info.value, OSError)
    assert _own_entries(shm) == before


def test_tmpfs_buffered_fallback_is_announced_and_works():
    shm = _shm()
    before = _own_entries(shm)
    with pytest.warns(RuntimeWarning, match=r"/dev/shm does not take direct I/O.*buffered"):
        store = SwapStore(shm, backend="threads", buffered_fallback=True)
    with store:
        assert not store.direct
        t = torch.randn(1001)
        store.write("k", t).wait()
        out = torch.empty_like(t)
        store.read("k", out).wait()
        assert torch.equal(out, t)
    assert _own_entries(shm) == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_file_size_limit_hit_mid_write(swap_dir, backend):
    """RLIMIT_FSIZE of 1 MiB in a child (SIGXFSZ ignored, so the write returns EFBIG) and a 4 MiB write."""
    code = textwrap.dedent(f"""
        import json, os, resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        import torch
        from infinity.storage import SwapStore
        store = SwapStore({str(swap_dir)!r}, backend={backend!r}, block_size=1 << 18, queue_depth=4)
        store.write("small", torch.ones(1000)).wait()
        h = store.write("big", torch.ones(1 << 20))
        result = {{"directory": str(store.directory)}}
        try:
            h.wait()
        except OSError as exc:
            result.update(errno=exc.errno, msg=str(exc), offset=getattr(exc, "offset", None))
        result["big_in_store"] = "big" in store
        result["file_size_after"] = os.path.getsize(store.directory / "swap.0")
        out = torch.empty(1000)
        store.read("small", out).wait()
        result["small_ok"] = bool((out == 1).all())
        store.close()
        result["exists_after_close"] = os.path.exists(result["directory"])
        print(json.dumps(result))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["errno"] == errno.EFBIG, r
    assert "File too large" in r["msg"] and "swap.0" in r["msg"] and "'big'" in r["msg"]
    assert f"at offset {r['offset']}" in r["msg"] and r["offset"] >= (1 << 20) - 4096
    assert not r["big_in_store"] and r["small_ok"]
    assert r["file_size_after"] <= 4096  # the partial extent was given back
    assert not r["exists_after_close"] and _own_entries(swap_dir) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_with_requests_in_flight_waits(swap_dir, backend):
    store = SwapStore(swap_dir, backend=backend, block_size=4096, queue_depth=2)
    tensors = [torch.full((65536,), float(i)) for i in range(16)]
    handles = [store.write(f"k{i}", t) for i, t in enumerate(tensors)]
    store.close()
    assert all(h.done() for h in handles)
    for h in handles:
        h.wait()
    assert not store.directory.exists() and store.stats.live_nbytes == 0
    with pytest.raises(ValueError, match="closed"):
        store.write("late", tensors[0])
    store.close()  # idempotent


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_cancel_with_requests_in_flight(swap_dir, backend):
    store = SwapStore(swap_dir, backend=backend, block_size=4096, queue_depth=1)
    handles = [store.write(f"k{i}", torch.ones(1 << 20)) for i in range(4)]
    store.close(cancel=True)
    for h in handles:
        assert h.done()
        try:
            h.wait()
        except OSError as exc:
            assert exc.errno == errno.ECANCELED
    assert not store.directory.exists() and _own_entries(swap_dir) == []


def test_shared_io_is_left_open_and_operations_on_a_key_are_ordered(swap_dir):
    with AsyncIO("threads", block_size=4096, queue_depth=4) as io:
        with SwapStore(swap_dir, io=io) as a, SwapStore(swap_dir, io=io) as b:
            for i in range(5):  # write, read, rewrite, read without waiting in between
                t = torch.full((3000,), float(i))
                a.write("k", t)
                b.write("k", t * 2)
            out_a, out_b = torch.empty(3000), torch.empty(3000)
            ha, hb = a.read("k", out_a), b.read("k", out_b)
            ha.wait()
            hb.wait()
            assert bool((out_a == 4).all()) and bool((out_b == 8).all())
        assert not io.closed
        io.pwrite(swap_dir / "still-open", aligned_empty(4096, torch.uint8)).wait()


def test_garbage_collected_store_removes_its_directory(swap_dir):
    store = SwapStore(swap_dir, backend="threads")
    store.write("k", torch.ones(10)).wait()
    directory = store.directory
    del store
    import gc

    gc.collect()
    assert not directory.exists()


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_safety_net_at_exit_lets_writes_queued_on_a_shared_io_finish(swap_dir, backend):
    """What runs at exit or garbage collection for a store never closed (a program that never closed its engine,
    its write-behind still queued) waits for the store's requests before closing its file: on a shared I/O engine
    they would otherwise run on a closed descriptor and fail with EBADF."""
    with AsyncIO(backend, block_size=1 << 20, queue_depth=1) as io:
        store = SwapStore(swap_dir, io=io)
        handles = [store.write(f"k{i}", torch.full((1 << 18,), float(i))) for i in range(64)]
        store._finalizer()  # as weakref.finalize calls it at exit
        assert not store.directory.exists()
        for h in handles:
            h.wait()  # each write ran on the open file, so none raises


def test_storage_imports_only_torch_numpy_stdlib_and_libaio():
    from helpers import absolute_imports

    allowed = set(sys.stdlib_module_names) | {"torch", "numpy", "libaio", "__future__"}
    for path in sorted((REPO / "storage").glob("*.py")):
        for name in absolute_imports(path):
            assert not name.startswith("torch.distributed"), f"{path.name} imports {name}"
            if name.startswith("infinity."):
                assert name.startswith("infinity.storage"), f"{path.name} imports {name}"
            else:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"


def test_a_read_right_after_an_unwaited_write_sees_the_write(tmp_path):
    """The read is held in the I/O queue behind the key's writes (the caller is not blocked)."""
    store = SwapStore(tmp_path)
    try:
        g = torch.Generator().manual_seed(0)
        for round_ in range(5):
            values = [torch.randn(300_000 + 1000 * i, generator=g) for i in range(6)]
            writes = [store.write(f"k{i}", v) for i, v in enumerate(values)]
            outs = [torch.empty_like(v) for v in values]
            reads = [store.read(f"k{i}", o) for i, o in enumerate(outs)]
            for h in reads + writes:
                h.wait()
            for v, o in zip(values, outs):
                assert torch.equal(v, o), round_
    finally:
        store.close()


def test_a_request_held_behind_a_failed_one_fails_too():
    import errno

    from infinity.storage.aio import READ, WRITE, _Core, _Request, io_error

    core = _Core("threads", None, 1 << 20, 4, 1, False, True)
    write = _Request(WRITE, 0, "f", [(0, 4096, 0)], None, None, False)
    read = _Request(READ, 0, "f", [(0, 4096, 0)], None, None, False)
    with core.cond:
        core.active += 1  # as if submitted and in flight
    core.submit(read, after=[write])
    assert not read.event.is_set() and read not in core.queue
    with core.cond:
        write.error = io_error(errno.EIO, WRITE, 4096, 0, "f")
        write.issued_all = True
        core.finish(write)
    assert read.event.is_set() and read.error is not None and read.error.errno == errno.ECANCELED


def test_a_dead_runs_swap_directory_is_removed_and_a_live_runs_is_not(tmp_path):
    """A store locks its file for its life; a later store removes unlocked, old siblings only."""
    import signal
    import time

    from infinity.storage import swap_store

    child = textwrap.dedent(f"""
        import sys, time, torch
        from infinity.storage import SwapStore
        store = SwapStore({str(tmp_path)!r})
        store.write("k", torch.ones(1 << 20)).wait()
        print(store.directory, flush=True)
        time.sleep(600)
    """)
    dead = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    live = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        dead_dir, live_dir = Path(dead.stdout.readline().strip()), Path(live.stdout.readline().strip())
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        assert dead_dir.exists()  # kill -9: nothing cleaned up
        old = time.time() - 2 * swap_store.STALE_AFTER_S
        for d in (dead_dir, live_dir):
            os.utime(d, (old, old))
        young_dead = tmp_path / "infinity-swap-young"
        young_dead.mkdir()  # being created right now by someone: too young to judge
        store = SwapStore(tmp_path)
        store.close()
        assert not dead_dir.exists()
        assert (live_dir / swap_store._SWAP_FILE).exists()  # its owner still holds the lock
        assert young_dead.exists()
    finally:
        for proc in (dead, live):
            proc.kill()
            proc.wait()
            proc.stdout.close()

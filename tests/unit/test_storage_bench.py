"""``measure_nvme_sustained``: its passes over a file set, the floors it gives, its checks and its clean-up."""

import pytest

from infinity.storage import libaio_unavailable_reason
from infinity.storage.bench import BenchBuffers, SustainedResult, measure_nvme_sustained
from infinity.storage.swap_store import direct_io_problem

pytestmark = pytest.mark.device_independent  # the distinct-device pass leaves it out

BACKENDS = [
    "threads",
    pytest.param("libaio", marks=pytest.mark.skipif(libaio_unavailable_reason() is not None,
                                                    reason=str(libaio_unavailable_reason()))),
]  # fmt: skip


@pytest.fixture
def bench_dir(tmp_path):
    if direct_io_problem(tmp_path):
        pytest.skip(f"{tmp_path} does not take O_DIRECT: {direct_io_problem(tmp_path)}")
    return tmp_path


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("files", [2, 3])
def test_passes_over_the_set_and_removes_it(bench_dir, backend, files):
    result = measure_nvme_sustained(bench_dir, nbytes=files << 20, file_nbytes=1 << 20, block_size=256 << 10,
                                    queue_depth=4, backend=backend, buffers=BenchBuffers(huge_pages=False))
    assert (result.backend, result.file_count, result.nbytes) == (backend, files, files << 20)
    assert min(result.write_s, result.read_s, result.mixed_s) > 0
    assert list(bench_dir.iterdir()) == []


def test_floors_follow_the_rates():
    result = SustainedResult(backend="threads", nbytes=4 * 10**9, file_count=4, block_size=1 << 20, queue_depth=32,
                             write_s=2.0, read_s=4.0, mixed_s=2.5)  # fmt: skip
    assert (result.write_GBps, result.read_GBps, result.mixed_GBps) == (2.0, 1.0, 1.6)
    assert result.floor_s(3 * 10**9, 4 * 10**9) == pytest.approx(3.0 + 2.0)
    assert result.mixed_floor_s(3 * 10**9, 5 * 10**9) == pytest.approx(5.0)


@pytest.mark.parametrize("nbytes, file_nbytes", [(1 << 20, 1 << 20), (3 << 19, 1 << 20), (2 << 20, 1000)])
def test_refuses_a_set_it_cannot_split(bench_dir, nbytes, file_nbytes):
    with pytest.raises(ValueError):
        measure_nvme_sustained(bench_dir, nbytes=nbytes, file_nbytes=file_nbytes)
    assert list(bench_dir.iterdir()) == []


def test_a_read_back_that_differs_is_an_error_and_the_files_go(bench_dir, monkeypatch):
    import torch

    monkeypatch.setattr(torch, "equal", lambda a, b: False)  # as if the disk returned other bytes
    with pytest.raises(OSError, match="read back differs"):
        measure_nvme_sustained(bench_dir, nbytes=2 << 20, file_nbytes=1 << 20, backend="threads",
                               buffers=BenchBuffers(huge_pages=False))
    assert list(bench_dir.iterdir()) == []


@pytest.mark.parametrize("rewrite", [False, True])
def test_a_rewrite_writes_the_file_once_before_the_timed_pass(bench_dir, monkeypatch, rewrite):
    # 3 MiB through 1 MiB buffers: three writes a pass; with rewrite the timed pass is the second over the file
    from infinity.storage import bench as bench_module

    writes = []

    class Counting(bench_module.AsyncIO):
        def pwrite(self, fd, buf, offset):
            writes.append(offset)
            return super().pwrite(fd, buf, offset)

    monkeypatch.setattr(bench_module, "_MAX_BUFFER_NBYTES", 1 << 20)
    monkeypatch.setattr(bench_module, "AsyncIO", Counting)
    result = bench_module.measure_nvme(bench_dir, nbytes=3 << 20, block_size=256 << 10, queue_depth=4,
                                       backend="threads", buffers=BenchBuffers(huge_pages=False), rewrite=rewrite)
    offsets = [0, 1 << 20, 2 << 20]
    assert writes == offsets * (2 if rewrite else 1)
    assert result.rewrite is rewrite and min(result.write_s, result.read_s) > 0
    assert list(bench_dir.iterdir()) == []

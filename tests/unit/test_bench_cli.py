"""``infinity bench``: the single-point JSON form, the grid's table and aio block, the plot, errors."""

import json
import tempfile
from pathlib import Path

import pytest

from infinity.cli import main
from infinity.commands import bench_machine
from infinity.runtime.machine_figures import measure_disk
from infinity.storage import libaio_unavailable_reason
from infinity.storage.swap_store import direct_io_problem


@pytest.fixture
def bench_dir(tmp_path):
    if direct_io_problem(tmp_path):
        pytest.skip(f"{tmp_path} does not take O_DIRECT: {direct_io_problem(tmp_path)}")
    return tmp_path


def test_single_point_json(bench_dir, capsys):
    rc = main(["bench", "--path", str(bench_dir), "--size", "8MiB", "--block-size", "1MiB", "--queue-depth", "4",
               "--json", "--no-progress"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    point = json.loads(out)
    assert point["write_GBps"] > 0 and point["read_GBps"] > 0
    assert (point["size"], point["block_size"], point["queue_depth"]) == (8 << 20, 1 << 20, 4)
    assert point["backend"] == ("libaio" if libaio_unavailable_reason() is None else "threads")
    assert list(bench_dir.iterdir()) == []  # the benchmark file is gone


def test_grid_prints_a_table_and_the_best_aio_block(bench_dir, capsys):
    rc = main(["bench", "--path", str(bench_dir), "--size", "2MiB", "--block-size", "256KiB,1MiB",
               "--queue-depth", "2,4", "--backend", "all", "--no-progress"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.splitlines()
    backends = 1 if libaio_unavailable_reason() else 2
    assert sum(1 for line in lines if line.split()[:1] in (["libaio"], ["threads"])) == 4 * backends
    assert "<- best" in out
    aio = json.loads(out[out.index('{\n  "aio"'):])["aio"]
    assert set(aio) == {"block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events"}
    assert aio["block_size"] in (256 << 10, 1 << 20) and aio["queue_depth"] in (2, 4)


def test_grid_json_and_plot(bench_dir, tmp_path_factory, capsys):
    png = tmp_path_factory.mktemp("plot") / "bw.png"
    rc = main(["bench", "--path", str(bench_dir), "--size", "1MiB", "--block-size", "64KiB,128KiB",
               "--queue-depth", "1,2", "--backend", "threads", "--json", "--plot", str(png), "--repeat", "2"])  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 0
    result = json.loads(captured.out)
    assert len(result["results"]) == 4 and result["aio"]["queue_depth"] == result["best"]["queue_depth"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "infinity bench" in captured.err  # the progress bar goes to stderr


def test_plot_is_checked_before_the_bench_and_written_under_the_name_given(bench_dir, tmp_path_factory, capsys):
    """--plot into a missing folder failed only after the whole grid was measured, and a name without a suffix was
    written as NAME.png while the message said NAME."""
    base = ["bench", "--path", str(bench_dir), "--size", "1MiB", "--block-size", "64KiB", "--queue-depth", "1",
            "--backend", "threads", "--no-progress", "--json"]
    folder = tmp_path_factory.mktemp("plot")
    for plot, message in ((folder / "missing" / "bw.png", "does not exist"), (folder / "bw.txt", "cannot write .txt")):
        assert main([*base, "--plot", str(plot)]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and "--plot" in captured.err and message in captured.err  # nothing measured
    assert main(["bench", "--machine", "--plot", str(folder / "m.png")]) == 2
    assert "--machine" in capsys.readouterr().err
    assert main([*base, "--plot", str(folder / "bw")]) == 0
    assert f"plot written to {folder / 'bw'}" in capsys.readouterr().err
    assert [p.name for p in folder.iterdir()] == ["bw"]
    assert (folder / "bw").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_path_is_a_temporary_directory_removed_after(capsys):
    before = set(Path(tempfile.gettempdir()).glob("infinity-bench-*"))
    if direct_io_problem(tempfile.gettempdir()):
        pytest.skip("the system temp dir does not take O_DIRECT")
    rc = main(["bench", "--size", "1MiB", "--block-size", "256KiB", "--queue-depth", "2", "--json",
               "--no-progress"])  # fmt: skip
    assert rc == 0 and json.loads(capsys.readouterr().out)["read_GBps"] > 0
    assert set(Path(tempfile.gettempdir()).glob("infinity-bench-*")) == before


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--size", "lots"], "cannot read size 'lots'"),
        (["--size", "1000"], "multiple of 4096"),
        (["--block-size", "1000"], "--block-size"),
        (["--queue-depth", "0"], "--queue-depth"),
        (["--path", "/proc/version"], "is not a folder"),
        (["--size", "1000TiB"], "not enough free space"),
    ],
)
def test_bad_input_is_one_clear_line(argv, message, capsys, bench_dir):
    if "--path" not in argv:
        argv = ["--path", str(bench_dir)] + argv
    rc = main(["bench", "--no-progress"] + argv)
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_missing_path_is_created_0700_as_train_does(capsys, bench_dir):
    where = bench_dir / "made" / "here"
    rc = main(["bench", "--path", str(where), "--size", "1MiB", "--block-size", "256KiB", "--queue-depth", "2",
               "--no-progress", "--json"])
    capsys.readouterr()
    assert where.is_dir() and (where.stat().st_mode & 0o777) == 0o700
    assert rc == 0 or direct_io_problem(str(where))


class _DiskMeasured(Exception):
    """Raised by the stand-in for the rest of ``--machine``'s figures, once the disk is measured."""


def test_machine_creates_a_missing_path_0700_and_measures_the_disk_there(bench_dir, monkeypatch):
    where = bench_dir / "made" / "here"
    measured = []

    def disk_alone(*, nvme_dir, **_):  # the machine's other figures take minutes on a small CPU
        mode = where.stat().st_mode & 0o777 if where.is_dir() else None
        measured.append((mode, *measure_disk(nvme_dir, nbytes=4 << 20)))
        raise _DiskMeasured

    monkeypatch.setattr(bench_machine, "measure_machine", disk_alone)
    with pytest.raises(_DiskMeasured):
        main(["bench", "--machine", "--path", str(where)])
    (mode, read, write, disk), = measured
    assert mode == 0o700 and disk == str(where) and read > 0 and write > 0
    assert not (bench_dir / "made").exists()  # stopped: the folders made for it are gone again


def test_tmpfs_path_is_refused(capsys):
    if direct_io_problem("/dev/shm") is None:
        pytest.skip("/dev/shm is not tmpfs here")
    rc = main(["bench", "--path", "/dev/shm", "--size", "1MiB", "--no-progress"])
    assert rc == 2 and "tmpfs" in capsys.readouterr().err


def test_a_refused_path_leaves_no_folder_it_made(capsys, tmp_path):
    if direct_io_problem("/dev/shm") is None:
        pytest.skip("/dev/shm is not tmpfs here")
    made = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="infinity-test-"))
    try:
        rc = main(["bench", "--path", str(made / "x" / "y"), "--size", "1MiB", "--no-progress"])
        assert rc == 2 and "tmpfs" in capsys.readouterr().err
        assert list(made.iterdir()) == []  # x/y made for the bench, removed with it; the folder that was there stays
    finally:
        made.rmdir()

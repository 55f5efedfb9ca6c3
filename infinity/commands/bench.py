"""``infinity bench``: bandwidth of the NVMe tier (and host⇄device copies) and the best ``aio`` settings.

Writes then reads a file of ``--size`` bytes with O_DIRECT at every point of
the grid ``--block-size`` × ``--queue-depth`` × ``--backend`` and prints a
table, the best point, and that point as an ``aio`` JSON block to paste into a
config. One block size, one queue depth and one backend make the single-point
form; ``--json`` then prints one JSON object with ``write_GBps`` and
``read_GBps``. GB/s are 1e9 bytes per second (as fio's ``bw_bytes``).

    infinity bench --path /mnt/nvme --size 1GiB --block-size 1MiB --queue-depth 32 --json
    infinity bench --path /mnt/nvme --block-size 256KiB,1MiB,4MiB --queue-depth 8,32,64 --backend all --plot bw.png

``--machine`` measures instead (seconds on a GPU machine, minutes on a small CPU) the figures the step-time
model needs (the device's throughput, host⇄device copies, the CPU Adam, the disk at ``--path``) and caches them
for ``infinity estimate`` and ``infinity train``:

    infinity bench --machine [--path /mnt/nvme] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path

from infinity.commands.bench_machine import run_machine
from infinity.commands.plot import picture_format
from infinity.commands.train_checks import check_output_folder, check_writable
from infinity.storage import libaio_unavailable_reason
from infinity.storage.aio import AsyncIO
from infinity.storage.bench import BenchBuffers, check_free_space, measure_copy, measure_nvme, median, parse_size
from infinity.storage.swap_store import direct_io_problem

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZES = "256KiB,1MiB,4MiB"
DEFAULT_QUEUE_DEPTHS = "8,32,64"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    parser.add_argument("--path", help="directory on the disk to measure (default: a fresh temporary directory, "
                        "removed after)")  # fmt: skip
    parser.add_argument("--size", default="1GiB", help="bytes written then read per point: 1GiB, 512MiB, 1G, or "
                        "plain bytes (default 1GiB)")  # fmt: skip
    parser.add_argument("--block-size", default=DEFAULT_BLOCK_SIZES,
                        help=f"bytes per I/O request, one or a comma list (default {DEFAULT_BLOCK_SIZES})")
    parser.add_argument("--queue-depth", default=DEFAULT_QUEUE_DEPTHS,
                        help=f"requests in flight, one or a comma list (default {DEFAULT_QUEUE_DEPTHS})")
    parser.add_argument("--backend", default="auto", choices=["auto", "libaio", "threads", "all"],
                        help="I/O backend; 'all' measures every one that works here (default auto)")
    parser.add_argument("--thread-count", type=int, default=1,
                        help="I/O threads (libaio contexts), the aio block's intra_op_parallelism (default 1)")
    parser.add_argument("--repeat", type=int, default=1, help="passes per point; the median is reported (default 1)")
    parser.add_argument("--machine", action="store_true",
                        help="measure the machine's figures for the step-time model (seconds on a GPU machine, "
                             "minutes on a small CPU) and cache them")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", metavar="FILE.png", help="draw bandwidth against block size and queue depth")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _size_list(text: str, flag: str) -> list[int]:
    try:
        values = [parse_size(part) for part in str(text).split(",") if part.strip()]
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None
    if not values or any(v <= 0 or v % 4096 for v in values):
        raise ValueError(f"{flag}: each value must be a positive multiple of 4096 bytes, got {text!r}")
    return sorted(set(values))


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected an integer or a comma list of integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{flag}: each value must be >= 1, got {text!r}")
    return sorted(set(values))


def _backends(choice: str) -> list[str]:
    reason = libaio_unavailable_reason()
    if choice == "all":
        if reason is not None:
            print(f"infinity bench: measuring the threads backend only: {reason}", file=sys.stderr)
            return ["threads"]
        return ["libaio", "threads"]
    if choice == "auto":
        return ["libaio" if reason is None else "threads"]
    if choice == "libaio" and reason is not None:
        raise OSError(f"the libaio backend is not available: {reason}")
    return [choice]


def _label(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return f"{nbytes}B"


def _aio_block(point: dict, thread_count: int) -> dict:
    return {
        "aio": {
            "block_size": point["block_size"],
            "queue_depth": point["queue_depth"],
            "intra_op_parallelism": thread_count,
            "single_submit": False,
            "overlap_events": True,
        }
    }


@contextlib.contextmanager
def _bench_dir(path: str | None):
    if path is None:
        tmp = tempfile.mkdtemp(prefix="infinity-bench-")
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return

    made = _missing_folders(Path(path))
    try:
        check_writable(path, what="--path")  # a missing folder is created (0700), as `train --nvme-path` does
        yield path
    except BaseException:  # refused (tmpfs, no room, ...) or stopped: the folders made for it go, once empty
        for folder in made:
            try:
                folder.rmdir()
            except OSError:
                break
        raise


def _missing_folders(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _plot_format(path: str) -> str:
    """The format ``--plot`` writes: its name's suffix, or PNG where it has none (the name kept as given: matplotlib
    would add ``.png`` to it); checked before the bench, as is the folder it goes into."""
    check_output_folder("--plot", path)
    return picture_format(path, "--plot")


def run(args: argparse.Namespace) -> int:
    if args.machine:
        if args.plot:
            raise ValueError("--plot draws the --block-size x --queue-depth grid, which --machine does not measure")
        if args.path is None:
            return run_machine(args)  # the disk measured in a temporary folder
        with _bench_dir(args.path):  # a missing --path created, as for the grid
            return run_machine(args)
    nbytes = parse_size(args.size)
    if nbytes <= 0 or nbytes % 4096:
        raise ValueError(f"--size must be a positive multiple of 4096 bytes, got {args.size!r}")
    block_sizes = _size_list(args.block_size, "--block-size")
    queue_depths = _int_list(args.queue_depth, "--queue-depth")
    if args.repeat < 1 or args.thread_count < 1:
        raise ValueError("--repeat and --thread-count must be >= 1")
    backends = _backends(args.backend)
    plot_format = _plot_format(args.plot) if args.plot else None
    for qd in queue_depths:  # fail on bad settings before writing anything
        AsyncIO("threads", block_size=block_sizes[0], queue_depth=qd, thread_count=args.thread_count).close()
    grid = [(b, bs, qd) for b in backends for bs in block_sizes for qd in queue_depths]

    from tqdm import tqdm

    results = []
    with _bench_dir(args.path) as directory:
        problem = direct_io_problem(directory)
        if problem is not None:
            raise OSError(22, f"cannot measure direct I/O here: {problem}", directory)
        check_free_space(directory, nbytes)
        buffers = BenchBuffers()
        with tqdm(total=len(grid) * args.repeat, desc="infinity bench", unit="pass", file=sys.stderr,
                  disable=args.no_progress, leave=False) as bar:  # fmt: skip
            for backend, bs, qd in grid:
                bar.set_postfix_str(f"{backend} block {_label(bs)} qd {qd}")
                writes, reads = [], []
                for _ in range(args.repeat):
                    r = measure_nvme(directory, nbytes=nbytes, block_size=bs, queue_depth=qd, backend=backend,
                                     thread_count=args.thread_count, buffers=buffers)  # fmt: skip
                    writes.append(r.write_GBps)
                    reads.append(r.read_GBps)
                    bar.update(1)
                results.append({
                    "backend": backend, "block_size": bs, "queue_depth": qd,
                    "write_GBps": round(median(writes), 3), "read_GBps": round(median(reads), 3),
                })  # fmt: skip
        copy = measure_copy(min(nbytes, 256 << 20))
    path_shown = args.path if args.path is not None else "(temporary directory)"

    if len(results) == 1:
        point = {"path": path_shown, "size": nbytes, "repeat": args.repeat, "thread_count": args.thread_count,
                 **results[0], **(copy or {})}  # fmt: skip
        if args.json:
            print(json.dumps(point))
        else:
            print(f"{point['backend']}, block {_label(point['block_size'])}, queue depth {point['queue_depth']}, "
                  f"{_label(nbytes)} at {path_shown}: write {point['write_GBps']:.2f} GB/s, "
                  f"read {point['read_GBps']:.2f} GB/s")  # fmt: skip
            if copy:
                print(f"host->device {copy['h2d_GBps']:.2f} GB/s, device->host {copy['d2h_GBps']:.2f} GB/s")
        if args.plot:
            _plot(results, args.plot, plot_format)
        return 0

    best = max(results, key=lambda r: (r["write_GBps"] + r["read_GBps"], -r["block_size"], -r["queue_depth"]))
    aio = _aio_block(best, args.thread_count)
    if args.json:
        print(json.dumps({"path": path_shown, "size": nbytes, "repeat": args.repeat, "results": results,
                          "best": best, **aio, **({"copy": copy} if copy else {})}))  # fmt: skip
    else:
        print(f"{_label(nbytes)} written then read with O_DIRECT at {path_shown}, median of {args.repeat}")
        print(f"{'backend':<8} {'block':>7} {'qd':>4} {'write GB/s':>11} {'read GB/s':>10}")
        for r in results:
            mark = "  <- best" if r is best else ""
            print(f"{r['backend']:<8} {_label(r['block_size']):>7} {r['queue_depth']:>4} "
                  f"{r['write_GBps']:>11.2f} {r['read_GBps']:>10.2f}{mark}")  # fmt: skip
        if copy:
            print(f"host->device {copy['h2d_GBps']:.2f} GB/s, device->host {copy['d2h_GBps']:.2f} GB/s")
        print(f"best: {best['backend']} backend, block {_label(best['block_size'])}, queue depth "
              f"{best['queue_depth']} (highest write + read); paste into the config:")  # fmt: skip
        print(json.dumps(aio, indent=2))
    if args.plot:
        _plot(results, args.plot, plot_format)
    return 0


def _plot(results: list[dict], path: str, plot_format: str) -> None:
    """Two panels: GB/s against block size (a line per queue depth) and against queue depth
    (a line per block size); solid for write, dashed for read; one colour per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bs, ax_qd) = plt.subplots(1, 2, figsize=(12, 4.5))
    backends = sorted({r["backend"] for r in results})
    for ax, x_key, series_key, x_label, series_label in (
        (ax_bs, "block_size", "queue_depth", "block size", "qd"),
        (ax_qd, "queue_depth", "block_size", "queue depth", "block"),
    ):
        for backend in backends:
            for s in sorted({r[series_key] for r in results}):
                pts = sorted((r for r in results if r["backend"] == backend and r[series_key] == s),
                             key=lambda r: r[x_key])  # fmt: skip
                xs = [r[x_key] for r in pts]
                name = f"{backend} {series_label} {_label(s) if series_key == 'block_size' else s}"
                (line,) = ax.plot(xs, [r["write_GBps"] for r in pts], marker="o", label=f"{name} write")
                ax.plot(xs, [r["read_GBps"] for r in pts], marker="s", linestyle="--", color=line.get_color(),
                        label=f"{name} read")  # fmt: skip
        ax.set_xscale("log", base=2)
        ticks = sorted({r[x_key] for r in results})
        ax.set_xticks(ticks, [_label(t) if x_key == "block_size" else str(t) for t in ticks])
        ax.set_xlabel(x_label)
        ax.set_ylabel("GB/s")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("NVMe tier bandwidth (O_DIRECT): write solid, read dashed")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format=plot_format)  # (a format given: the name is kept as it is)
    plt.close(fig)
    print(f"infinity bench: plot written to {path}", file=sys.stderr)

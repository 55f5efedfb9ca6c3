"""The storage engine against fio: same file size, block size, queue depth, O_DIRECT, one run.

Each round runs fio's sequential write then read of a fresh file, and the
engine's (libaio backend, then threads backend) on the same file size, block
size and queue depth; the order alternates between rounds so that drift on a
shared machine falls on both sides. A control, ``libaio-4k``, repeats the
libaio pass with buffers on ordinary 4 KiB pages allocated afresh each round,
like fio's (the engine's own buffers use transparent huge pages). Prints every round, the medians, the
ratios engine / fio, and ends with one JSON line.

    .venv/bin/python benchmarks/bench_storage.py --size 1GiB --block-size 1MiB --queue-depth 32 --rounds 5

Data goes to a fresh directory under the system temp dir (``--path`` to pick
the filesystem), removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from infinity.storage import libaio_unavailable_reason
from infinity.storage.bench import BenchBuffers, check_free_space, measure_nvme, parse_size


def run_fio(rw: str, path: str, nbytes: int, block_size: int, queue_depth: int) -> float:
    """fio's bandwidth in GB/s (1e9 bytes/s) for one sequential ``rw`` job over ``path``."""
    cmd = [
        "fio", f"--name={rw}", f"--filename={path}", f"--rw={rw}", f"--bs={block_size}",
        f"--iodepth={queue_depth}", "--ioengine=libaio", "--direct=1", f"--size={nbytes}",
        "--output-format=json",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr.strip()}")
    job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]
    if job.get("error"):
        raise RuntimeError(f"fio job error {job['error']}: {' '.join(cmd)}")
    return job["read" if rw == "read" else "write"]["bw_bytes"] / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", help="directory on the filesystem to measure (default: a fresh one in the temp dir)")
    p.add_argument("--size", default="1GiB", help="file size (default 1GiB)")
    p.add_argument("--block-size", default="1MiB", help="block size (default 1MiB)")
    p.add_argument("--queue-depth", type=int, default=32, help="queue depth (default 32)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds; medians are reported (default 5)")
    args = p.parse_args(argv)
    nbytes, block_size, qd = parse_size(args.size), parse_size(args.block_size), args.queue_depth
    if shutil.which("fio") is None:
        print("bench_storage: fio is not installed (apt-get install fio)", file=sys.stderr)
        return 2
    backends = ["libaio", "threads"]
    reason = libaio_unavailable_reason()
    if reason is not None:
        print(f"bench_storage: {reason}; measuring the threads backend only", file=sys.stderr)
        backends = ["threads"]

    workdir = tempfile.mkdtemp(prefix="bench-storage-", dir=args.path)
    fio_file = os.path.join(workdir, "fio.dat")
    buffers = BenchBuffers()
    # "libaio-4k": the libaio backend with buffers on ordinary 4 KiB pages, allocated afresh each
    # round as fio's are: a control for how much the engine's huge-page buffers are worth here.
    controls = ["libaio-4k"] if "libaio" in backends else []
    figures: dict[str, dict[str, list[float]]] = {
        name: {"write": [], "read": []} for name in ["fio"] + backends + controls
    }
    try:
        check_free_space(workdir, 2 * nbytes)
        print(f"{nbytes} bytes, block {block_size} bytes, queue depth {qd}, O_DIRECT, in {workdir}")

        def fio_pass() -> None:
            figures["fio"]["write"].append(run_fio("write", fio_file, nbytes, block_size, qd))
            figures["fio"]["read"].append(run_fio("read", fio_file, nbytes, block_size, qd))
            os.unlink(fio_file)

        def ours_pass() -> None:
            for backend in backends:
                r = measure_nvme(workdir, nbytes=nbytes, block_size=block_size, queue_depth=qd,
                                 backend=backend, buffers=buffers)  # fmt: skip
                figures[backend]["write"].append(r.write_GBps)
                figures[backend]["read"].append(r.read_GBps)
            for name in controls:
                r = measure_nvme(workdir, nbytes=nbytes, block_size=block_size, queue_depth=qd,
                                 backend="libaio", buffers=BenchBuffers(huge_pages=False))  # fmt: skip
                figures[name]["write"].append(r.write_GBps)
                figures[name]["read"].append(r.read_GBps)

        for i in range(args.rounds):
            for step in (fio_pass, ours_pass) if i % 2 == 0 else (ours_pass, fio_pass):
                step()
            line = "  ".join(f"{n} w {f['write'][-1]:.2f} r {f['read'][-1]:.2f}" for n, f in figures.items())
            print(f"round {i + 1}: {line}  GB/s", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    med = {n: {rw: statistics.median(v) for rw, v in f.items()} for n, f in figures.items()}
    print("\nmedian GB/s      write    read   write/fio  read/fio")
    summary: dict[str, object] = {
        "size": nbytes, "block_size": block_size, "queue_depth": qd, "rounds": args.rounds,
        "fio_write_GBps": round(med["fio"]["write"], 3), "fio_read_GBps": round(med["fio"]["read"], 3),
    }  # fmt: skip
    for name, m in med.items():
        wr, rr = m["write"] / med["fio"]["write"], m["read"] / med["fio"]["read"]
        print(f"{name:<14} {m['write']:7.2f} {m['read']:7.2f} {wr:10.3f} {rr:9.3f}")
        if name != "fio":
            summary.update({
                f"{name.replace('-', '_')}_write_GBps": round(m["write"], 3), f"{name.replace('-', '_')}_read_GBps": round(m["read"], 3),
                f"{name.replace('-', '_')}_write_ratio": round(wr, 3), f"{name.replace('-', '_')}_read_ratio": round(rr, 3),
            })  # fmt: skip
    from infinity.runtime.hardware import machine_description

    summary["machine"] = machine_description()
    print(f"machine: {summary['machine']}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

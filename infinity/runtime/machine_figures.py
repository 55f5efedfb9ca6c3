"""The machine's own figures, measured in a few seconds and cached: what the step-time model
(:mod:`infinity.placement.step_time`) is fed.

* the device's matmul throughput in each compute precision (a CUDA GPU; without one the device is the
  CPU, and the figure is the CPU's);
* host⇄device copy bandwidth each way: pinned host memory to a CUDA device, or, on a machine without one,
  the copy the distinct-device test mode makes (a ``copy_`` between two host buffers on a worker thread,
  :mod:`infinity.placement.copies`);
* the fused CPU Adam's throughput (:mod:`infinity.kernels`) for each optimizer-state dtype, with gradients
  and the new parameter copy in bf16, as an offloaded step calls it: with the engine's default team, bound to
  its cores where the engine binds it (:mod:`infinity.runtime.host_cores`);
* NVMe read and write bandwidth with O_DIRECT (:mod:`infinity.storage.bench`), where a path that takes
  O_DIRECT is at hand; the write overwrites blocks written before, as a step's write-back overwrites the
  extents its keys already have (a first write into preallocated blocks can be far slower, and a steady run
  makes none).

``infinity bench --machine`` measures and writes them to ``$XDG_CACHE_HOME/zero-infinity/machine-<host>.json``
(beside the built kernels; ``~/.cache/zero-infinity`` without ``XDG_CACHE_HOME``); ``infinity estimate``, ``infinity train`` and the
benchmarks read that file, and measure (then cache) when it is missing or was written by another version of
this format.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from infinity import kernels
from infinity.runtime.cpu_matmul import cpu_matmul_mode
from infinity.runtime.hardware import fast_precision, last_level_cache_bytes, machine_description
from infinity.runtime.host_cores import HostCores, plan_host_cores
from infinity.storage.bench import measure_nvme
from infinity.storage.swap_store import direct_io_problem

__all__ = ["FORMAT", "MachineFigures", "adam_measure_numel", "cache_path", "load_cached", "machine_figures",
           "measure_block_now", "measure_cpu_adam", "measure_machine", "save"]

logger = logging.getLogger(__name__)

FORMAT = 6
"""The cache file's format; a file of another format is measured again (2: the disk's write is an overwrite; 3: a
half-precision matmul on a CPU without units for it is timed as the engine computes it, through fp32; 4: the CPU
Adam is timed beyond the cache, with the gradient norm the step takes before each update; 5: the engine's host-side
work per released tensor; 6: that norm summed by the Adam kernel in its own pass, as the step now takes it)."""

STATE_DTYPES = ("fp32", "bf16", "int8")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MachineFigures:
    """What one machine measured; bandwidths in GB/s (1e9 bytes a second), throughputs per second."""

    host: str
    """The host name the figures were measured on (the cache file's name holds it too)."""
    machine: str
    """The CPU and GPU by name (:func:`~infinity.runtime.hardware.machine_description`)."""
    device: str
    """``cuda`` or ``cpu``: where forward and backward compute (without a GPU the device is the CPU, whose cores
    then also run the optimizer and the copies)."""
    matmul_tflops: dict
    """The device's dense matmul throughput, TFLOP/s, by compute precision (``bf16``, ``fp32``)."""
    block_tflops: dict
    """A transformer block's forward and backward (pre-LN, attention by ``scaled_dot_product_attention``, a 4x
    GELU MLP) on ``block_tokens`` tokens, TFLOP/s of its matmuls beyond ``block_overhead_s``: by precision, then by
    width (``{"bf16": {"64": ..., "1024": ...}}``), in the precision the device is fast in (another one scales by
    ``matmul_tflops``), and on a CPU in bf16 and fp32 both, the fast one first. What a model's forward and backward
    reach, not a matmul's peak."""
    block_overhead_s: dict
    """Seconds a block's forward and backward take whatever its size (launches, dispatch, autograd): the same
    block at width 64 on 16 tokens, by precision."""
    block_tokens: int
    """Tokens of the block measurements (batch x sequence)."""
    h2d_GBps: float | None
    """Host to device copy bandwidth: pinned memory to a CUDA device, or the distinct-device mode's host copy."""
    d2h_GBps: float | None
    """Device to host copy bandwidth, the same way."""
    copy_path: str
    """What the copy figures measured: ``cuda pinned`` or ``host copy (distinct-device mode)``."""
    device_memory_GBps: float
    """A copy within device memory (GPU memory; host memory without a GPU), counting bytes read plus written:
    what bounds an optimizer stepping states in device memory."""
    cpu_adam_elements_per_s: dict
    """A sub-group's host update, elements a second, by optimizer-state dtype (fp32, bf16, int8), bf16 gradients:
    its gradient norm and the fused CPU Adam, over more elements than the cache holds (:func:`measure_cpu_adam`)."""
    cpu_threads: int
    """The CPU threads the Adam figures were taken with: the team the engine takes here by default
    (:func:`~infinity.runtime.host_cores.plan_host_cores`), bound to its cores where it binds them."""
    nvme_read_GBps: float | None
    """NVMe read bandwidth with O_DIRECT (None where no path took O_DIRECT)."""
    nvme_write_GBps: float | None
    """NVMe write bandwidth with O_DIRECT, overwriting written blocks as a steady step's write-back does (None
    where no path took O_DIRECT)."""
    nvme_path: str | None
    """The directory the disk figures were measured in, or why none was (``not measured: ...``)."""
    measured_s: float
    """Seconds the measurement took."""
    measured_at: float
    """When it was measured (seconds since the epoch)."""
    host_feed_s_per_tensor: float | None = None
    """Seconds of the thread that feeds the device per parameter tensor the engine fetches and releases, each
    micro-batch (hooks, fetch and release, copy issues, the gradient's hook), beyond plain PyTorch's on the same model
    (:mod:`infinity.commands.host_feed`); None where not measured (``infinity bench --machine`` measures it, a
    measurement made for a missing cache does not): the step-time model then counts none."""
    format: int = FORMAT
    """The cache file's format."""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "MachineFigures":
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing = required - set(data)
        if missing:
            raise ValueError(f"machine figures lack {', '.join(sorted(missing))}")
        return cls(**{k: v for k, v in data.items() if k in names})


# --------------------------------------------------------------------------- the cache

def cache_path(host: str | None = None) -> Path:
    """``$XDG_CACHE_HOME/zero-infinity/machine-<host>.json`` (beside the built kernels), under ``~/.cache`` without
    ``XDG_CACHE_HOME``."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    name = (host or socket.gethostname() or "unknown").replace(os.sep, "_")
    return Path(root) / "zero-infinity" / f"machine-{name}.json"


def load_cached(path: Path | None = None) -> MachineFigures | None:
    """The cached figures of this host, or None when there are none (or they are of another format, or
    unreadable: a cache is measured again, never trusted half-read)."""
    path = path or cache_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != FORMAT:
            return None
        return MachineFigures.from_dict(data)
    except (OSError, ValueError, TypeError, AttributeError) as err:
        if not isinstance(err, FileNotFoundError):
            logger.info("machine figures at %s not used: %s", path, err)
        return None


def save(figures: MachineFigures, path: Path | None = None) -> Path:
    """Write the figures atomically (a temporary file renamed over the cache), the folder made 0700."""
    path = path or cache_path(figures.host)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".machine-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(figures.as_dict(), f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def machine_figures(*, measure_if_missing: bool = True, nvme_dir: str | None = None) -> MachineFigures | None:
    """This host's cached figures; measured (and cached) when there are none and ``measure_if_missing``."""
    cached = load_cached()
    if cached is not None or not measure_if_missing:
        return cached
    figures = measure_machine(nvme_dir=nvme_dir)
    try:
        save(figures)
    except OSError as err:  # a read-only home: the figures still serve this run
        logger.warning("could not cache the machine's figures at %s: %s", cache_path(), err)
    return figures


# --------------------------------------------------------------------------- measuring

def _best_rate(fn, work: float, *, budget_s: float, min_reps: int = 3) -> float:
    """``work`` units over the best time of ``fn`` (one warm-up call first), within about ``budget_s``: the best, so
    that what the machine can do is measured, not what other work on it left over."""
    fn()
    times, start = [], time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 50:
            break
    return work / min(times)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the work queued on the GPU is what is timed


def measure_matmul_tflops(device: torch.device, precision: str, *, budget_s: float = 0.4) -> float:
    """Dense ``n x n @ n x n`` throughput in TFLOP/s (n = 8192 on a GPU, 1024 on a CPU), as the engine computes it
    by default: a half precision on a CPU without units for it through fp32 (:mod:`infinity.runtime.cpu_matmul`)."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device).to(_DTYPES[precision])
    b = torch.randn(n, n, device=device).to(_DTYPES[precision])
    mode = cpu_matmul_mode("auto", precision, device)

    def run():
        with mode():
            a @ b
        _synchronize(device)

    return _best_rate(run, 2 * n**3, budget_s=budget_s) / 1e12


def _block(width: int, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A pre-LN transformer block of ``width`` (heads of 64), in plain torch.nn."""
    nn, F = torch.nn, torch.nn.functional
    heads = max(1, width // 64)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, 2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    return Block().to(device=device, dtype=dtype)


def block_flops(width: int, tokens: int, seq: int) -> float:
    """Forward and backward FLOPs of one block: 6 per matmul weight per token, and the attention's two
    products (12 · sequence · width per token)."""
    return float(tokens * (6 * 12 * width * width + 12 * seq * width))


def _block_run(width: int, batch: int, seq: int, precision: str, device: torch.device):
    """One forward and backward of a fresh block of ``width`` on ``batch x seq`` tokens, as a callable."""
    block = _block(width, _DTYPES[precision], device)
    x = torch.randn(batch, seq, width, device=device, dtype=_DTYPES[precision], requires_grad=True)
    mode = cpu_matmul_mode("auto", precision, device)  # its matmuls as the engine computes them by default

    def run():
        with mode():
            block(x).sum().backward()
        _synchronize(device)

    return run


def measure_block_now(width: int, batch: int, seq: int, precision: str, *, overhead_s: float, tries: int = 3,
                      device: torch.device | None = None) -> float:
    """A block's TFLOP/s beyond ``overhead_s`` as the machine runs it now: the median of ``tries`` forwards and
    backwards (after a warm-up), not the best. For a benchmark that sets its step beside the machine's figures
    on a machine other work shares: the figures then describe the machine the step ran on."""
    device = device or torch.device("cpu")
    run = _block_run(width, batch, seq, precision, device)
    run()  # warm-up: first calls pick kernels and allocate
    times = []
    for _ in range(tries):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    return block_flops(width, batch * seq, seq) / max(seconds - overhead_s, seconds / 2) / 1e12


def measure_blocks(device: torch.device, precision: str, *, rounds: int = 6) -> tuple[dict, float, int]:
    """({width: TFLOP/s beyond the overhead}, the overhead in seconds, tokens) of a block's forward and backward.

    The widths are timed in turns, ``rounds`` times, and each keeps its median: what a step of many blocks runs
    at, where the best of a few is the machine's best moment (on a 2-vCPU virtual machine, idle, a 1024-wide block's
    best was 1.37 x its median, and a 24-block GPT ran at the median: 0.093 against 0.128 TFLOP/s). Taken in
    turns, a burst of other work spoils one turn of each width, which the median leaves out. The overhead, a
    millisecond, keeps its best: the fixed cost of a call."""
    batch, seq = (8, 1024) if device.type == "cuda" else (4, 256)
    widths = (64, 256, 1024, 4096) if device.type == "cuda" else (64, 256, 1024)
    runs = {("overhead", 64): _block_run(64, 1, 16, precision, device)}
    runs.update({("block", w): _block_run(w, batch, seq, precision, device) for w in widths})
    times: dict[tuple, list[float]] = {key: [] for key in runs}
    for run in runs.values():
        run()  # warm-up: first calls pick kernels and allocate
    for _ in range(rounds):
        for key, run in runs.items():
            for _ in range(5 if key[0] == "overhead" else 1):  # the overhead is a millisecond: more tries
                t0 = time.perf_counter()
                run()
                times[key].append(time.perf_counter() - t0)
    overhead = min(times[("overhead", 64)])
    rates = {}
    for width in widths:
        seconds = statistics.median(times[("block", width)])
        rates[str(width)] = round(block_flops(width, batch * seq, seq) / max(seconds - overhead, seconds / 2) / 1e12, 4)
    return rates, overhead, batch * seq


def measure_copies(device: torch.device, *, nbytes: int = 64 << 20, budget_s: float = 0.3) -> tuple[float, float, str]:
    """(host to device, device to host) GB/s, and what was measured."""
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        stream = torch.cuda.Stream(device)

        def copy(dst, src):
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            stream.synchronize()  # the copy's own time, as the engine's copy stream runs it

        h2d = _best_rate(lambda: copy(dev, host), nbytes, budget_s=budget_s)
        d2h = _best_rate(lambda: copy(host, dev), nbytes, budget_s=budget_s)
        return h2d / 1e9, d2h / 1e9, "cuda pinned"
    # The distinct-device mode's copy stream: one worker thread running copy_ between host buffers.
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)

    def copy_on_worker():
        worker = threading.Thread(target=dst.copy_, args=(src,))
        worker.start()
        worker.join()

    rate = _best_rate(copy_on_worker, nbytes, budget_s=budget_s) / 1e9
    return rate, rate, "host copy (distinct-device mode)"


def measure_device_memory(device: torch.device, *, nbytes: int = 256 << 20, budget_s: float = 0.3) -> float:
    """GB/s of a copy within device memory, bytes read plus bytes written."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)

    def run():
        dst.copy_(src)
        _synchronize(device)

    return _best_rate(run, 2 * nbytes, budget_s=budget_s) / 1e9


def adam_measure_numel() -> int:
    """Elements the CPU Adam figure is taken over: four times the last-level cache in the states' smallest form (8 B
    an element with gradients and the parameter copy), at least 64 Mi, so that the kernel streams from memory as a
    model's sub-groups make it (a 16 Mi-element measurement sat in the L3 of an H100 box's Xeon and said 3.1x what
    its steps' updates got); at most what a sixteenth of the available memory holds at 16 B an element."""
    import psutil

    numel = max(1 << 26, 4 * last_level_cache_bytes() // 8)
    return max(1 << 20, min(numel, psutil.virtual_memory().available // (16 * 16)))


def measure_cpu_adam(state_dtype: str, *, numel: int | None = None, budget_s: float = 0.4,
                     host_cores: HostCores | None = None) -> float:
    """Elements a second of one sub-group's host update as the offloaded step makes it: the fused CPU Adam over
    ``state_dtype`` states, bf16 gradients and parameter copy, summing the gradients' squares in the same pass (as
    :meth:`~infinity.optim.overlapped_step.OverlappedStep` takes each sub-group's norm); over ``numel`` elements
    (default :func:`adam_measure_numel`: beyond the cache). With ``host_cores``, on a thread bound as the engine
    binds its updating threads, with that team."""
    numel = adam_measure_numel() if numel is None else numel
    threads = None if host_cores is None else host_cores.threads
    # values without randn's cost at this size: the kernel's speed does not depend on them
    grad = torch.linspace(-1e-3, 1e-3, numel).to(torch.bfloat16)
    param_out = torch.empty(numel, dtype=torch.bfloat16)
    hyper = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    state = kernels.empty_state(state_dtype, numel)
    for name, t in state.items():
        t.zero_() if name != "master" else t.copy_(torch.linspace(-1.0, 1.0, numel))
    counter = [0]

    def run():
        counter[0] += 1
        if state_dtype == "fp32":
            kernels.adam_step(state["master"], grad, state["exp_avg"], state["exp_avg_sq"], step=counter[0],
                              param_out=param_out, num_threads=threads, grad_sq_norm=True, **hyper)
        else:
            kernels.adam_step_compact(state["master"], grad, state["exp_avg"], state["exp_avg_sq"],
                                      state_dtype=state_dtype, step=counter[0], seed=0, param_out=param_out,
                                      exp_avg_scale=state.get("exp_avg_scale"),
                                      exp_avg_sq_scale=state.get("exp_avg_sq_scale"), num_threads=threads,
                                      grad_sq_norm=True, **hyper)

    def rate() -> float:
        return _best_rate(run, numel, budget_s=budget_s)

    return _on_bound_thread(host_cores, rate) if host_cores is not None and host_cores.cores is not None else rate()


def _on_bound_thread(host_cores: HostCores, measure):
    """``measure()`` on a new thread bound to ``host_cores``' cores (the caller's own binding stays as it is)."""
    result: list = []
    errors: list[BaseException] = []

    def run():
        try:
            host_cores.bind_this_thread()
            result.append(measure())
        except BaseException as err:  # raised on the caller's thread below
            errors.append(err)

    worker = threading.Thread(target=run, name="infinity-measure-adam")
    worker.start()
    worker.join()
    if errors:
        raise errors[0]
    return result[0]


def measure_disk(directory: str | None, *, nbytes: int = 256 << 20) -> tuple[float | None, float | None, str]:
    """(read, write) GB/s with O_DIRECT in ``directory`` (default: a temporary folder), or (None, None, why not);
    the write overwrites the file's written blocks, as a step's write-back does."""
    made = None
    try:
        if directory is None:
            made = directory = tempfile.mkdtemp(prefix="infinity-machine-")
        problem = direct_io_problem(directory)
        if problem is not None:
            return None, None, f"not measured: {problem}"
        results = [measure_nvme(directory, nbytes=nbytes, block_size=1 << 20, queue_depth=32, rewrite=True)
                   for _ in range(2)]
        return (statistics.median(r.read_GBps for r in results), statistics.median(r.write_GBps for r in results),
                directory)
    except OSError as err:
        return None, None, f"not measured: {err}"
    finally:
        if made is not None:
            os.rmdir(made)


def measure_machine(*, nvme_dir: str | None = None, state_dtypes=STATE_DTYPES,
                    measure_host_feed: Callable[[torch.device], float] | None = None) -> MachineFigures:
    """Measure every figure here (a few seconds). ``measure_host_feed(device)``: the engine's host-side seconds per
    released tensor (:func:`infinity.commands.host_feed.measure_host_feed`, which needs the whole engine: the
    command passes it; without it that figure is None)."""
    start = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    matmul = {p: round(measure_matmul_tflops(device, p), 4) for p in ("bf16", "fp32")}
    # The block in the precision the device is fast in; a GPU's time in the other one scales by the matmuls'. A
    # CPU's does not (its bf16 norms, activations and attention are not matmuls, and run 2x slower without bf16
    # units), so a CPU's block is timed in both.
    fast = fast_precision("cuda" if device.type == "cuda" else "cpu").precision
    precisions = (fast,) if device.type == "cuda" else (fast, *(p for p in ("fp32", "bf16") if p != fast))
    blocks = {p: measure_blocks(device, p) for p in precisions}
    h2d, d2h, copy_path = measure_copies(device)
    device_memory = measure_device_memory(device)
    host_cores = plan_host_cores(device, None)  # the team the engine takes on this machine by default
    adam = {d: round(measure_cpu_adam(d, host_cores=host_cores)) for d in state_dtypes}
    read, write, disk = measure_disk(nvme_dir)
    host_feed = None if measure_host_feed is None else measure_host_feed(device)
    figures = MachineFigures(
        host=socket.gethostname() or "unknown", machine=machine_description(), device=device.type,
        matmul_tflops=matmul, block_tflops={p: b[0] for p, b in blocks.items()},
        block_overhead_s={p: round(b[1], 6) for p, b in blocks.items()}, block_tokens=next(iter(blocks.values()))[2],
        h2d_GBps=round(h2d, 3), d2h_GBps=round(d2h, 3), copy_path=copy_path,
        device_memory_GBps=round(device_memory, 3),
        cpu_adam_elements_per_s=adam, cpu_threads=host_cores.threads or torch.get_num_threads(),
        nvme_read_GBps=None if read is None else round(read, 3), nvme_write_GBps=None if write is None else round(write, 3),
        nvme_path=disk, host_feed_s_per_tensor=None if host_feed is None else round(host_feed, 7),
        measured_s=round(time.perf_counter() - start, 2), measured_at=round(time.time(), 1),
    )  # fmt: skip
    logger.info("machine figures measured in %.1f s: %s", figures.measured_s, figures)
    return figures

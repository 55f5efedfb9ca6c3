"""One timed run of one engine tree (or of plain PyTorch), in a process of its own; run by bench_versions.py.

The tree to import is the environment's ``BENCH_VERSIONS_TREE`` (a source tree root holding ``infinity/``,
``kernels/`` and ``storage/``). An editable install of another tree maps ``infinity.kernels`` and
``infinity.storage`` through setuptools' finder, which sits at the end of ``sys.meta_path``: with only
``PYTHONPATH`` set, ``infinity`` would come from the tree and ``infinity.kernels`` from the installed checkout.
So this module first puts a finder of its own at the front of ``sys.meta_path`` that maps the three names to the
tree (as ``pyproject.toml``'s ``package-dir`` does), then imports, then checks where each came from and refuses to
run when any came from elsewhere.

It uses only what every tree since the first engine has: ``infinity.initialize(model, config_dict)``,
``infinity.Init()``, ``infinity.models.gpt.GPT`` / ``GPTConfig``, ``engine(idx, targets) -> loss``,
``engine.backward(loss)``, ``engine.step()`` and (where present) ``engine.close()`` and ``engine.step_metrics()``;
the C++ kernel through ``infinity.kernels.backend()``, which builds it under ``$XDG_CACHE_HOME`` (the parent sets
one per tree).

    BENCH_VERSIONS_TREE=.versions/f6ac807 python benchmarks/versions_driver.py --prepare
    BENCH_VERSIONS_TREE=. python benchmarks/versions_driver.py --run '{"mode": "engine", ...}'

The last line printed is ``RESULT {json}``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

TREE_ENV = "BENCH_VERSIONS_TREE"
RESULT_PREFIX = "RESULT "
PACKAGE_DIRS = {"infinity": "infinity", "infinity.kernels": "kernels", "infinity.storage": "storage"}
"""The import names a tree maps to its folders (pyproject.toml's package-dir)."""


class TreeFinder(importlib.abc.MetaPathFinder):
    """Maps ``infinity``, ``infinity.kernels`` and ``infinity.storage`` to one tree's folders; deeper modules follow
    their package's ``__path__``."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        folder = PACKAGE_DIRS.get(fullname)
        if folder is None:
            return None
        init = self.root / folder / "__init__.py"
        return importlib.util.spec_from_file_location(fullname, init,
                                                      submodule_search_locations=[str(self.root / folder)])


def tree_root_from_env() -> Path:
    value = os.environ.get(TREE_ENV)
    if not value:
        raise SystemExit(f"versions_driver: set {TREE_ENV} to the source tree to import")
    root = Path(value).resolve()
    missing = [folder for folder in PACKAGE_DIRS.values() if not (root / folder / "__init__.py").is_file()]
    if missing:
        raise SystemExit(f"versions_driver: {root} is not a source tree of the engine (no {', '.join(missing)})")
    return root


def install_tree_finder(root: Path) -> None:
    """Before any import of the engine: the tree's finder goes ahead of every other (the editable install's)."""
    sys.meta_path.insert(0, TreeFinder(root))


def imported_from(root: Path, modules: dict) -> dict[str, str]:
    """Where each engine package was imported from; SystemExit if any is outside ``root``."""
    where = {name: str(Path(module.__file__).resolve()) for name, module in modules.items()}
    foreign = {name: path for name, path in where.items() if not Path(path).is_relative_to(root)}
    if foreign:
        raise SystemExit(f"versions_driver: imported from outside {root}: {foreign}")
    return where


TREE_ROOT = tree_root_from_env()
install_tree_finder(TREE_ROOT)

import torch  # noqa: E402  (after the finder: nothing of the engine may be imported before it)

import infinity  # noqa: E402
import infinity.kernels  # noqa: E402
import infinity.kernels.extension  # noqa: E402
import infinity.storage  # noqa: E402
from infinity.models.gpt import GPT, GPTConfig  # noqa: E402

IMPORTED_FROM = imported_from(TREE_ROOT, {"infinity": infinity, "infinity.kernels": infinity.kernels,
                                          "infinity.storage": infinity.storage})


def kernel_facts() -> dict:
    """Builds (or loads) the tree's C++ kernel and says where its build lives and whether it loaded."""
    start = time.perf_counter()
    backend = infinity.kernels.backend()
    extension = infinity.kernels.extension
    return {"kernel_backend": backend, "kernel_build_dir": str(extension.cache_root() / extension.cache_key()),
            "kernel_load_s": time.perf_counter() - start}


def prepare() -> dict:
    cuda = torch.cuda.is_available()
    return {"tree": str(TREE_ROOT), "imported_from": IMPORTED_FROM, **kernel_facts(), "torch": torch.__version__,
            "cuda": cuda, "device_name": torch.cuda.get_device_name() if cuda else "cpu"}


def engine_config(spec: dict, device: torch.device) -> dict:
    """The same config in every tree: keys the first engine already took."""
    pin = {"pin_memory": True} if device.type == "cuda" else {}  # the first trees pinned only when asked
    return {
        "gradient_accumulation_steps": spec["grad_accum"],
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": spec["sub_group_size"],
            "stage3_param_persistence_threshold": spec.get("persistence_threshold", 100_000),
            "offload_param": {"device": spec["offload_param"], **pin},
            "offload_optimizer": {"device": spec["offload_optimizer"], **pin},
        },
    }


def batches_for(spec: dict, cfg: GPTConfig, step: int, device: torch.device) -> list:
    """The same micro-batches for every tree and the reference: seeded by the step's index."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(spec["grad_accum"]):
        idx = torch.randint(0, cfg.vocab_size, (spec["micro_batch"], spec["seq"] + 1), generator=g)
        out.append((idx[:, :-1].to(device), idx[:, 1:].to(device)))
    return out


class PlainStep:
    """Plain PyTorch on the device: bf16 autocast, torch.optim.AdamW (fused on CUDA), the same accumulation."""

    def __init__(self, cfg: GPTConfig, device: torch.device):
        torch.manual_seed(0)
        with device:
            self.model = GPT(cfg)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1,
                                     fused=device.type == "cuda")
        self.device = device

    def __call__(self, batches) -> float:
        for idx, targets in batches:
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                loss = self.model(idx, targets)
            (loss / len(batches)).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def close(self) -> None:
        del self.model, self.opt


class EngineStep:
    """This tree's engine: one ``step()`` after every micro-batch's backward, as DeepSpeed's loop."""

    def __init__(self, cfg: GPTConfig, spec: dict, device: torch.device):
        torch.manual_seed(0)
        with infinity.Init():
            model = GPT(cfg)
        self.engine = infinity.initialize(model, engine_config(spec, device))

    def __call__(self, batches) -> float:
        for idx, targets in batches:
            loss = self.engine(idx, targets)
            self.engine.backward(loss)
            self.engine.step()
        return float(loss.detach())

    def copies(self) -> dict:
        metrics = self.engine.step_metrics() if hasattr(self.engine, "step_metrics") else {}
        return metrics.get("copies", {})

    def close(self) -> None:
        if hasattr(self.engine, "close"):
            self.engine.close()
        del self.engine


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a step's time includes the GPU work it queued


def run(spec: dict) -> dict:
    cuda = torch.cuda.is_available()
    if not cuda and not spec["allow_cpu"]:
        raise SystemExit("versions_driver: CUDA is not available (allow_cpu is false)")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg = GPTConfig(**spec["model"])
    facts = kernel_facts() if spec["mode"] == "engine" else {}
    start = time.perf_counter()
    stepper = EngineStep(cfg, spec, device) if spec["mode"] == "engine" else PlainStep(cfg, device)
    setup_s = time.perf_counter() - start
    step_s, losses = [], []
    try:
        for step in range(spec["warmup"] + spec["steps"]):
            batches = batches_for(spec, cfg, step, device)
            synchronize(device)
            start = time.perf_counter()
            losses.append(stepper(batches))
            synchronize(device)
            if step >= spec["warmup"]:
                step_s.append(time.perf_counter() - start)
        copies = stepper.copies() if isinstance(stepper, EngineStep) else {}
    finally:
        stepper.close()
    return {"mode": spec["mode"], "tree": str(TREE_ROOT), "imported_from": IMPORTED_FROM, **facts,
            "device_name": torch.cuda.get_device_name() if cuda else "cpu", "setup_s": setup_s,
            "step_s": step_s, "median_step_s": statistics.median(step_s), "losses": losses, "copies": copies,
            "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "peak_rss_bytes": _peak_rss_bytes()}


def main(argv: list[str]) -> int:
    if argv == ["--prepare"]:
        result = prepare()
    elif len(argv) == 2 and argv[0] == "--run":
        result = run(json.loads(argv[1]))
    else:
        raise SystemExit("usage: versions_driver.py --prepare | --run SPEC_JSON")
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


def _peak_rss_bytes() -> int:
    """This process's own peak RSS: ``VmHWM`` (``ru_maxrss`` carries the driver's peak across exec). Written here,
    not imported: the trees this driver runs may predate ``infinity.runtime.rss``."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


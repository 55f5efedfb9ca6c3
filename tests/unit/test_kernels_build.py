"""infinity.kernels: choosing the backend, loading the kernel once, the build
cache, and the fallback when no compiler is found."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import infinity.kernels as kernels
from infinity.kernels import extension

pytestmark = pytest.mark.device_independent  # the distinct-device pass leaves it out

KERNELS_DIR = Path(kernels.__file__).resolve().parent
ARGS = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != kernels.BACKEND_ENV}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=240, check=False
    )


def test_env_torch_selects_the_reference(monkeypatch):
    monkeypatch.setenv(kernels.BACKEND_ENV, "torch")
    assert kernels.backend() == "torch"
    a = [torch.randn(100), torch.randn(100), torch.zeros(100), torch.zeros(100)]
    b = [t.clone() for t in a]
    kernels.adam_step(*a, **ARGS)
    kernels.adam_step_reference(*b, **ARGS)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_env_with_an_unknown_value_is_rejected(monkeypatch):
    monkeypatch.setenv(kernels.BACKEND_ENV, "fortran")
    with pytest.raises(ValueError, match=kernels.BACKEND_ENV):
        kernels.backend()


class UnavailableKernel(extension._Kernel):
    def _load(self):
        return None, "no compiler in this test"


def test_unavailable_kernel_falls_back_unless_cpp_is_required(monkeypatch):
    monkeypatch.setattr(extension, "KERNEL", UnavailableKernel())
    monkeypatch.delenv(kernels.BACKEND_ENV, raising=False)
    assert kernels.backend() == "torch"
    a = [torch.randn(10), torch.randn(10), torch.zeros(10), torch.zeros(10)]
    kernels.adam_step(*a, **ARGS)  # runs on the reference
    assert a[0].isfinite().all()
    monkeypatch.setenv(kernels.BACKEND_ENV, "cpp")
    with pytest.raises(RuntimeError, match="no compiler in this test"):
        kernels.backend()


def test_concurrent_first_calls_load_once():
    loads = []

    class SlowKernel(extension._Kernel):
        def _load(self):
            loads.append(threading.get_ident())
            time.sleep(0.2)
            return "ops", None

    kernel = SlowKernel()
    results = []
    threads = [threading.Thread(target=lambda: results.append(kernel.ops())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(loads) == 1
    assert results == ["ops"] * 8


def test_cache_key_covers_cpu_flags_sources_and_honours_xdg(monkeypatch, tmp_path):
    key = extension.cache_key()
    monkeypatch.setattr(extension, "_cpu_flags", lambda: "sse2")
    assert extension.cache_key() != key
    monkeypatch.undo()
    csrc = tmp_path / "csrc"
    shutil.copytree(extension._CSRC, csrc)
    monkeypatch.setattr(extension, "_CSRC", csrc)
    assert extension.cache_key() == key
    (csrc / "adam.cpp").write_text((csrc / "adam.cpp").read_text() + "\n// changed\n")
    assert extension.cache_key() != key
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert extension.cache_root() == tmp_path / "zero-infinity" / "kernels"
    assert "-march=native" in extension.compile_flags() or not sys.platform.startswith("linux")


def test_no_compiler_falls_back_to_torch_with_one_warning(tmp_path):
    code = (
        "import torch, infinity.kernels as k\n"
        "a = [torch.randn(10), torch.randn(10), torch.zeros(10), torch.zeros(10)]\n"
        f"k.adam_step(*a, **{ARGS!r}); k.adam_step(*a, **{ARGS!r})\n"
        "print(k.backend())\n"
    )
    proc = run_python(code, CXX=str(tmp_path / "no-such-c++"), XDG_CACHE_HOME=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["torch"]
    warnings = [line for line in proc.stderr.splitlines() if "unavailable" in line]
    assert len(warnings) == 1, proc.stderr
    assert "no-such-c++" in warnings[0]
    assert "building" not in proc.stderr
    assert not list(tmp_path.rglob("*.so")), "nothing may be left in the cache"


def test_a_cached_build_loads_without_building(monkeypatch):
    if shutil.which(extension._compiler()) is None:
        pytest.skip("no C++ compiler")
    monkeypatch.delenv(kernels.BACKEND_ENV, raising=False)
    assert kernels.backend() == "cpp", extension.KERNEL.error
    build_dir = extension.cache_root() / extension.cache_key()
    assert (build_dir / "built.ok").is_file()
    proc = run_python("import infinity.kernels as k; print(k.backend())")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["cpp"]
    assert "building" not in proc.stderr


def test_kernels_import_only_torch_numpy_and_the_standard_library():
    allowed = {"torch", "numpy", "__future__"} | set(sys.stdlib_module_names)
    for path in KERNELS_DIR.glob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"

"""Models and training loops shared by the tests: the engine against plain PyTorch."""

from __future__ import annotations

import copy
import datetime
import itertools
import os
import random
import socket
import sys
import tempfile
import threading
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d)
        # no bias: a key bias has a zero gradient, which Adam would turn into noise-driven steps
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """GPT-style: token + position embeddings (the latter a bare parameter of the root), blocks, tied head."""

    def __init__(self, vocab: int = 64, d: int = 32, n_layer: int = 2, n_head: int = 2, seq: int = 16):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Parameter(torch.randn(seq, d) * 0.02)   # used in the root's own forward
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight                     # tied

    def reset_parameters(self):
        """Initializes the root's own parameter (the engine calls it for a model built on meta)."""
        with torch.no_grad():
            self.wpe.normal_(0.0, 0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


class TiedMLP(nn.Module):
    """An MLP whose decoder reuses the encoder's weight, transposed, in the root's forward; an odd-sized layer."""

    def __init__(self, d_in: int = 12, d_hidden: int = 37):
        super().__init__()
        self.enc = nn.Linear(d_in, d_hidden)
        self.mid = nn.Linear(d_hidden, d_hidden)
        self.dec_bias = nn.Parameter(torch.zeros(d_in))

    def forward(self, x, y):
        h = torch.tanh(self.enc(x))
        h = torch.tanh(self.mid(h)) + h
        out = F.linear(h, self.enc.weight.t(), self.dec_bias)   # the encoder's weight, outside enc's forward
        return F.mse_loss(out.float(), y)


def kernel_bodies() -> list[str]:
    """The C++ kernels' bodies this CPU can run, from the oldest (the kernel must be loaded)."""
    from infinity.kernels import extension

    order = ["generic", "avx2", "avx512"]
    return order[: order.index(extension.best_isa()) + 1]


def absolute_imports(path) -> list[str]:
    """The modules a source file imports by absolute name (``import a.b``, ``from a.b import c``), anywhere in it."""
    import ast
    from pathlib import Path

    names = []
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module)
    return names


def gpt_batches(n: int, *, batch: int, seq: int = 16, vocab: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    return out


def mlp_batches(n: int, *, batch: int, d_in: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d_in, generator=g), torch.randn(batch, d_in, generator=g)) for _ in range(n)]


def rank_slice(batch, rank: int, world_size: int):
    return tuple(t.chunk(world_size)[rank].contiguous() for t in batch)


def reference_train(model: nn.Module, batches, *, steps: int, accum: int, clip: float, lr: float,
                    weight_decay: float = 0.01, adamw: bool = True, param_groups=None):
    """Plain PyTorch in one process: the losses of every micro-batch and the final parameters.
    ``param_groups(model)``: the optimizer's param groups of the reference's copy of the model."""
    model = copy.deepcopy(model)
    opt_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    params = model.parameters() if param_groups is None else param_groups(model)
    opt = opt_cls(params, lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    losses = []
    it = iter(batches)
    for _ in range(steps):
        for _ in range(accum):
            loss = model(*next(it))
            (loss / accum).backward()
            losses.append(loss.item())
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}



def assert_matches(result, reference, where: str) -> None:
    """``result`` (losses, state, ...) of an engine run equals ``reference`` (losses, state) of plain PyTorch."""
    losses, state = result[:2]
    ref_losses, ref_state = reference
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{where}: losses differ: {m}")
    for key, ref in ref_state.items():
        torch.testing.assert_close(state[key], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {key}: {m}")

def engine_config(*, param: str, optimizer: str, nvme_path: str | None, accum: int, clip: float, lr: float,
                  precision: str = "fp32", weight_decay: float = 0.01, adamw: bool = True, device: str = "cpu",
                  **zero_extra):
    """A ZeRO-3 config with params and optimizer on the given tiers. ``device`` is ``cpu`` by default, also
    where there is a GPU: the tests compare with plain PyTorch on the CPU (``reference_train``) at 1e-5, and
    a GPU's sums round differently (tests/gpu passes ``auto`` and compares with PyTorch on the GPU)."""
    offload_param = {"device": param}
    offload_optimizer = {"device": optimizer}
    if param == "nvme":
        offload_param["nvme_path"] = nvme_path
        offload_param["max_in_cpu"] = 0  # really on NVMe, not cached in host memory
    if optimizer == "nvme":
        offload_optimizer["nvme_path"] = nvme_path
        offload_optimizer["max_in_cpu"] = 0  # every sub-group on NVMe, not kept in host memory within the budget
    return {
        "device": device,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW" if adamw else "Adam",
                      "params": {"lr": lr, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": weight_decay,
                                 **({} if adamw else {"adam_w_mode": False})}},
        "bf16": {"enabled": precision == "bf16"},
        "zero_optimization": {"stage": 3, "offload_param": offload_param, "offload_optimizer": offload_optimizer,
                              "stage3_param_persistence_threshold": 0, "sub_group_size": 3000, **zero_extra},
    }


def engine_train(model: nn.Module, config: dict, batches, *, steps: int, accum: int, rank: int = 0,
                 world_size: int = 1):
    """The engine on this rank's slice of each batch: the global-mean losses and the full state dict."""
    import infinity

    micro_batches = list(itertools.islice(batches, steps * accum))
    if len(micro_batches) < steps * accum:
        raise ValueError(f"{steps} steps x {accum} micro-batches need {steps * accum} batches, got {len(micro_batches)}")
    engine = infinity.initialize(copy.deepcopy(model), config)
    try:
        # one step() per micro-batch: the engine's step is a no-op between accumulation boundaries
        losses = train_batches(engine, micro_batches, rank=rank, world_size=world_size)
        state = engine.full_state_dict()
        metrics = engine.step_metrics()
    finally:
        engine.close()
    return losses, state, metrics


def train_batches(engine, batches, *, rank: int = 0, world_size: int = 1) -> list[float]:
    """One micro-batch and one step per batch, on this rank's slice of it: the global-mean losses."""
    losses = []
    for batch in batches:
        loss = engine(*rank_slice(batch, rank, world_size))
        engine.backward(loss)
        engine.step()
        value = loss.detach().float().reshape(1)
        if world_size > 1:
            engine.comm.all_reduce_sum(value)
        losses.append(value.item() / world_size)
    return losses


def optimizer_states(engine) -> dict:
    """Every sub-group's master and moments as fp32, by (state name, sub-group index)."""
    out = {}
    for group in engine.layout.sub_groups:
        for name in ("master", "exp_avg", "exp_avg_sq"):
            values = torch.empty(group.numel)
            engine.optimizer.read_state(name, group, values)
            out[name, group.index] = values
    return out


def engine_steps(model: nn.Module, config: dict, batches, *, steps: int, accum: int, setup=None, after_step=None,
                 param_groups=None):
    """One process, whole batches: every micro-batch's loss, the full state dict, each step's metrics and the
    placement. ``setup(engine)`` runs before the first step (to make copies late, say), ``after_step(engine,
    step)`` after each (to set the next learning rate, say); ``param_groups(model)``: the engine's param groups
    of its copy of the model."""
    import infinity

    model = copy.deepcopy(model)
    engine = infinity.initialize(model, config, param_groups=None if param_groups is None else param_groups(model))
    if setup is not None:
        setup(engine)
    losses, metrics, it = [], [], iter(batches)
    try:
        for _ in range(steps):
            for _ in range(accum):
                loss = engine(*next(it))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            metrics.append(engine.step_metrics())
            if after_step is not None:
                after_step(engine, len(metrics) - 1)
        return losses, engine.full_state_dict(), metrics, engine.placement
    finally:
        engine.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- running ranks as processes --------------------------------------------------

RANK_PRELOAD = ["torch", "torch.distributed", "numpy", "safetensors.torch", "infinity.engine.engine",
                "infinity.kernels", "helpers", "transformers", "peft", "transformers.models.llama.modeling_llama"]
"""What multiprocessing's forkserver imports once for the session: a rank forked from it starts in milliseconds,
where a spawned one imported torch (and a Hugging Face test's transformers) again, 3-8 s on two cores."""


def _rank_entry(rank: int, world_size: int, port: int, fn, args, result_dir: str, environ: dict, path: list):
    import numpy as np
    import torch.distributed as dist

    # as a spawned rank would start: the test's environment and import path now (the forkserver kept those of its
    # start), and random states of its own (every fork would otherwise share the server's)
    os.environ.clear()
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path[:] = path
    random.seed()
    np.random.seed()
    torch.set_num_threads(1)
    try:
        # a rank left waiting in a collective fails the test in minutes, not gloo's default half hour
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=5))
        try:
            result = fn(rank, world_size, *args)
            torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
        finally:
            dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(result_dir, f"rank{rank}.error"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_ranks(fn, *args, world_size: int = 2):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; return each rank's result. A rank that
    raises fails the call with its traceback, and the other ranks are stopped."""
    import multiprocessing
    from multiprocessing.connection import wait

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)  # taken when the server starts (the session's first ranks)
    with tempfile.TemporaryDirectory() as result_dir:
        port = free_port()
        ranks = [ctx.Process(target=_rank_entry,
                             args=(rank, world_size, port, fn, args, result_dir, dict(os.environ), list(sys.path)))
                 for rank in range(world_size)]
        for p in ranks:
            p.start()
        running = list(ranks)
        while running:
            wait([p.sentinel for p in running])
            failed = [p for p in running if p.exitcode not in (None, 0)]
            if failed:
                for p in running:
                    p.terminate()  # the others may wait in a collective for the failed one
                for p in running:
                    p.join()
                errors = [os.path.join(result_dir, f"rank{r}.error") for r in range(world_size)]
                said = [f"rank {r}: {open(e).read()}" for r, e in enumerate(errors) if os.path.exists(e)]
                raise RuntimeError(f"rank {ranks.index(failed[0])} of {world_size} exited with code "
                                   f"{failed[0].exitcode}\n" + "\n".join(said))
            running = [p for p in running if p.exitcode is None]
        return [torch.load(os.path.join(result_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


# -- storage whose completions are late -----------------------------------------------

class _SlowHandle:
    """Completes only when waited on, after a random delay: until then the bytes are not there."""

    def __init__(self, action):
        self._action = action
        self._lock = threading.Lock()
        self._done = False

    def wait(self, timeout=None):
        with self._lock:
            if not self._done:
                time.sleep(random.uniform(0, 0.002))
                self._action()
                self._done = True

    def done(self):
        return self._done


class DelayedStore:
    """A swap store whose reads and writes happen only at wait(): a missing wait shows as wrong numbers."""

    def __init__(self, real):
        self._real = real
        self._pending: dict[str, list[_SlowHandle]] = {}
        self.stats = real.stats

    def write(self, key, tensor, **kwargs):
        snapshot_at_wait = tensor  # the engine must keep the buffer unchanged until wait()
        handle = _SlowHandle(lambda: self._real.write(key, snapshot_at_wait, **kwargs).wait())
        self._pending.setdefault(key, []).append(handle)
        return handle

    def read(self, key, out, **kwargs):
        earlier = list(self._pending.get(key, ()))  # the store orders operations on one key

        def action():
            for h in earlier:
                h.wait()
            self._real.read(key, out, **kwargs).wait()
        return _SlowHandle(action)

    def delete(self, key):
        for handle in self._pending.pop(key, ()):  # the store deletes a key after its requests in flight
            handle.wait()
        self._real.delete(key)

    def __getattr__(self, name):
        return getattr(self._real, name)


def delay_storage(monkeypatch) -> None:
    """Every swap store the engine opens from now on completes its requests late (see :class:`DelayedStore`)."""
    import infinity.placement.tiers

    original = infinity.placement.tiers.Tiers.swap_store

    def delayed(self, nvme_path):
        store = original(self, nvme_path)
        if not isinstance(store, DelayedStore):
            wrapped = DelayedStore(store)
            for key, value in self._stores.items():
                if value is store:
                    self._stores[key] = wrapped
            return wrapped
        return store

    monkeypatch.setattr(infinity.placement.tiers.Tiers, "swap_store", delayed)


def slow_step_tail(monkeypatch) -> dict:
    """Each update a step tail's worker makes (``infinity.optim.step_tail``) takes 20 ms more, so the next forward
    reaches parameters before their sub-group is updated; returns counts of the fetches that found their
    sub-group not yet delivered (so had to wait) and of the updates the tail made."""
    from infinity.optim.overlapped_step import OverlappedStep
    from infinity.optim.step_tail import StepTail

    seen = {"waited": 0, "tail_updates": 0}
    update, wait_for = OverlappedStep._update, StepTail.wait_for

    def slow_update(self, group, **kwargs):
        if threading.current_thread().name == "infinity-step-tail":
            time.sleep(0.02)
            seen["tail_updates"] += 1
        update(self, group, **kwargs)

    def counting_wait_for(self, slot_index):
        if not self.delivered(slot_index):
            seen["waited"] += 1
        wait_for(self, slot_index)

    monkeypatch.setattr(OverlappedStep, "_update", slow_update)
    monkeypatch.setattr(StepTail, "wait_for", counting_wait_for)
    return seen

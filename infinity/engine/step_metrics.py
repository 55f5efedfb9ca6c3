"""Each optimizer step's figures, as :meth:`Engine.step_metrics <infinity.engine.engine.Engine.step_metrics>`
returns them: what the step itself reported (gradient norm, how an overlapped
step settled, optimizer seconds), and, since the step before it, the bytes
each tier read and wrote with its live and peak bytes, the bytes of each
collective and of each host⇄device crossing, the compute-shard bytes copied
from a staging set instead of read from NVMe, seconds of compute and of the
whole step, seconds in the engine's module and gradient hooks (``hooks_s``: the feeding thread's work on the
tensors it fetches and releases, their waits for I/O included, which ``fetch_wait_s`` counts), and the timeline's
summary; ``optimizer_states`` says where the optimizer's states rest
(sub-groups and bytes on the device, in host memory and on NVMe), and ``optimizer_split`` (a split optimizer:
``offload_optimizer.device: auto`` or a ``ratio``) how many sub-groups rest on the device, how that count was
chosen (for ``auto`` by the step-time model: the predicted step of the chosen count and with every sub-group
offloaded), the device budget and the bytes its share holds.
"""

from __future__ import annotations

import time
from typing import Any

from infinity.kernels import state_nbytes
from infinity.optim.offload_optimizer import OffloadOptimizer
from infinity.params.hooks import HookClock
from infinity.params.staging import StagedShards
from infinity.placement.copies import Copies
from infinity.placement.optimizer_split import OptimizerSplit
from infinity.placement.tiers import Tiers
from infinity.runtime.comm import Collectives
from infinity.runtime.trace import Timeline


class StepMeter:
    """Counts since the last step, closed into ``metrics`` at each step's end."""

    def __init__(self, tiers: Tiers, comm: Collectives, copies: Copies, timeline: Timeline, staged: StagedShards,
                 optimizer_states: dict | None, hooks_clock: HookClock):
        """``optimizer_states``: where the optimizer's states rest (sub-groups and bytes by tier), fixed for the run;
        ``hooks_clock``: the module hooks' seconds."""
        self._hooks_clock = hooks_clock
        self._tiers = tiers
        self._staged = staged
        self._comm = comm
        self._copies = copies
        self._timeline = timeline
        self.metrics: dict[str, Any] = {} if optimizer_states is None else {"optimizer_states": optimizer_states}
        """The last step's figures; the step writes its own into it too (keys it does not set keep their value)."""
        self.last_counters = self._counters()
        self._step_started = time.perf_counter()
        self._compute_s = 0.0

    def add_compute(self, seconds: float) -> None:
        """A forward's or backward's seconds."""
        self._compute_s += seconds

    def _counters(self) -> dict:
        return {"tiers": self._tiers.snapshot(), "collectives": dict(self._comm.nbytes),
                "copies": self._copies.snapshot(), "staged_nbytes": self._staged.hit_nbytes}

    def close_step(self, *, step: int, skipped: bool, lr: float, loss_scale: float | None) -> None:
        now = self._counters()
        last = self.last_counters
        tiers = {}
        for tier, snap in now["tiers"].items():
            prev = last["tiers"].get(tier, {})
            tiers[tier] = {
                "live_nbytes": snap["live_nbytes"], "peak_nbytes": snap["peak_nbytes"],
                "bytes_read": snap["bytes_read"] - prev.get("bytes_read", 0),
                "bytes_written": snap["bytes_written"] - prev.get("bytes_written", 0),
                "wait_s": snap["wait_s"] - prev.get("wait_s", 0.0),
            }
        collectives = {f"{name}_nbytes": n - last["collectives"].get(name, 0) for name, n in now["collectives"].items()}
        # host<->device traffic: what a GPU run moves over PCIe (zero where device memory is host memory)
        copies = {name: n - last["copies"][name] for name, n in now["copies"].items()}
        elapsed = time.perf_counter() - self._step_started
        self.metrics["timeline"] = self._timeline.close_step()
        self.metrics.update(step=step, skipped=skipped, tiers=tiers, collectives=collectives, copies=copies,
                            compute_s=self._compute_s, step_s=elapsed, hooks_s=self._hooks_clock.take(),
                            compute_shards_from_staging_nbytes=now["staged_nbytes"] - last["staged_nbytes"],
                            fetch_wait_s=sum(t["wait_s"] for t in tiers.values()),
                            lr=lr, loss_scale=loss_scale)
        self.last_counters = now
        self._step_started = time.perf_counter()
        self._compute_s = 0.0


def optimizer_states_by_tier(optimizer: OffloadOptimizer) -> dict[str, dict[str, int]]:
    """Where the optimizer's states rest: sub-groups and bytes (in their resting form) on the device, in host
    memory and on NVMe (``optimizer_states``; a split optimizer's split)."""
    out = {tier: {"sub_groups": 0, "nbytes": 0} for tier in ("device", "host", "nvme")}
    for group in optimizer.layout.sub_groups:
        where = out[optimizer.state_tier(group)]
        where["sub_groups"] += 1
        where["nbytes"] += state_nbytes(optimizer.state_dtype, group.numel)
    return out


def optimizer_split_metrics(split: OptimizerSplit, tiers: Tiers) -> dict:
    """``optimizer_split``: the split's sub-groups, how its count was chosen, the device budget enforced for the
    optimizer's states and gradient slices on the device (None: none) and the bytes that share holds."""
    share = tiers.device_optimizer
    return {"device_sub_groups": split.device_sub_groups, "sub_groups": split.sub_groups,
            "device_numel": split.device_numel, **(split.choice or {}), "budget_nbytes": split.budget_nbytes,
            "device_share_nbytes": share.live_nbytes, "device_share_peak_nbytes": share.peak_nbytes}

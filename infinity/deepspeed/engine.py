"""The engine under DeepSpeed's names: what ``deepspeed.initialize`` returns, with the methods a DeepSpeed script
calls on it (``train_batch_size()``, ``get_lr()``, ``deepspeed_io``, ``save_16bit_model``, ...) and DeepSpeed's
``load_checkpoint`` returning ``(load_path, client_state)``.

Where DeepSpeed's engine takes an argument this one cannot honour (``retain_graph``, ``load_optimizer_states=False``,
...), a value other than the default is refused naming it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from infinity.checkpoint.files import META_FILE
from infinity.checkpoint.publish import LATEST_FILE, resolve_checkpoint, write_state_dict_atomic
from infinity.checkpoint.recovery_script import write_recovery_script
from infinity.deepspeed import client_state as client_states
from infinity.deepspeed.client_schedule import CHECKPOINT_KEY as SCHEDULE_KEY, ClientSchedule, ScheduleView
from infinity.deepspeed.monitor import DeepSpeedMonitor
from infinity.deepspeed.optimizer_view import OptimizerView
from infinity.deepspeed.throughput import ThroughputTimer
from infinity.deepspeed.zero import ZeroParamStatus
from infinity.engine.engine import Engine
from infinity.runtime.comm import local_rank_and_size

logger = logging.getLogger(__name__)


class DeepSpeedEngine(Engine):
    """:class:`~infinity.engine.engine.Engine` as DeepSpeed's ``DeepSpeedEngine`` is called."""

    def __init__(self, model: torch.nn.Module, config, *, drop_last: bool = False, lr_scheduler=None,
                 monitors: dict | None = None, client_optimizer: torch.optim.Optimizer | None = None,
                 gather_16bit_on_save: bool = False, trains: bool = True, **kwargs):
        """``drop_last``: the config's ``dataloader_drop_last``, for :meth:`deepspeed_io`. ``lr_scheduler``: the
        script's (a :class:`ClientSchedule`, or a callable making a scheduler from an optimizer). ``monitors``: the
        config's monitor blocks by name (:mod:`~infinity.deepspeed.monitor`). ``client_optimizer``: the optimizer
        the script made and gave ``initialize``, whose groups' ``lr`` the engine follows. ``gather_16bit_on_save``:
        the config's ``stage3_gather_16bit_weights_on_model_save``. ``trains``: False where ``initialize`` was given
        no optimizer (neither the config's block nor ``optimizer=``): forwards only, as DeepSpeed's engine then."""
        super().__init__(model, config, **kwargs)
        # DeepSpeed's engine.optimizer: param_groups (one per group given), cur_scale
        self.optimizer = OptimizerView(self, self.optimizer, kwargs.get("param_groups"))
        self.trains = trains
        self._drop_last = drop_last
        self._gather_16bit_on_save = gather_16bit_on_save
        self._client_optimizer = client_optimizer
        self._client_lr = self.lr  # the client groups' lr the engine last took (initialize took it from them)
        self.monitor = DeepSpeedMonitor(monitors or {}, rank=self.rank)
        self._step_losses: list[torch.Tensor] = []  # the step's micro-batch losses, for the monitor (no sync)
        for sharded in self.params:  # DeepSpeed's marks of a partitioned parameter, which scripts test for
            param, slot = sharded.param, sharded.slot
            param.ds_id, param.ds_numel, param.ds_shape = slot.index, slot.numel, torch.Size(slot.shape)
            param.ds_status = ZeroParamStatus.NOT_AVAILABLE
        if lr_scheduler is not None and not isinstance(lr_scheduler, ClientSchedule):
            lr_scheduler = ClientSchedule.made_by(lr_scheduler, self.lr,
                                                  [group["weight_decay"] for group in self.optimizer.param_groups])
        self.client_schedule: ClientSchedule | None = lr_scheduler
        """The script's learning-rate scheduler, stepped after each applied optimizer step; None: the config's."""
        if lr_scheduler is not None:
            self.set_lr(lr_scheduler.lr())  # the schedule's first step
        self.tput_timer = ThroughputTimer(self.config.micro_batch_size * self.config.gradient_accumulation_steps
                                          * self.world_size if self.config.micro_batch_size else 0)
        """Samples a second of the steps so far (DeepSpeed's ``ThroughputTimer``)."""

    def __getattr__(self, name: str):
        """What the engine does not have, the model answers (``engine.gradient_checkpointing_enable()``), as
        DeepSpeed's engine forwards it; the engine's own names come first (``engine.config`` is the engine's)."""
        module = self.__dict__.get("module")
        if module is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            return getattr(module, name)
        except AttributeError:
            if hasattr(type(module), name):
                raise  # a property of the model failed inside: its own error says where
            raise AttributeError(  # named after what the script asked: the engine, as DeepSpeed's engine names it
                f"{type(self).__name__!r} object has no attribute {name!r} (nor has its model, "
                f"{type(module).__name__}): the engine offers DeepSpeed's names listed in docs/deepspeed.md"
            ) from None

    # -- DeepSpeed's names for what the engine knows ----------------------------------------------------------
    @property
    def lr_scheduler(self):
        """The script's scheduler, or a view of the config's ``scheduler`` block; None without either."""
        if self.client_schedule is not None:
            return self.client_schedule.scheduler
        return ScheduleView(self) if self.config.scheduler is not None else None

    @property
    def global_rank(self) -> int:
        return self.rank

    @property
    def local_rank(self) -> int:
        return local_rank_and_size()[0]

    @property
    def global_steps(self) -> int:
        return self.global_step

    @property
    def dp_world_size(self) -> int:
        return self.world_size

    @property
    def mp_world_size(self) -> int:
        return 1  # data parallel only

    @property
    def global_samples(self) -> int:
        return self.global_step * self.train_batch_size()

    def zero_optimization(self) -> bool:
        return True

    def zero_optimization_stage(self) -> int:
        return 3  # lower stages in the config run as stage 3

    def train_micro_batch_size_per_gpu(self) -> int:
        if self.config.micro_batch_size is None:
            raise ValueError("the config gives no train_micro_batch_size_per_gpu (nor train_batch_size with "
                             "gradient_accumulation_steps to derive it from)")
        return self.config.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self.train_micro_batch_size_per_gpu() * self.config.gradient_accumulation_steps * self.world_size

    def fp16_enabled(self) -> bool:
        return self.config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.config.precision == "bf16"

    def get_lr(self) -> list[float]:
        return [self.lr]

    def was_step_applied(self) -> bool:
        """False when the last optimizer step was skipped (an fp16 overflow)."""
        return not self.step_metrics().get("skipped", False)

    def zero_grad(self) -> None:
        """Nothing to do: the engine hands each gradient to its reducer as backward makes it, and a step's
        accumulation starts afresh after each optimizer step (as DeepSpeed's ``step`` zeroes them)."""

    # -- training, with DeepSpeed's arguments --------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self._follow_client_lr()
        self.tput_timer.start()
        return super().forward(*args, **kwargs)

    def backward(self, loss: torch.Tensor, allreduce_gradients: bool = True, release_loss: bool = False,
                 retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        self._refuse_without_optimizer("backward")
        _refuse_non_default("backward", allreduce_gradients=(allreduce_gradients, True),
                            retain_graph=(retain_graph, False))
        self._follow_client_lr()
        super().backward(loss, scale_wrt_gas=scale_wrt_gas)
        if self.monitor.enabled:
            self._step_losses.append(loss.detach().float())

    def step(self, lr_kwargs=None) -> None:
        self._refuse_without_optimizer("step")
        _refuse_non_default("step", lr_kwargs=(lr_kwargs, None))
        before, lr = self.global_step, self.lr
        super().step()
        stepped = self.global_step != before  # an accumulation boundary: the optimizer ran (or skipped, in fp16)
        self.tput_timer.stop(global_step=stepped)
        if stepped and self.monitor.enabled:
            self._write_step_events(lr)
        if stepped and self.client_schedule is not None and self.was_step_applied():
            self.set_lr(self.client_schedule.step())  # as DeepSpeed's engine: not after a skipped fp16 step

    def _refuse_without_optimizer(self, method: str) -> None:
        """DeepSpeed's engine asserts an optimizer before ``backward`` and ``step``; this one says which to give."""
        if not self.trains:
            raise RuntimeError(f"engine.{method}(): the engine has no optimizer to train with: the DeepSpeed config "
                               f"has no \"optimizer\" block and deepspeed.initialize() was given no optimizer=...; "
                               f"give one of them to train (forwards and evaluation run without)")

    def _follow_client_lr(self) -> None:
        """DeepSpeed's engine steps with the ``lr`` of the script's own optimizer's groups, so a rate written there
        between steps (by the script, by a scheduler over that optimizer that ``initialize`` was not given:
        accelerate's loop steps its scheduler so) is the next step's. The engine takes a change when it sees one;
        a rate set through the engine's own names stands until the groups change again."""
        if self._client_optimizer is None:
            return
        rates = {float(group["lr"]) for group in self._client_optimizer.param_groups}
        if rates == {self._client_lr}:
            return
        if len(rates) != 1:
            raise ValueError(f"the optimizer given to initialize has groups at the learning rates {sorted(rates)}: "
                             "the engine has one learning rate, so its groups must move together")
        self._client_lr = rates.pop()
        self.set_lr(self._client_lr)

    def _write_step_events(self, lr: float) -> None:
        """The step's figures under DeepSpeed's names, at its global samples."""
        loss = torch.stack(self._step_losses).mean().item() if self._step_losses else float("nan")
        self._step_losses.clear()
        samples = self.global_samples
        events = [("Train/Samples/train_loss", loss, samples), ("Train/Samples/lr", lr, samples)]
        if self.loss_scaler is not None:
            events.append(("Train/Samples/loss_scale", self.loss_scaler.scale, samples))
        self.monitor.write_events(events)

    def close(self) -> None:
        try:
            super().close()
        finally:
            monitor = self.__dict__.get("monitor")  # absent where the engine failed to build
            if monitor is not None:
                monitor.close()

    def deepspeed_io(self, dataset, batch_size: int | None = None, route=None, pin_memory: bool = True,
                     data_sampler=None, collate_fn=None, num_local_io_workers: int | None = None) -> DataLoader:
        """A loader of micro-batches of ``dataset`` for this rank, as DeepSpeed's: each rank a disjoint share
        (torch's ``DistributedSampler``) where there are several, else a random order; the config's
        ``dataloader_drop_last``."""
        if data_sampler is None:
            data_sampler = (DistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank)
                            if self.world_size > 1 else RandomSampler(dataset))
        return DataLoader(dataset, batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
                          sampler=data_sampler, collate_fn=collate_fn, num_workers=num_local_io_workers or 0,
                          pin_memory=pin_memory and self.device.type == "cuda", drop_last=self._drop_last)

    # -- checkpoints, with DeepSpeed's returns -------------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag: str | int | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """As :meth:`Engine.save_checkpoint` (``latest`` always names the newest); True, as DeepSpeed returns.
        ``client_state``: anything ``torch.save`` stores, as DeepSpeed's (:mod:`~infinity.deepspeed.client_state`)."""
        _refuse_non_default("save_checkpoint", save_latest=(save_latest, True))
        tag = None if tag is None else str(tag)  # DeepSpeed's str(tag): a script's step number names the folder
        self._follow_client_lr()  # a rate the script set since the last step is the one the resumed run goes on with
        if self.client_schedule is not None:
            if client_state and SCHEDULE_KEY in client_state:
                raise ValueError(f"save_checkpoint(client_state=...): the key {SCHEDULE_KEY!r} holds the "
                                 "lr_scheduler's state; name yours otherwise")
            client_state = dict(client_state or {}, **{SCHEDULE_KEY: self.client_schedule.state_dict()})
        stored = client_states.encode(client_state if client_state is not None else {})  # refused before any file
        super().save_checkpoint(save_dir, tag=tag, client_state=stored,
                                exclude_frozen_parameters=exclude_frozen_parameters)
        if self.rank == 0:
            write_recovery_script(save_dir)  # where DeepSpeed writes its own: `python zero_to_fp32.py . OUT` works
        return True

    def load_checkpoint(self, load_dir, tag: str | int | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        """``(the checkpoint's folder, its client_state)``; ``(None, None)`` without a tag where ``load_dir`` holds
        no ``latest`` (nothing saved yet), as DeepSpeed returns (a script then starts afresh).

        ``load_optimizer_states=False``: the model's fp32 masters and the step counters, not the moments (the run
        keeps its own, and its optimizer step for their bias correction); ``load_module_only=True``: the model's
        values alone (nor the counters, nor the schedule); ``load_lr_scheduler_states=False``: the script's
        scheduler stays as it is."""
        _refuse_non_default("load_checkpoint", load_module_strict=(load_module_strict, True),
                            custom_load_fn=(custom_load_fn, None))
        tag = None if tag is None else str(tag)  # as save_checkpoint names its folder
        folder = Path(load_dir)
        if tag is None and not (folder / LATEST_FILE).is_file() and not (folder / META_FILE).is_file():
            logger.warning("no %s file in %s: no checkpoint loaded (pass a tag to load one by name)", LATEST_FILE,
                           load_dir)
            return None, None
        client_state = super().load_checkpoint(load_dir, tag=tag,
                                               optimizer_states=load_optimizer_states and not load_module_only,
                                               counters=not load_module_only)
        if self._client_optimizer is not None and load_optimizer_states and not load_module_only:
            self._client_lr = self.lr  # the groups hold the loaded rate, as DeepSpeed's load restores them
            for group in self._client_optimizer.param_groups:
                group["lr"] = self.lr
        client_state = client_states.decode(client_state)
        schedule_state = client_state.pop(SCHEDULE_KEY, None) if isinstance(client_state, dict) else None
        if self.client_schedule is not None and load_lr_scheduler_states and not load_module_only:
            if schedule_state is None:
                logger.warning("the checkpoint in %s holds no lr_scheduler state: the schedule goes on from where "
                               "it is", load_dir)
            else:
                self.client_schedule.load_state_dict(schedule_state)
                self.set_lr(self.client_schedule.lr())
        return str(resolve_checkpoint(load_dir, tag)), client_state

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's ``stage3_gather_16bit_weights_on_model_save`` (accelerate's ``get_state_dict`` asks)."""
        return self._gather_16bit_on_save

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """The model's state dict whole, in the compute precision (fp32 runs: fp32), on rank 0; None on the other
        ranks, as DeepSpeed's. Collective: every rank calls it. The whole model passes through host memory at once:
        :meth:`save_pretrained` writes a tensor at a time."""
        state = self.full_state_dict()
        if exclude_frozen_parameters:
            frozen = {name for name, p in self.module.named_parameters() if not p.requires_grad}
            state = {name: value for name, value in state.items() if name not in frozen}
        if self.rank != 0:
            return None
        return {name: value.to(self.dtype) if value.is_floating_point() else value for name, value in state.items()}

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """:meth:`_zero3_consolidated_16bit_state_dict` written on rank 0 with ``torch.save`` (a ``.safetensors``
        name: safetensors), replacing the file atomically, as DeepSpeed's does. Collective: every rank calls it."""
        state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if state is None:
            return True
        os.makedirs(save_dir, exist_ok=True)
        write_state_dict_atomic(Path(save_dir) / save_filename, state)  # the old file or the new one, never half
        return True


def _refuse_non_default(method: str, **given) -> None:
    """``ValueError`` naming the first argument of ``method`` given other than its default
    (``name=(value, default)``)."""
    for name, (value, default) in given.items():
        if value is not default and value != default:
            raise ValueError(f"{method}({name}={value!r}) is not supported here (only {name}={default!r})")

"""``engine.optimizer`` as a DeepSpeed script sees it, and what ``deepspeed.initialize`` returns as its optimizer (the
same object, as DeepSpeed's ``initialize`` returns ``engine.optimizer``).

A script reads and sets ``param_groups[i]["lr"]`` and reads ``cur_scale`` / ``loss_scale`` (DeepSpeed's ZeRO
optimizers' fp16 loss scale; 1.0 where nothing is scaled, as their static scaler says). Everything else asked of it is
the engine's own optimizer's (:class:`~infinity.optim.offload_optimizer.OffloadOptimizer`): the engine's code reaches
its optimizer as ``self.optimizer`` and goes on doing so through this view unchanged.
"""

from __future__ import annotations


class OptimizerView:
    """``param_groups`` as ``torch.optim`` shows them. The engine has one learning rate: setting a group's ``"lr"``
    sets it for the next step (a value other than the other groups' for the same step is refused), and the other keys
    are read-only. ``zero_grad()`` does nothing, as the engine's step starts each accumulation afresh."""

    def __init__(self, engine, own, param_groups: list[dict] | None = None):
        """``engine``: the :class:`~infinity.deepspeed.engine.DeepSpeedEngine`; ``own``: its optimizer, which answers
        every other name; ``param_groups``: the groups ``initialize`` was given (checked by the engine), or None."""
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_own", own)
        default = engine.config.optimizer.weight_decay
        if param_groups is not None:  # DeepSpeed's optimizer keeps a group per group given, in order (a script and a
            # scheduler made over it index them: LambdaLR takes a lambda per group, get_last_lr() a rate per group)
            decays = [float(group.get("weight_decay", default)) for group in param_groups]
        else:
            decays = sorted({default if slot.weight_decay is None else slot.weight_decay
                             for slot in engine.layout.slots if slot.trainable}) or [default]
        lr_set: dict[int, tuple[int, float]] = {}  # group -> (the step it was set at, the value), shared
        object.__setattr__(self, "_groups", [_LiveGroup(engine, decay, index, lr_set)
                                             for index, decay in enumerate(decays)])

    def __getattr__(self, name: str):
        """The engine's optimizer's name (``lr``, ``state_dict``, ...): called only for names the view lacks."""
        if name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.__dict__["_own"], name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._own, name, value)  # the engine's code sets its optimizer's lr through here

    @property
    def param_groups(self) -> list[dict]:
        return self._groups

    @property
    def cur_scale(self) -> float:
        """The loss scale of the next backward: fp16's dynamic (or static) scale, else 1.0 (DeepSpeed's name)."""
        scaler = self._engine.loss_scaler
        return scaler.scale if scaler is not None else 1.0

    @property
    def loss_scale(self) -> float:
        """:attr:`cur_scale` (DeepSpeed's other name for it)."""
        return self.cur_scale

    @property
    def overflow(self) -> bool:
        """Whether the last optimizer step was skipped for an fp16 overflow (DeepSpeed's name; accelerate's
        ``optimizer_step_was_skipped`` reads it)."""
        return not self._engine.was_step_applied()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do (see the class)."""

    def step(self, *args, **kwargs):
        raise RuntimeError("call engine.step(): the optimizer steps inside the engine")


class _LiveGroup(dict):
    """One group of :class:`OptimizerView`: ``lr`` read from and written to the engine."""

    def __init__(self, engine, weight_decay: float, index: int, lr_set: dict):
        optimizer = engine.config.optimizer
        super().__init__(betas=optimizer.betas, eps=optimizer.eps, weight_decay=weight_decay)
        self._engine = engine
        self._index = index
        self._lr_set = lr_set

    def __getitem__(self, key):
        return self._engine.lr if key == "lr" else super().__getitem__(key)

    def get(self, key, default=None):
        return self[key] if key == "lr" or key in self else default

    def __contains__(self, key) -> bool:
        return key == "lr" or super().__contains__(key)

    def __setitem__(self, key, value) -> None:
        if key != "lr":
            raise ValueError(f"param_groups[...][{key!r}] cannot be set: the engine's optimizer takes it from the "
                             f"config (only 'lr' may be set)")
        value, step = float(value), self._engine.global_step
        for other, (at, other_value) in self._lr_set.items():
            if other != self._index and at == step and other_value != value:
                raise ValueError(f"param_groups[{self._index}]['lr'] = {value} but param_groups[{other}]['lr'] was set "
                                 f"to {other_value} for the same step: the engine has one learning rate")
        self._lr_set[self._index] = (step, value)
        self._engine.set_lr(value)

"""``infinity.hf.Trainer``: a Hugging Face ``transformers.Trainer`` whose model runs under the engine.

A user's script changes one import, ``Trainer`` from ``infinity.hf`` instead of ``transformers``, and passes its
DeepSpeed JSON as ``Trainer(..., infinity_config="ds_config.json")``; or it changes nothing and is launched by
``infinity deepspeed train.py --deepspeed ds.json`` (:mod:`infinity.deepspeed.hf_scripts`). Everything else
(``TrainingArguments``, datasets, collator, callbacks, ``compute_metrics``,
``train()``/``evaluate()``/``predict()``/``save_model()``, checkpoints and resuming) stays as it is. The
engine is built once, at construction, around the model (weights streamed into shards from the model's
own folder when it was built on the meta device). What the Trainer does is kept; only the model's
crossings with the optimizer are ours:

* the forward is the engine's (the model's own arguments and ``ModelOutput``), in training and in evaluation;
* backward and the step are the engine's: the Trainer's accumulation, loss scaling for accumulation and
  clipping (``max_grad_norm``) are honoured by the engine, and the logged ``grad_norm`` is the engine's;
* ``activation_checkpointing`` is the stock Trainer's: it asks the model to recompute its layers in backward, and
  the engine's hooks fetch a recomputed layer's parameters again and release them after its backward;
* weight decay is the stock Trainer's: ``weight_decay`` on the parameters ``get_decay_parameter_names`` names,
  none on biases and norms (the engine's param groups, :mod:`infinity.optim.param_groups`);
* the optimizer the Trainer steps is a stand-in (:class:`EngineOptimizer`) whose learning rate the
  Trainer's scheduler sets, and which hands it to the engine before each step: the Trainer's own, or the
  config's DeepSpeed ``scheduler`` block where it has one, as with the stock DeepSpeed integration;
* each training log gains the engine's step time and its tiers' traffic since the last log
  (:mod:`infinity.hf.trainer_logs`), and ``--log_level info`` shows the engine's placement;
* ``save_model()`` writes the Hugging Face layout tensor by tensor (a ``peft`` model: its adapters, as
  ``peft`` writes them); a checkpoint ``checkpoint-N/`` holds our sharded checkpoint (optimizer states
  included) beside the Trainer's own files, and ``resume_from_checkpoint`` restores both; a ``save_only_model``
  checkpoint gives its weights with a fresh optimizer, as the stock Trainer's does, and a stock Trainer's
  ``checkpoint-N/`` with torch's optimizer state goes on as the stock Trainer would go on with it: its weights,
  AdamW moments and step, schedule, step, data position and RNG (:mod:`infinity.hf.resume`);
* ``train()`` never writes over an earlier run's checkpoints in ``output_dir`` unless it resumes from them or
  ``overwrite_output_dir=True`` says to (:mod:`infinity.hf.output_dir`).

What the stock Trainer offers and the engine cannot honour is refused by name at construction
(:func:`refusals`). :class:`InfinityTrainerMixin` gives the same to any subclass of ``transformers.Trainer``
(TRL's trainers, a user's own): ``class MyTrainer(InfinityTrainerMixin, SFTTrainer)``.

``transformers`` (and ``accelerate``) are optional extras: this module is imported only through
``infinity.hf.Trainer``/``InfinityTrainerMixin``, which need them.
"""

from __future__ import annotations

import inspect
import logging
import os

import torch
import transformers  # optional extra: this module is reached only through infinity.hf's lazy names
from torch import nn

from infinity.checkpoint.recovery_script import write_recovery_script
from infinity.config.tier_names import Tier
from infinity.engine.engine import Engine, initialize
from infinity.hf.output_dir import overwrite_asked, refuse_earlier_checkpoints
from infinity.hf.resume import (check_stock_checkpoint, check_world_size, checkpoint_to_resume, load_adapters_only,
                                load_model_only, load_stock_optimizer, model_only, schedule_of_one_group,
                                stock_optimizer)
from infinity.hf.trainer_config import (ARGS_ATTRIBUTE, config_source, deepspeed_scheduler, trainer_config,
                                       weights_in_checkpoints)
from infinity.hf.trainer_logs import OffloadLog
from infinity.placement.split_choice import recomputes, step_shape_of
from infinity.weights.adapters import is_peft_model
from infinity.weights.export import generation_config_json
from infinity.weights.pretrained import streamed_from

logger = logging.getLogger(__name__)

SCHEDULER_NAME = "scheduler.pt"  # the Trainer's own file names
TRAINING_ARGS_NAME = "training_args.bin"
MIN_TRANSFORMERS_MAJOR = 5
"""The training loop whose hooks the Trainer takes over (checked against 5.24)."""
SAVED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes ``save_model`` writes a model in (the model's own; another is written in fp32)."""
ADAM_OPTIMS = ("adamw_torch", "adamw_torch_fused")
"""``TrainingArguments.optim`` values the engine's AdamW stands for (its CPU kernel or the device's fused AdamW)."""


def refusals(args, *, model_init, optimizers, optimizer_cls_and_kwargs) -> list[str]:
    """What the user asked the Trainer for that the engine cannot honour, each named with why."""
    out = []
    if getattr(args, "deepspeed", None):
        out.append("TrainingArguments(deepspeed=...): pass the same JSON as infinity_config= instead (the engine "
                   "reads DeepSpeed's config; DeepSpeed itself is not used)")
    if model_init is not None:
        out.append("model_init: the engine is built once around the model; pass model=")
    if optimizers is not None and any(o is not None for o in optimizers):
        out.append("optimizers=: the engine's own AdamW steps the shards; set learning_rate, weight_decay, "
                   "adam_beta1/2, adam_epsilon and lr_scheduler_type in TrainingArguments")
    if optimizer_cls_and_kwargs is not None:
        out.append("optimizer_cls_and_kwargs: the engine's own AdamW steps the shards")
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in ADAM_OPTIMS:
        out.append(f"optim={optim!r}: the engine steps with AdamW (optim one of {', '.join(ADAM_OPTIMS)})")
    checks = [
        ("fsdp", bool(args.fsdp), "the engine partitions the model itself"),
        ("torch_compile", args.torch_compile, "the engine's fetch hooks run eagerly"),
        ("auto_find_batch_size", args.auto_find_batch_size, "the engine is built once for one batch size"),
        ("use_liger_kernel", getattr(args, "use_liger_kernel", False), "it patches the model's modules"),
        ("fp16_full_eval", args.fp16_full_eval, "evaluation runs in the engine's compute precision"),
        ("bf16_full_eval", args.bf16_full_eval, "evaluation runs in the engine's compute precision"),
        ("n_gpu > 1 (DataParallel)", args.n_gpu > 1, "launch one process per GPU with torchrun"),
    ]
    out += [f"{name}: {why}" for name, on, why in checks if on]
    return out


def _engine_logs_as_the_trainers(args) -> None:
    """Where the script chose the Trainer's log level (``log_level``, ``log_level_replica``), the engine's loggers
    take it too, so ``--log_level info`` shows the placement, the host budget and the config's notes; they are
    printed where nothing else would print them. Left alone otherwise (``passive``)."""
    chosen = args.log_level if args.should_log else args.log_level_replica
    if chosen == "passive":
        return
    level = args.get_process_log_level()
    engine_logger = logging.getLogger("infinity")
    engine_logger.setLevel(level)
    if level < logging.WARNING and not engine_logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[infinity] %(message)s"))
        engine_logger.addHandler(handler)


def _weights_folder(model: nn.Module):
    """The folder to stream weights from when ``model`` was built on the meta device (None if it is real)."""
    if not any(p.is_meta for p in model.parameters()):
        return None
    folder = (streamed_from(model) or getattr(model, "name_or_path", None)
              or getattr(getattr(model, "config", None), "_name_or_path", None))
    if not folder or not os.path.isdir(folder):
        raise ValueError(f"the model's parameters are on the meta device and its name_or_path ({folder!r}) is not a "
                         f"local model folder to stream weights from; build it with "
                         f"AutoConfig.from_pretrained(folder) under torch.device('meta'), or pass a real model")
    return folder


def _saved_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the stock Trainer's ``save_model`` writes: the model's own as the script built it (a ``peft``
    model's: its adapters'), read before the engine casts the model to its compute precision; fp32 for an fp32 model
    trained with ``bf16=True``, bf16 for a model loaded in bf16."""
    params = [p for p in model.parameters() if p.is_floating_point()]
    if is_peft_model(model):
        params = [p for p in params if p.requires_grad] or params
    return params[0].dtype if params and params[0].dtype in SAVED_DTYPES else torch.float32


def _hidden_size(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    size = getattr(config, "hidden_size", None) if config is not None else None
    return size if isinstance(size, int) else None


class EngineModule(nn.Module):
    """The module the Trainer calls: the engine's forward (the model's own), ``train``/``eval`` and nothing to
    zero (the engine keeps the gradients in its own slices). The user's model stays ``trainer.model``."""

    def __init__(self, engine: Engine):
        super().__init__()
        self.engine = engine
        self.module = engine.module  # a submodule, so unwrapping and parameter counts reach the model

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def train(self, mode: bool = True) -> "EngineModule":
        self.training = mode
        self.engine.train(mode)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # the engine's step consumed its gradient slices

    def _get_name(self) -> str:
        return self.module._get_name()  # the Trainer asks the model's class name (e.g. for label smoothing)


class EngineOptimizer(torch.optim.Optimizer):
    """What the Trainer and its scheduler see as the optimizer: one parameter group whose ``lr`` the
    scheduler sets; ``step()`` hands it to the engine and steps the engine (a boundary's update)."""

    def __init__(self, engine: Engine, *, lr: float, weight_decay: float, offload_log: OffloadLog):
        # One empty placeholder: torch's Optimizer (and so the Trainer's LambdaLR) needs a parameter group.
        super().__init__([torch.zeros(0, requires_grad=True)], {"lr": lr, "weight_decay": weight_decay})
        self.engine = engine
        self.grad_norm_out: torch.Tensor | None = None
        self.offload_log = offload_log  # each step's traffic, for the Trainer's next log

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("the engine's optimizer step takes no closure")
        self.engine.lr = self.param_groups[0]["lr"]
        self.engine.step()
        self.offload_log.add_step(self.engine.step_metrics())
        norm = self.engine.get_global_grad_norm()
        if self.grad_norm_out is not None:  # the Trainer logs it after the step (see _clip_grad_norm)
            self.grad_norm_out.fill_(float("nan") if norm is None else norm)
            self.grad_norm_out = None
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def _by_keyword(init, args: tuple, kwargs: dict) -> dict:
    """The Trainer's constructor arguments, positional ones (``Trainer(model, args, ...)``) named as the next
    class in the bases takes them."""
    if not args:
        return kwargs
    signature = inspect.signature(init)
    named = {}
    for name, value in signature.bind_partial(*args, **kwargs).arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif signature.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL:
            raise ValueError(f"infinity.hf.Trainer: {len(value)} positional argument(s) more than the Trainer takes")
        else:
            named[name] = value
    return named


class InfinityTrainerMixin:
    """Put before ``transformers.Trainer`` (or a subclass) in the bases: its model runs under the engine.

    ``infinity_config=`` (keyword): a DeepSpeed-style dict, a JSON path or an ``InfinityConfig``
    (:mod:`infinity.hf.trainer_config`); without it, ``args.infinity_config``, which the arguments' ``deepspeed``
    value becomes under ``infinity deepspeed``. ``overwrite_output_dir=True`` (keyword): ``train()`` may write over
    an earlier run's checkpoints in ``output_dir`` (:mod:`infinity.hf.output_dir`). ``trainer.engine`` is the engine.
    """

    def __init__(self, *args, infinity_config=None, overwrite_output_dir: bool = False, **kwargs):
        if int(transformers.__version__.split(".")[0]) < MIN_TRANSFORMERS_MAJOR:
            raise ValueError(f"infinity.hf.Trainer needs transformers >= {MIN_TRANSFORMERS_MAJOR} (it takes over "
                             f"hooks of that training loop), found {transformers.__version__}: "
                             f"pip install -U 'transformers>={MIN_TRANSFORMERS_MAJOR}'")
        kwargs = _by_keyword(super().__init__, args, kwargs)
        targs = kwargs.get("args")
        if targs is None:
            raise ValueError("infinity.hf.Trainer needs args=TrainingArguments(...) (its output_dir, batch size, ...)")
        refused = refusals(targs, model_init=kwargs.get("model_init"), optimizers=kwargs.get("optimizers"),
                           optimizer_cls_and_kwargs=kwargs.get("optimizer_cls_and_kwargs"))
        if refused:
            raise ValueError("infinity.hf.Trainer cannot honour: " + "; ".join(refused))
        model = kwargs.get("model")
        if not isinstance(model, (nn.Module, str)):
            raise ValueError(f"infinity.hf.Trainer needs model= (a torch.nn.Module, or a model name that a subclass "
                             f"such as TRL's SFTTrainer loads), got {type(model).__name__}")
        if infinity_config is None:  # `infinity deepspeed train.py --deepspeed ds.json` (deepspeed.hf_scripts)
            infinity_config = getattr(targs, ARGS_ATTRIBUTE, None)
        # read once: its scheduler block is taken again when the run's length is known (create_scheduler)
        self._infinity_config = config_source(infinity_config)
        self._overwrite_output_dir = overwrite_asked(targs, overwrite_output_dir)
        super().__init__(**kwargs)
        # What the Trainer trains, as its __init__ left it: a subclass may load the model named (TRL's SFTTrainer
        # takes a name) or wrap the one given (with peft_config=, a peft model, whose adapters are what a save writes).
        model = self.model
        if not isinstance(model, nn.Module):
            raise ValueError(f"infinity.hf.Trainer needs model= (a torch.nn.Module), got {type(model).__name__}")
        weights = _weights_folder(model)
        self._saved_dtype = _saved_dtype(model)  # before the engine casts it to its compute precision
        self._weights_in_checkpoints = weights_in_checkpoints(self._infinity_config)
        _engine_logs_as_the_trainers(self.args)
        config = trainer_config(self._infinity_config, self.args, world_size=self.args.world_size,
                                hidden_size=_hidden_size(model))
        # the Trainer turns activation checkpointing on later, in train(): the split's step-time model hears it now
        asked = any(getattr(self.args, flag, False) for flag in ("activation_checkpointing", "gradient_checkpointing"))
        shape = step_shape_of(model, micro_batch=config.micro_batch_size or 1, recompute=asked or recomputes(model))
        self.engine = initialize(model, config, weights=weights, param_groups=self._decay_groups(model),
                                 step_shape=shape)
        self.offload_log = OffloadLog(nvme=Tier.NVME in (self.engine.compute.tier, self.engine.optimizer.tier),
                                      crossing=self.engine.placement.distinct)
        self._engine_module = EngineModule(self.engine)
        self.model_wrapped = self._engine_module

    def _decay_groups(self, model: nn.Module) -> list[dict]:
        """The stock ``create_optimizer``'s groups: ``weight_decay`` on the parameters ``get_decay_parameter_names``
        names, none on the others (biases, norms)."""
        decay, none = self._named_decay_groups(model)
        return [{"params": [p for _, p in decay], "weight_decay": self.args.weight_decay},
                {"params": [p for _, p in none], "weight_decay": 0.0}]

    def _named_decay_groups(self, model: nn.Module) -> list[list[tuple[str, nn.Parameter]]]:
        """The trainable parameters by name, in the stock ``create_optimizer``'s two groups and order: how torch's
        optimizer state in a stock checkpoint numbers them (:func:`~infinity.hf.resume.read_stock_optimizer`)."""
        decay = set(self.get_decay_parameter_names(model))
        trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        return [[(name, p) for name, p in trainable if name in decay],
                [(name, p) for name, p in trainable if name not in decay]]

    def train(self, resume_from_checkpoint=None, trial=None, *args, **kwargs):
        """The stock ``train``, refused before its first step where its saves would write over an earlier run's
        checkpoints in ``output_dir`` (:func:`~infinity.hf.output_dir.refuse_earlier_checkpoints`), or where it would
        resume from a stock Trainer's checkpoint that cannot go on here
        (:func:`~infinity.hf.resume.check_stock_checkpoint`), or from a peft model's checkpoint of another world
        size (:func:`~infinity.hf.resume.check_world_size`)."""
        resumed = checkpoint_to_resume(self.args, resume_from_checkpoint)
        check_world_size(resumed, self.engine.comm.world_size)
        check_stock_checkpoint(resumed, self.engine, self.model, self._named_decay_groups(self.model), self.args,
                               peft=is_peft_model(self.model))
        if trial is None:  # a hyperparameter search's trial saves into a folder of its own (run-<id>)
            refuse_earlier_checkpoints(self.args, resume_from_checkpoint, overwrite=self._overwrite_output_dir,
                                       comm=self.engine.comm)
        return super().train(resume_from_checkpoint, trial, *args, **kwargs)

    # -- the model and its optimizer -------------------------------------------------------
    def _move_model_to_device(self, model, device):
        pass  # the engine places every parameter's shard in its tier

    def _wrap_model(self, model, training=True, dataloader=None):
        return self._engine_module

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = EngineOptimizer(self.engine, lr=self.args.learning_rate,
                                             weight_decay=self.args.weight_decay, offload_log=self.offload_log)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The config's DeepSpeed ``scheduler`` block where it has one (as the stock DeepSpeed integration runs
        it), else the Trainer's own from ``lr_scheduler_type``."""
        if self.lr_scheduler is None:
            schedule = deepspeed_scheduler(self._infinity_config, self.args, num_training_steps)
            if schedule is not None:
                optimizer = optimizer if optimizer is not None else self.optimizer
                base_lr = optimizer.param_groups[0]["lr"]
                # LambdaLR gives step k base_lr x factor(k): the factor of DeepSpeed's lr for step k
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer, lambda step: schedule.lr_at(step, base_lr) / base_lr if base_lr else 0.0)
                self._created_lr_scheduler = True
                return self.lr_scheduler
        return super().create_scheduler(num_training_steps, optimizer)

    def log(self, logs: dict, *args, **kwargs) -> None:
        """A training log (it holds ``loss``) gains the engine's step time and traffic since the last one
        (:mod:`infinity.hf.trainer_logs`)."""
        if "loss" in logs:
            logs.update(self.offload_log.take())
        super().log(logs, *args, **kwargs)

    def _engine_optimizer(self) -> EngineOptimizer:
        return getattr(self.optimizer, "optimizer", self.optimizer)  # under accelerate's AcceleratedOptimizer

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The stock step's loss (its scaling for accumulation included), with the engine's backward and step."""
        engine = self.engine
        model.train()
        inputs = self._prepare_inputs(inputs)
        engine.lr = self._engine_optimizer().param_groups[0]["lr"]  # before the forward: a step may begin there
        # The Trainer says before each micro-batch whether it ends the step; an epoch's last accumulation may be
        # short, and its last micro-batch ends the step all the same (told before the forward, for the same reason).
        boundary = self.accelerator.gradient_state.sync_gradients
        engine.set_gradient_accumulation_boundary(boundary)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
                self.compute_loss_func is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        engine.backward(loss, scale_wrt_gas=False)  # scaled for accumulation above, as the stock Trainer does
        if boundary != engine.is_gradient_accumulation_boundary():
            raise RuntimeError(
                f"the Trainer's accumulation boundary (sync={boundary}) and the engine's (every "
                f"{engine.config.gradient_accumulation_steps} micro-batches) disagree")
        if not boundary:
            engine.step()  # between boundaries: the gradients accumulate in the engine's slices
        return loss.detach()

    def _clip_grad_norm(self, model):
        """The engine clips at its step (``gradient_clipping`` = ``max_grad_norm``); the norm it took is written
        into the returned tensor by the step, before the Trainer logs it."""
        out = torch.full((), float("nan"))
        self._engine_optimizer().grad_norm_out = out
        return out

    def _get_grad_norm(self, model, grad_norm=None):
        return self._clip_grad_norm(model) if grad_norm is None else grad_norm

    # -- saving and resuming ------------------------------------------------------------------
    def save_model(self, output_dir=None, _internal_call=False):
        """The model in the Hugging Face layout (a peft model: its adapters), in the model's own dtype as the stock
        Trainer writes it (:func:`_saved_dtype`), the tokenizer and the arguments.
        Inside a checkpoint the weights are in our sharded checkpoint, so only the small files are written
        (unless ``save_only_model``, or the config's ``stage3_gather_16bit_weights_on_model_save``), and a peft
        model's adapters."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        # A peft model's adapters are small, and a checkpoint holds them as the stock Trainer's does (what
        # PeftModel.from_pretrained(base, "checkpoint-N") loads).
        wrote_weights = (not _internal_call or self.args.save_only_model or is_peft_model(self.model)
                         or self._weights_in_checkpoints)
        if wrote_weights:
            # collective; rank 0 writes (a peft model: its adapters); one shard is model.safetensors, as the stock's
            self.engine.save_pretrained(output_dir, dtype=self._saved_dtype, one_file_unindexed=True)
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            config = getattr(self.model, "config", None)
            if _internal_call and config is not None and hasattr(config, "save_pretrained"):
                config.save_pretrained(output_dir)
                if not wrote_weights:  # the weights' writer adds it; the stock Trainer's checkpoint-N holds it
                    for name, text in generation_config_json(self.model).items():
                        with open(os.path.join(output_dir, name), "w", encoding="utf-8") as file:
                            file.write(text)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir):
        # collective: every rank writes its shards. A frozen base (LoRA) is left out: the script builds it again
        # from its weights to resume, and the checkpoint's fingerprint of it checks that it did
        self.engine.save_checkpoint(output_dir, exclude_frozen_parameters=True)
        self.engine.release_save_dir(output_dir)  # written once: no lock held for it until the engine closes
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            write_recovery_script(output_dir)  # as the stock DeepSpeed integration's checkpoint-N holds one

    def _load_weights_only(self, checkpoint) -> bool:
        """A ``save_only_model`` checkpoint's weights (a peft model's: its adapters) made the engine's, as the stock
        Trainer loads them (its optimizer fresh), or a stock Trainer's checkpoint's (its optimizer state follows in
        :meth:`_load_optimizer_and_scheduler`); False where ``checkpoint`` is neither."""
        peft = is_peft_model(self.model)
        if not (model_only(checkpoint, peft=peft) or stock_optimizer(checkpoint)):
            return False
        (load_adapters_only if peft else load_model_only)(self.engine, self.model, checkpoint)
        return True

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if not self._load_weights_only(resume_from_checkpoint):
            self.engine.load_checkpoint(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return  # the optimizer states came back with the engine's checkpoint
        stock = stock_optimizer(checkpoint)
        if stock:  # torch's AdamW state: its moments and step become the engine's
            groups = self._named_decay_groups(self.model)
            load_stock_optimizer(self.engine, checkpoint, groups, self.args)
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(path):
            self.lr_scheduler.load_state_dict(schedule_of_one_group(checkpoint, len(groups)) if stock
                                              else torch.load(path, weights_only=True))
            # A scheduler's state does not hold the optimizer's lr (the stock Trainer restores it with the
            # optimizer's state): the next step's lr is the one the scheduler last set.
            for group, lr in zip(self._engine_optimizer().param_groups, self.lr_scheduler.get_last_lr()):
                group["lr"] = lr

    def _load_best_model(self):
        best = self.state.best_model_checkpoint
        logger.info("loading the best model from %s (score: %s)", best, self.state.best_metric)
        if not self._load_weights_only(best):
            self.engine.load_checkpoint(best)



class Trainer(InfinityTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with the same constructor plus ``infinity_config=``; see the module's docstring."""


__all__ = ["Trainer", "InfinityTrainerMixin", "EngineModule", "EngineOptimizer", "refusals"]

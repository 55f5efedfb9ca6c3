"""The engine's verbs on the run's whole state between passes: parameters' full values (``whole_params``,
``gathered_parameters``), the full state dict, the Hugging Face export and checkpoints.

A mixin of :class:`~infinity.engine.engine.Engine`, which owns every part these verbs read (its shards, optimizer,
step cycle, tiers and collectives): they see the run through one seam, :meth:`shard_source`, made afresh for each
use (:mod:`infinity.checkpoint.shard_source`).
"""

from __future__ import annotations

import torch

from infinity.checkpoint import load_checkpoint, save_checkpoint
from infinity.checkpoint.save_dir_lock import release_save_dir
from infinity.checkpoint.shard_source import ShardSource
from infinity.checkpoint.state_dict import gather_full_state_dict
from infinity.engine.gathered import WholeParams
from infinity.engine.shards import EngineShards, ShardOwners
from infinity.weights.save_model import save_model


class StateVerbs:
    """``whole_params``, ``gathered_parameters``, ``full_state_dict``, ``save_pretrained``, ``save_checkpoint`` and
    ``load_checkpoint``: each is collective."""

    def whole_params(self) -> WholeParams:
        """Parameters' full values outside a forward: read, written, or whole in their ``.data`` for a block
        (:mod:`infinity.engine.gathered`). Every verb is collective."""
        self._ensure_open()
        if self.passes.running or self.backward_pending:
            raise RuntimeError("parameters cannot be gathered between a forward and its step(): call it before the "
                               "forward or after step()")
        return WholeParams(self.shard_source(), self._by_param, self.device)

    def gathered_parameters(self, params, modifier_rank: int | None = None):
        """A block in which each of ``params`` is whole in its ``.data``; on exit with a ``modifier_rank``, that
        rank's values are every rank's (DeepSpeed's ``zero.GatheredParameters``). Collective."""
        return self.whole_params().gathered(list(params), modifier_rank)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered in fp32 under its original name(s), plus buffers. Collective: all ranks call it."""
        return gather_full_state_dict(self.shard_source())

    def save_pretrained(self, out_dir, dtype="fp32", max_shard_nbytes: int | None = None, *,
                        one_file_unindexed: bool = False) -> dict:
        """Write the model in the Hugging Face layout (sharded safetensors, index, config.json), tensor by tensor.
        Collective: all ranks call it, rank 0 writes. See :mod:`infinity.weights.export`.

        A ``peft`` model writes its adapters, as ``peft_model.save_pretrained`` does (``adapter_config.json``,
        ``adapter_model.safetensors``; :func:`infinity.hf.merge.save_merged` writes the base with them merged).
        ``one_file_unindexed``: a model that fits one shard is ``model.safetensors`` without an index, as
        transformers' ``save_pretrained`` writes it."""
        self._ensure_open()
        # the values written are gathered from the shards; peft's own save_pretrained (rank 0, given them) still asks
        # each modules_to_save copy for its state_dict(), for the keys alone
        with self.model_state.keys_only():
            return save_model(self.shard_source(), self.module, out_dir, dtype=dtype,
                              max_shard_nbytes=max_shard_nbytes, one_file_unindexed=one_file_unindexed)

    # -- checkpoints ---------------------------------------------------------------
    def shard_source(self) -> ShardSource:
        """This rank's shards, buffers, counters and scalars as checkpoints, state dicts and exports see them
        (:mod:`infinity.checkpoint.shard_source`); made afresh for each use."""
        self.optimizer.land_tail()  # the last step's updates behind the forward write the shards it reads
        owners = ShardOwners(module=self.module, params=self.params, layout=self.layout, compute=self.compute,
                             optimizer=self.optimizer, tiers=self.tiers, comm=self.comm, config=self.config,
                             tiling_plan=self.tiling_plan, loss_scaler=self.loss_scaler, frozen=self.frozen)
        return EngineShards(owners, self)

    def save_checkpoint(self, save_dir, tag: str | None = None, client_state: dict | None = None,
                        exclude_frozen_parameters: bool = False) -> str:
        """Write this rank's shards and the run's state under ``save_dir/tag`` atomically; returns the tag.

        ``exclude_frozen_parameters`` (DeepSpeed's name): leave out the frozen parameters (a LoRA base); the
        checkpoint then loads into a run built from the same base at the same world size."""
        self._ensure_open()
        self._cancel_unused_overlap()
        tag = save_checkpoint(self.shard_source(), save_dir, tag=tag, client_state=client_state,
                              exclude_frozen_parameters=exclude_frozen_parameters)
        self._save_dirs.add(str(save_dir))  # rank 0 holds it now (one live run saves there), until close()
        return tag

    def release_save_dir(self, save_dir) -> None:
        """Let another live run save into ``save_dir`` from now on: its lock, which this run's first save there took
        (held until close() otherwise), is released; a later save there takes it again. For a folder written once,
        as the Trainer's ``checkpoint-N``: a long run would otherwise hold one lock (a file, a descriptor) for each
        checkpoint it ever wrote."""
        self._save_dirs.discard(str(save_dir))
        release_save_dir(save_dir)

    def load_checkpoint(self, load_dir, tag: str | None = None, *, optimizer_states: bool = True,
                        counters: bool = True) -> dict:
        """Restore a checkpoint written by :meth:`save_checkpoint`; returns its ``client_state``.
        ``optimizer_states=False``: the model's values alone (the run's moments and optimizer step stay);
        ``counters=False``: the run's step counters and RNG states stay too."""
        self._ensure_open()
        self._cancel_unused_overlap()
        self.optimizer.drop_tail()  # what the last step's updates behind the forward left is replaced (or failed)
        client_state = load_checkpoint(self.shard_source(), load_dir, tag=tag, optimizer_states=optimizer_states,
                                       counters=counters)
        self.cycle.loaded_checkpoint()
        self._apply_lr_schedule()
        return client_state

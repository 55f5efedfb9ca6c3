"""``infinity consolidate --hf`` of a checkpoint saved without its frozen base (an ``infinity train --lora-rank``
run's): its adapters written in ``peft``'s layout, which ``PeftModel.from_pretrained`` loads over the base.

Such a checkpoint holds the trainable parameters' fp32 masters and records the model's ``config.json``
(``hf_config``) and the adapters' ``adapter_config.json`` (``peft_config``). The base model is built on the meta
device from the one, wrapped by ``peft.get_peft_model`` with the other, and ``peft``'s own ``save_pretrained``
writes the masters under that model's names, as the run's ``--save-pretrained`` would have at that step. Nothing
of the base is read or needed.
"""

from __future__ import annotations

import torch

from infinity.checkpoint import CheckpointError
from infinity.checkpoint.publish import resolve_checkpoint
from infinity.checkpoint.reader import Checkpoint
from infinity.hf.peft_models import require_peft, wrap_with_peft
from infinity.weights.export import causal_lm_on_meta, problems_said, save_dtype


def records_adapters(meta: dict) -> bool:
    """The checkpoint (its ``meta``) left out its frozen base and recorded the adapters' config."""
    return bool(meta.get("frozen_excluded")) and "peft_config" in (meta.get("client_state") or {})


def checkpoint_records_adapters(checkpoint, tag: str | None = None) -> bool:
    """:func:`records_adapters` of the checkpoint at ``checkpoint`` (a save folder's ``latest``, or ``tag``)."""
    ckpt = Checkpoint(resolve_checkpoint(checkpoint, tag))
    try:
        return records_adapters(ckpt.meta)
    finally:
        ckpt.close()


def consolidate_adapters(checkpoint, out_dir, *, dtype: str = "fp32", tag: str | None = None,
                         verify: bool = True) -> dict:
    """The adapters of a checkpoint that :func:`records_adapters`, written by ``peft`` into ``out_dir`` in
    ``dtype``; a summary (``path``, ``tensors``, ``nbytes``, ``checkpoint``, ``global_step``, ``world_size``)."""
    out_dtype = save_dtype(dtype)
    ckpt = Checkpoint(resolve_checkpoint(checkpoint, tag))
    try:
        client_state = ckpt.meta.get("client_state") or {}
        if not records_adapters(ckpt.meta) or client_state.get("hf_config") is None:
            raise CheckpointError(f"checkpoint {ckpt.path} does not record its adapters' config and its model's "
                                  f"(infinity train --lora-rank records both)")
        peft_model = _peft_model_on_meta(client_state["hf_config"], client_state["peft_config"], source=str(ckpt.path))
        expected = {name: tuple(p.shape) for name, p in peft_model.named_parameters() if p.requires_grad}
        trained = [p for p in ckpt.meta["params"] if p["trainable"]]
        _check_names({name: tuple(p["shape"]) for p in trained for name in p["names"]}, expected, ckpt.path)
        if verify:
            ckpt.verify()
        state = {}
        for p in trained:
            master = torch.empty(p["numel"], dtype=torch.float32)
            ckpt.read_range("master", p, 0, master)
            value = master.view(p["shape"]).to(out_dtype)
            for name in p["names"]:
                state[name] = value
        peft_model.save_pretrained(str(out_dir), state_dict=state)
    finally:
        ckpt.close()
    return {"path": str(out_dir), "tensors": len(state), "nbytes": sum(v.numel() * v.element_size()
                                                                      for v in state.values()),
            "checkpoint": str(ckpt.path), "global_step": ckpt.meta["global_step"], "world_size": ckpt.world_size}


def _peft_model_on_meta(hf_config: dict, peft_config: dict, *, source: str) -> torch.nn.Module:
    peft = require_peft("writing a LoRA checkpoint's adapters")
    model = causal_lm_on_meta(hf_config, source=f"the config recorded in {source}")
    try:
        return wrap_with_peft(model, peft.PeftConfig.from_peft_type(**peft_config), needed_for="consolidate")
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"the adapters' config recorded in {source} does not build a peft model: {err}") from None


def _check_names(saved: dict, expected: dict, path) -> None:
    """The checkpoint's trainable parameters (``saved``: name -> shape) are the recorded adapters', by name and
    shape; else nothing is read or written and the first few differences are named."""
    differ = [f"{n}: {list(shape)} here, {list(expected[n])} in the recorded config"
              for n, shape in saved.items() if n in expected and shape != expected[n]]
    extra = [n for n in saved if n not in expected]
    missing = [n for n in expected if n not in saved]
    said = problems_said((("shapes differ", differ), ("not adapters of the recorded config", extra),
                          ("missing", missing)))
    if said:
        raise CheckpointError(f"checkpoint {path} does not hold the adapters its recorded config describes: {said}; "
                              f"nothing was written")

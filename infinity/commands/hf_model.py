"""The Hugging Face parts of ``infinity train --hf-model DIR ... --save-pretrained OUT``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from infinity.hf.pretrained import require_transformers
from infinity.train.hf_data import TOKENIZER_SIDE_FILES, check_tokenizer_files
from infinity.weights.pretrained import PretrainedWeights


def read_hf_model_config(model_dir: str, *, weights: bool = True) -> dict:
    """What the plan needs from ``DIR/config.json`` (checked before any work): vocab, context, hidden size. With
    ``weights`` the folder's weights and tokenizer files are checked too (``infinity estimate`` needs only the
    config)."""
    folder = Path(model_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"--hf-model folder {model_dir!r} does not exist")
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"--hf-model folder {model_dir!r} has no config.json") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not JSON: {err}") from None
    fields = _config_fields(raw, path)
    require_transformers("--hf-model")
    if weights:
        PretrainedWeights.open(folder).close()  # the weights are there and readable, before any work
        check_tokenizer_files(folder)
    return fields


def read_model_config_file(path: str) -> dict:
    """What the plan needs from ``--model CONFIG.json`` (a transformers config), as :func:`read_hf_model_config`
    reads a folder's: vocab, context, hidden size."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"model file {path!r} is not JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"model file {path!r} must hold a transformers config (a JSON object)")
    return _config_fields(raw, path)


def _config_fields(raw: dict, path) -> dict:
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    missing = [k for k in ("vocab_size",) if not isinstance(text.get(k), int)]
    if missing:
        raise ValueError(f"{path}: no integer {missing[0]!r}; is this a causal language model's config?")
    seq = text.get("max_position_embeddings") or text.get("n_positions") or text.get("n_ctx") or 256
    hidden = text.get("hidden_size") or text.get("n_embd") or text.get("d_model")
    return {"vocab_size": text["vocab_size"], "max_position_embeddings": int(seq),
            "hidden_size": int(hidden) if isinstance(hidden, int) else None}


def save_pretrained_with_tokenizer(engine, out_dir: str, *, dtype: str, source: str | None) -> str:
    """``engine.save_pretrained(out_dir)`` plus the source folder's tokenizer files; returns the line to print."""

    summary = engine.save_pretrained(out_dir, dtype=dtype)
    if engine.rank != 0:
        return ""
    copied = copy_tokenizer_files(source, out_dir)
    return (f"saved {summary['tensors']} tensors ({summary['nbytes'] / 2**20:,.1f} MiB {dtype}, {summary['files']} "
            f"file(s)) to {out_dir} in the Hugging Face layout" + (f", with {', '.join(copied)}" if copied else ""))


def copy_tokenizer_files(source: str | None, out_dir: str) -> list[str]:
    """The tokenizer's files of the model folder ``source`` copied into ``out_dir``; their names."""
    copied = []
    if source is not None:
        for name in TOKENIZER_SIDE_FILES:
            if (Path(source) / name).is_file():
                shutil.copyfile(Path(source) / name, Path(out_dir) / name)
                copied.append(name)
    return copied

"""Writing a model in the Hugging Face layout, one tensor at a time.

    out_dir/model-00001-of-00002.safetensors   tensors, each file at most ``max_shard_nbytes``
    out_dir/model-00002-of-00002.safetensors
    out_dir/model.safetensors.index.json       {"metadata": {"total_size": ...}, "weight_map": {name: file}}
    out_dir/config.json                        the model's ``transformers`` config (when it has one)

``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it. Every file's
header is written first and the tensors streamed after it (the writer of
:mod:`infinity.checkpoint.safetensors_io`), so memory holds one tensor at a time. Tied
parameters are written once, under their first name, as ``transformers`` does.

The files are written into a temporary sibling folder and moved into
``out_dir`` only when all are complete, so an interrupted save never leaves an
index naming a file that is not whole. Over an existing folder, the new one
takes the old one's other files (a tokenizer, a README: hard links, not
copies) and replaces it whole: no shard of the old model is left beside the
new ones, and nothing is removed before the new files are complete.

:func:`save_pretrained` (``engine.save_pretrained``) gathers each parameter
from the ranks' shards; ``infinity consolidate --hf`` does the same from a
checkpoint (:func:`write_hf_folder` with the outputs of consolidation).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
import logging
import os
import shutil
import stat
from pathlib import Path
from typing import Callable

import torch

from infinity.checkpoint.consolidation import consolidated_outputs, progress_bar
from infinity.checkpoint.publish import TMP_PREFIX, fsync_dir, resolve_checkpoint
from infinity.checkpoint.reader import Checkpoint
from infinity.checkpoint.safetensors_io import SafetensorsWriter
from infinity.checkpoint.shard_source import ShardSource, require_step_boundary
from infinity.checkpoint.state_dict import FullParamGatherer

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FORMATS = {"safetensors": ("model", ".safetensors", INDEX_FILE),
                   "bin": ("pytorch_model", ".bin", "pytorch_model.bin.index.json")}
"""A folder's weight files by format: their stem, suffix and index file, as transformers names them."""
SAVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DEFAULT_MAX_SHARD_NBYTES = 5 * 10**9
LEGACY_WRAPPER_PREFIX = "inner."
"""Checkpoints of ``--hf-model`` runs from before the model was trained unwrapped name its tensors behind this."""

MODEL_FILE_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "*.bin.index.json",
                       "config.json", "generation_config.json", "*.pt", "*.pth", "*.gguf", "tf_model.h5",
                       "flax_model.msgpack")
"""The files that make a folder a model's (its weights, their index, its configs): replaced whole by a save."""
_OLD_INFIX = ".old-"


def is_model_file(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in MODEL_FILE_PATTERNS)


def model_files(folder) -> list[str]:
    """The names of the model files (``MODEL_FILE_PATTERNS``) in ``folder``, sorted; [] when it is not a folder."""
    try:
        return sorted(e.name for e in os.scandir(folder) if e.is_file() and is_model_file(e.name))
    except (FileNotFoundError, NotADirectoryError):
        return []


@dataclasses.dataclass
class HFTensor:
    """One tensor of the output: its name, shape and dtype, and how to fill it (called once, in file order)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: Callable[[torch.Tensor], None]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def save_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in _HF_DTYPE_NAMES:
        return dtype
    if dtype in SAVE_DTYPES:
        return SAVE_DTYPES[dtype]
    raise ValueError(f"dtype must be one of {sorted(SAVE_DTYPES)} (or the torch dtype), got {dtype!r}")


def _replaced_folder(out_dir: Path) -> Path:
    """The folder a write of ``out_dir`` replaces: the one a link names (its temporary folder is made beside it)."""
    return Path(os.path.realpath(out_dir)) if out_dir.is_symlink() else out_dir


def remove_own_partial_folder(out_dir) -> list[Path]:
    """The temporary folders this process was writing beside ``out_dir`` (:func:`write_hf_folder`'s), removed: a
    write this process stops part-way. Returns the paths removed."""
    out_dir = _replaced_folder(Path(out_dir))
    partial = list(out_dir.parent.glob(f".{out_dir.name}{TMP_PREFIX}{os.getpid()}-*"))
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return partial


def write_hf_folder(out_dir, tensors: list[HFTensor], *, config: dict | None = None,
                    extra_files: dict[str, str] | None = None,
                    max_shard_nbytes: int = DEFAULT_MAX_SHARD_NBYTES, write: bool = True,
                    weights_format: str = "safetensors", one_file_unindexed: bool = False) -> dict:
    """Write ``tensors`` (in order) as sharded safetensors + index (+ ``config.json``) into ``out_dir``.

    With ``write=False`` every ``fill`` is still called, in the same order, and
    nothing is written (ranks other than 0 take part in the gathers this way).
    ``weights_format="bin"``: ``torch.save`` shards (``pytorch_model-00001-of-00002.bin``) and their index, as
    transformers writes without ``safe_serialization``; each shard is held whole while it is written.
    ``one_file_unindexed``: what fits one shard is written as ``model.safetensors`` (``pytorch_model.bin``) without
    an index, as transformers writes it.
    """
    if weights_format not in WEIGHTS_FORMATS:
        raise ValueError(f"weights_format must be one of {', '.join(WEIGHTS_FORMATS)}, got {weights_format!r}")
    if max_shard_nbytes <= 0:
        raise ValueError(f"max_shard_nbytes must be positive, got {max_shard_nbytes}")
    files: list[list[HFTensor]] = [[]]
    size = 0
    for t in tensors:
        if files[-1] and size + t.nbytes > max_shard_nbytes:
            files.append([])
            size = 0
        files[-1].append(t)
        size += t.nbytes
    if not write:
        for t in tensors:
            value = torch.empty(t.shape, dtype=t.dtype)
            t.fill(value)
        return {}
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"save_pretrained: {out_dir} exists and is not a folder")
    out_dir = _replaced_folder(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}{TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
    tmp.mkdir()
    stem, suffix, index_file = WEIGHTS_FORMATS[weights_format]
    names = [f"{stem}-{i + 1:05d}-of-{len(files):05d}{suffix}" for i in range(len(files))]
    indexed = not (one_file_unindexed and len(files) == 1)
    if not indexed:
        names = [f"{stem}{suffix}"]
    weight_map: dict[str, str] = {}
    largest = total = 0
    bar = progress_bar(sum(t.nbytes for t in tensors))
    try:
        for name, group in zip(names, files):
            entries = [(t.name, t.dtype, tuple(t.shape)) for t in group]
            shard: dict[str, torch.Tensor] = {}  # "bin": the file's tensors, saved together
            with contextlib.ExitStack() as stack:
                writer = None
                if weights_format == "safetensors":
                    writer = stack.enter_context(SafetensorsWriter(tmp / name, entries, {"format": "pt"}))
                for t in group:
                    value = torch.empty(t.shape, dtype=t.dtype)
                    t.fill(value)
                    if writer is not None:
                        writer.write(t.name, value)
                    else:
                        shard[t.name] = value
                    largest = max(largest, t.nbytes)
                    total += t.nbytes
                    weight_map[t.name] = name
                    bar.update(t.nbytes)
                    del value
                if writer is not None:
                    writer.close()
                else:
                    _save_synced(shard, tmp / name)
                    shard.clear()
        if indexed:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / index_file).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        if config is not None:
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for fname, text in (extra_files or {}).items():
            (tmp / fname).write_text(text)
        fsync_dir(tmp)
        _publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    logger.info("wrote %s: %d tensors in %d file(s), %.1f MiB", out_dir, len(tensors), len(files), total / 2**20)
    return {"path": str(out_dir), "tensors": len(tensors), "files": len(files), "nbytes": total,
            "largest_tensor_nbytes": largest}


def _save_synced(tensors: dict[str, torch.Tensor], path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(tensors, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the folder is published


def _publish(tmp: Path, out_dir: Path) -> None:
    """Move the complete folder ``tmp`` into place. A new ``out_dir``: one rename. An existing one: ``tmp`` takes
    its files that are not a model's (hard links), then the two are swapped by two renames and the old one removed;
    a crash between the renames leaves both folders whole. Where ``out_dir`` cannot be renamed (a mount point), the
    new files are moved in one by one, the index last, and only then the old model files they do not replace."""
    if not out_dir.exists():
        os.rename(tmp, out_dir)
        fsync_dir(out_dir.parent)
        return
    new_names = {e.name for e in tmp.iterdir()}
    carried = []
    for entry in out_dir.iterdir():
        if entry.name not in new_names and not is_model_file(entry.name):
            _link_tree(entry, tmp / entry.name)
            carried.append(tmp / entry.name)
    os.chmod(tmp, stat.S_IMODE(out_dir.stat().st_mode))
    fsync_dir(tmp)
    old = out_dir.parent / f".{out_dir.name}{_OLD_INFIX}{os.getpid()}-{os.urandom(4).hex()}"
    try:
        os.rename(out_dir, old)
    except OSError as err:
        logger.debug("cannot rename %s (%s): replacing its files in place", out_dir, err)
        for entry in carried:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        _publish_in_place(tmp, out_dir, new_names)
        return
    os.rename(tmp, out_dir)
    fsync_dir(out_dir.parent)
    shutil.rmtree(old, ignore_errors=True)


def _publish_in_place(tmp: Path, out_dir: Path, new_names: set[str]) -> None:
    (out_dir / INDEX_FILE).unlink(missing_ok=True)  # never an index naming files that are being replaced
    for entry in sorted(tmp.iterdir(), key=lambda p: p.name == INDEX_FILE):
        os.replace(entry, out_dir / entry.name)
    fsync_dir(out_dir)
    tmp.rmdir()
    for name in model_files(out_dir):  # the old model's files the new ones did not replace: stale shards
        if name not in new_names:
            (out_dir / name).unlink(missing_ok=True)
    fsync_dir(out_dir)


def _link_tree(src: Path, dst: Path) -> None:
    """``src`` at ``dst`` too, by hard links (a copy where a link cannot be made); a folder with its tree."""
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(src, dst)


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def hf_config_of(model: torch.nn.Module, dtype: torch.dtype) -> dict | None:
    """The ``transformers`` config of ``model`` (or of the model it wraps) as JSON, its dtype set to ``dtype``."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and callable(getattr(config, "to_dict", None)) and hasattr(config, "model_type"):
            out = json.loads(config.to_json_string(use_diff=False))  # JSON as transformers writes it (str keys)
            out["dtype"] = _HF_DTYPE_NAMES[dtype]
            if "torch_dtype" in out:
                out["torch_dtype"] = _HF_DTYPE_NAMES[dtype]
            return out
    return None


def generation_config_json(model: torch.nn.Module) -> dict[str, str]:
    """``{"generation_config.json": text}`` when a module of ``model`` has a generation config, else ``{}``."""
    generation = next((getattr(m, "generation_config", None) for m in model.modules()
                       if getattr(m, "generation_config", None) is not None), None)
    if generation is not None and callable(getattr(generation, "to_json_string", None)):
        return {"generation_config.json": generation.to_json_string()}
    return {}


def save_pretrained(source: ShardSource, model: torch.nn.Module, out_dir, *, dtype="fp32",
                    max_shard_nbytes: int = DEFAULT_MAX_SHARD_NBYTES, one_file_unindexed: bool = False) -> dict:
    """Write the run's ``model`` in the Hugging Face layout; every rank calls it, rank 0 writes.

    Trainable parameters are their fp32 masters (cast to ``dtype``), frozen
    ones their compute shards; each is gathered from the ranks' shards and
    written before the next, so memory holds one sub-group of masters and one
    full tensor at a time. ``model`` gives the Hugging Face config and the
    names' prefix. ``one_file_unindexed``: a model that fits one shard is
    ``model.safetensors`` without an index, as transformers writes it.
    """
    require_step_boundary(source, "save_pretrained")
    out_dtype = save_dtype(dtype)
    if source.tiling_plan is not None and not source.tiling_plan.is_empty:
        raise ValueError("save_pretrained with tiling is not supported yet; use save_checkpoint + infinity consolidate")
    prefix = getattr(model, "weights_prefix", "")
    strip = (lambda n: n[len(prefix):] if prefix and n.startswith(prefix) else n)
    gatherer = FullParamGatherer(source)
    tensors = [HFTensor(strip(param.name), param.shape, out_dtype,
                        lambda out, p=param: out.copy_(gatherer.gather(p)))
               for param in source.params]
    for buf in source.buffers():
        if not buf.persistent:
            continue
        kind = out_dtype if buf.tensor.is_floating_point() else buf.tensor.dtype
        tensors.append(HFTensor(strip(buf.name), tuple(buf.tensor.shape), kind,
                                lambda out, b=buf.tensor: out.copy_(b.detach().cpu())))
    config = hf_config_of(model, out_dtype)
    extra = generation_config_json(model)
    try:
        return write_hf_folder(out_dir, tensors, config=config, extra_files=extra, max_shard_nbytes=max_shard_nbytes,
                               write=source.comm.rank == 0, one_file_unindexed=one_file_unindexed)
    finally:
        gatherer.close()


def causal_lm_on_meta(config: dict, *, source: str) -> torch.nn.Module:
    """The causal LM a ``config.json`` describes, built on the meta device (no memory); ``ValueError`` naming
    ``source`` where transformers is missing or cannot build it."""
    try:  # (transformers is an optional extra: needed for --hf, checked for by the caller's path)
        import transformers
    except ImportError:
        raise ValueError("--hf needs the transformers package: pip install 'zero-infinity[hf]'") from None
    fields = {k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")}
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise ValueError(f"{source}: config.json has no 'model_type'; is it a Hugging Face model's config?")
    try:
        hf_config = transformers.AutoConfig.for_model(model_type, **fields)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{source}: cannot build a causal LM from its config.json: {err}") from None


def problems_said(problems, *, shown: int = 3) -> str:
    """``(what, items)`` pairs as one line naming the first ``shown`` items of each kind that has any; "" for none."""
    return "; ".join(f"{what} ({len(items)}): {', '.join(items[:shown])}" + (", ..." if len(items) > shown else "")
                     for what, items in problems if items)


def check_tensors_fit_config(tensors: list[HFTensor], config: dict, *, source: str, shown: int = 3) -> None:
    """Every tensor's name and shape against the model ``config`` (a ``config.json``) describes, before anything is
    written: that model is built on the meta device (no memory) and its state dict compared. A tensor the model
    does not take, a parameter or persistent buffer with no tensor (a tied one is covered by its twin), or a shape
    that differs is a ``ValueError`` naming the first few and ``source``."""
    model = causal_lm_on_meta(config, source=source)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    twins: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        twins.setdefault(id(param), []).append(name)
    written = {t.name: tuple(t.shape) for t in tensors}
    covered = set(written)
    for names in twins.values():  # a tied parameter is written under one of its names
        if covered.intersection(names):
            covered.update(names)
    unexpected = [f"{n} {list(shape)}" for n, shape in written.items() if n not in expected]
    missing = [f"{n} {list(shape)}" for n, shape in expected.items() if n not in covered]
    mismatched = [f"{n}: {list(written[n])} here, {list(shape)} in the config's model"  # in the model's order
                  for n, shape in expected.items() if n in written and written[n] != shape]
    said = problems_said((("shapes differ", mismatched), ("tensors the config's model does not take", unexpected),
                          ("the config's model has no tensor here for", missing)), shown=shown)
    if said:
        raise ValueError(f"the checkpoint does not fit {source} ({config.get('model_type')}): {said}; nothing was "
                         f"written. Give --hf-config the model folder the run started from")


def consolidate_hf(checkpoint, out_dir, *, dtype: str = "fp32", tag: str | None = None, verify: bool = True,
                   config_dir=None, max_shard_nbytes: int = DEFAULT_MAX_SHARD_NBYTES) -> dict:
    """``infinity consolidate --hf``: a sharded checkpoint written in the Hugging Face layout.

    ``config.json`` comes from ``config_dir`` (the model folder the run started
    from) or, when the run recorded it (``infinity train --hf-model`` does), from
    the checkpoint's ``client_state["hf_config"]``. Names lose the wrapper's
    prefix (``inner.``) that runs of earlier versions recorded.
    """

    out_dtype = save_dtype(dtype)
    ckpt = Checkpoint(resolve_checkpoint(checkpoint, tag))
    try:
        config = None
        if config_dir is not None:
            path = Path(config_dir) / "config.json" if Path(config_dir).is_dir() else Path(config_dir)
            try:
                config = json.loads(path.read_text())
            except FileNotFoundError:
                raise FileNotFoundError(f"--hf-config: {path} does not exist") from None
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ValueError(f"--hf-config: {path} is not JSON: {err}") from None
        else:
            config = (ckpt.meta.get("client_state") or {}).get("hf_config")
        if config is None:  # (`infinity train` records it for every Hugging Face model: hf_config_of)
            raise ValueError(f"checkpoint {ckpt.path} records no Hugging Face config: its model is not a Hugging Face "
                             f"transformers model (a --preset's or a --model file's), so it has no Hugging Face "
                             f"layout; write it as one safetensors file under its own names, without --hf: "
                             f"`infinity consolidate {checkpoint} OUT.safetensors`. (A Hugging Face model saved "
                             f"without the record: pass --hf-config DIR, the model folder the run started from)")
        config = dict(config, dtype=_HF_DTYPE_NAMES[out_dtype])
        if verify:
            ckpt.verify()
        outputs = consolidated_outputs(ckpt, out_dtype)
        prefix = LEGACY_WRAPPER_PREFIX
        strip = all(name.startswith(prefix) for o in outputs for name in o.names)
        tensors = [HFTensor(o.names[0][len(prefix):] if strip else o.names[0], tuple(o.shape), o.dtype, o.fill)
                   for o in outputs]
        check_tensors_fit_config(tensors, config, source="--hf-config " + str(config_dir) if config_dir is not None
                                 else f"the config recorded in {ckpt.path}")
        summary = write_hf_folder(out_dir, tensors, config=config, max_shard_nbytes=max_shard_nbytes)
    finally:
        ckpt.close()
    return dict(summary, checkpoint=str(ckpt.path), global_step=ckpt.meta["global_step"], world_size=ckpt.world_size,
                dtype=dtype)

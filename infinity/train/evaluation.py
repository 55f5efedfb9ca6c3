"""Validation loss and text samples from a model being trained, run through its engine without gradients.

Both go through ``engine(...)`` under ``torch.no_grad()``: parameters are
fetched from their tiers module by module and released after use, exactly as
in training, so nothing is materialized whole and the model can be as large as
training allows. Every rank must call them together (the fetches are
collective).

The held-out bytes are either a separate corpus (``--val-data``) or the last
``val_fraction`` of the training corpus, carved off before training starts, so
the model never trains on them. Validation uses the same micro-batches every
time it runs, so the curve compares like with like.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from infinity.models.transformers_lm import causal_lm_loss
from infinity.train.data import ByteCorpus, read_corpus_bytes

__all__ = ["HeldOut", "Validation", "carve_held_out", "sample_text"]

logger = logging.getLogger(__name__)

DEFAULT_VAL_FRACTION = 0.05


@dataclass(frozen=True)
class HeldOut:
    """The training bytes and the validation bytes, each with a one-line description."""

    train: bytes
    """What the model trains on."""
    train_description: str
    """Where the training bytes came from, for the start of the run."""
    val: bytes
    """What validation loss is measured on; never trained on."""
    val_description: str
    """Where the validation bytes came from."""


def carve_held_out(path: str | Path | None, *, max_bytes: int | None, seq_len: int,
                   val_path: str | Path | None = None, val_fraction: float = DEFAULT_VAL_FRACTION) -> HeldOut:
    """The corpus at ``path`` and its validation bytes: those of ``val_path``, or else the last ``val_fraction``.

    ``ValueError`` naming the flag when either part is shorter than one window of ``seq_len + 1`` bytes.
    """
    data, description = read_corpus_bytes(path, max_bytes=max_bytes)
    if val_path is not None:
        val, val_description = read_corpus_bytes(val_path, max_bytes=max_bytes)
        if len(val) < seq_len + 1:
            raise ValueError(f"--val-data {str(val_path)!r} holds {len(val)} bytes, fewer than seq_len + 1 = {seq_len + 1}")
        return HeldOut(data, description, val, val_description)
    n_val = held_out_tail(len(data), val_fraction, seq_len=seq_len, unit="bytes")
    return HeldOut(data[: len(data) - n_val], f"{description} (last {n_val:,} bytes held out)",
                   data[len(data) - n_val:], f"the last {val_fraction:.0%} of the corpus, {n_val:,} bytes")


def held_out_tail(n: int, val_fraction: float, *, seq_len: int, unit: str) -> int:
    """How many of a corpus' last ``n`` ids (``unit``: bytes or tokens) ``--val-fraction`` holds out; ``ValueError``
    naming the flag where it is not a fraction, or where either part is shorter than one window of ``seq_len + 1``."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be between 0 and 1, got {val_fraction}")
    n_val = int(n * val_fraction)
    if n_val < seq_len + 1 or n - n_val < seq_len + 1:
        raise ValueError(f"--val-fraction {val_fraction} of the corpus' {n:,} {unit} leaves {n_val:,} {unit} for "
                         f"validation and {n - n_val:,} for training; each needs at least seq_len + 1 = {seq_len + 1} "
                         "(give --val-data, a larger corpus or a larger --val-fraction)")
    return n_val


class Validation:
    """``batches`` fixed micro-batches of held-out bytes for this rank; ``loss(engine)`` is their mean loss."""

    def __init__(self, data: bytes | ByteCorpus, *, batches: int, seq_len: int, micro_batch: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1):
        """``data``: the held-out bytes, or a corpus of them already made (token ids: ``TokenCorpus``)."""
        if batches <= 0:
            raise ValueError(f"--eval-batches must be positive, got {batches}")
        corpus = data if isinstance(data, ByteCorpus) else ByteCorpus(
            data=data, seq_len=seq_len, micro_batch=micro_batch, seed=seed, rank=rank, world_size=world_size)
        self.batches = [corpus.next_batch() for _ in range(batches)]
        self.world_size = world_size

    def loss(self, engine) -> float:
        """Mean loss over the micro-batches (and the ranks), forward only, in eval mode; training mode restored."""
        was_training = engine.module.training
        engine.eval()
        total = 0.0
        try:
            with torch.no_grad():
                for input_ids, targets in self.batches:
                    total += float(_loss_of(causal_lm_loss(engine, input_ids, targets)))
        finally:
            engine.train(was_training)
        mean = total / len(self.batches)
        if self.world_size > 1:
            import torch.distributed as dist

            t = torch.tensor([mean], dtype=torch.float64)
            dist.all_reduce(t)
            mean = float(t) / self.world_size
        return mean


def _loss_of(output) -> torch.Tensor:
    loss = getattr(output, "loss", output)  # a Hugging Face model returns an output object
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"the model's forward(input_ids, targets) must return the scalar loss, got {type(output).__name__}")
    return loss.detach()


class ByteCodec:
    """Text as the byte models read it: UTF-8 bytes are the ids; a larger vocabulary's extra ids are not text."""

    max_id = 255

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def sample_text(engine, prompt: str, *, max_new_tokens: int, seq_len: int, temperature: float = 0.0,
                seed: int = 0, codec=None) -> str:
    """The continuation of ``prompt``: ``max_new_tokens`` ids from the model: greedy at ``temperature`` 0, else sampled.

    ``codec`` turns text into ids and back (``encode``, ``decode``, ``max_id``): bytes by default (:class:`ByteCodec`),
    a model folder's tokenizer for ``--hf-model`` (:class:`infinity.train.hf_data.TokenizerCodec`). One forward
    through the engine per new id, over the last ``seq_len`` ids. Every rank computes the same logits and draws
    from a generator seeded alike, so every rank picks the same ids.
    """
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {temperature}")
    codec = codec or ByteCodec()
    ids = codec.encode(prompt) or codec.encode("\n") or [0]
    start = len(ids)
    generator = torch.Generator().manual_seed(seed)
    was_training = engine.module.training
    engine.eval()
    try:
        with torch.no_grad():
            for _ in range(max_new_tokens):
                output = engine(torch.tensor([ids[-seq_len:]], dtype=torch.long))
                logits = getattr(output, "logits", output)
                if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
                    raise ValueError("--sample-every needs a model whose forward(input_ids) returns logits of shape "
                                     f"(batch, seq, vocab); got {type(output).__name__}"
                                     + (f" of shape {tuple(logits.shape)}" if isinstance(logits, torch.Tensor) else ""))
                last = logits[0, -1].float().cpu()
                if temperature == 0:
                    token = int(last.argmax())
                else:
                    probs = torch.softmax(last / temperature, dim=-1)
                    token = int(torch.multinomial(probs, 1, generator=generator))
                ids.append(min(token, codec.max_id))
    finally:
        engine.train(was_training)
    # the whole text decoded, less the prompt's: a tokenizer's spacing between them is kept
    whole, head = codec.decode(ids), codec.decode(ids[:start])
    return whole[len(head):] if whole.startswith(head) else codec.decode(ids[start:])

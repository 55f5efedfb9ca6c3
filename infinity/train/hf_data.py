"""Text for a Hugging Face model: its own tokenizer when the folder has one, else bytes it can take.

``infinity train --hf-model DIR`` reads the corpus as :mod:`infinity.train.data`
does (a file or a folder of text), then:

* with a tokenizer in ``DIR`` (``tokenizer.json`` or ``tokenizer_config.json``,
  loaded by ``transformers.AutoTokenizer``, local files only), the text is
  encoded with it, and every id must be below the model's ``vocab_size``;
* without one, bytes are the ids, which needs ``vocab_size >= 256``; a smaller
  vocabulary is refused with a message saying so.

Windows, shuffling and the split over ranks are :class:`ByteCorpus`'s.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from infinity.hf.pretrained import require_transformers
from infinity.train.data import DEFAULT_MAX_BYTES, ByteCorpus, read_corpus_bytes
from infinity.train.evaluation import DEFAULT_VAL_FRACTION, carve_held_out, held_out_tail

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""A model folder with one of these has a tokenizer (copied along by ``--save-pretrained``)."""
TOKENIZER_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                        "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json")


def has_tokenizer(model_dir) -> bool:
    return any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES)


def check_tokenizer_files(model_dir) -> None:
    """The JSON files of ``model_dir``'s tokenizer parse: a ``ValueError`` naming the broken file otherwise
    (transformers would say only ``Expecting value: line 1 column 1``)."""
    for name in TOKENIZER_SIDE_FILES:
        path = Path(model_dir) / name
        if name.endswith(".json") and path.is_file():
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ValueError(f"tokenizer file {path} is not JSON: {err}") from None


class TokenizerCodec:
    """Text as a model folder's tokenizer reads and writes it (``--sample-every``'s prompt and samples)."""

    def __init__(self, tokenizer, vocab_size: int, model_dir: Path):
        self.tokenizer = tokenizer
        self.max_id = vocab_size - 1
        self.model_dir = model_dir
        self.said = f"{type(tokenizer).__name__} of {model_dir}"

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


class TokenCorpus(ByteCorpus):
    """:class:`ByteCorpus` over token ids instead of bytes (``num_bytes`` counts tokens); ``codec``: the tokenizer."""

    unit = "tokens"

    def __init__(self, tokens: torch.Tensor, description: str, codec: TokenizerCodec | None, *, seq_len: int,
                 micro_batch: int, seed: int = 0, rank: int = 0, world_size: int = 1):
        super().__init__(seq_len=seq_len, micro_batch=micro_batch, seed=seed, rank=rank, world_size=world_size,
                         data=b"\0" * (seq_len + 1))  # validation of the arguments; the ids replace these bytes
        if tokens.numel() < seq_len + 1:
            raise ValueError(f"{description}: {tokens.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        self.bytes = tokens
        self.num_windows = (tokens.numel() - 1) // seq_len
        self.description = description
        self.codec = codec


def hf_corpus(model_dir, path=None, *, vocab_size: int, seq_len: int, micro_batch: int, seed: int = 0,
              rank: int = 0, world_size: int = 1, max_bytes: int | None = DEFAULT_MAX_BYTES) -> ByteCorpus:
    """The corpus at ``path`` as ids for the model in ``model_dir`` (see the module's docstring)."""
    model_dir = Path(model_dir)
    if not has_tokenizer(model_dir):
        _check_byte_vocabulary(model_dir, vocab_size)
        return ByteCorpus(path, seq_len=seq_len, micro_batch=micro_batch, seed=seed, rank=rank,
                          world_size=world_size, max_bytes=max_bytes)

    data, description = read_corpus_bytes(path, max_bytes=max_bytes)
    codec = _tokenizer_codec(model_dir, vocab_size)
    tokens = _token_ids(codec, data)
    description = f"{description}, {tokens.numel():,} tokens ({codec.said})"
    return TokenCorpus(tokens, description, codec, seq_len=seq_len, micro_batch=micro_batch, seed=seed, rank=rank,
                       world_size=world_size)


def hf_held_out(model_dir, path=None, *, vocab_size: int, seq_len: int, micro_batch: int, seed: int = 0,
                rank: int = 0, world_size: int = 1, max_bytes: int | None = DEFAULT_MAX_BYTES,
                val_path=None, val_fraction: float = DEFAULT_VAL_FRACTION) -> tuple[ByteCorpus, ByteCorpus]:
    """The training corpus and the held-out one (``--eval-every``), as ids for the model in ``model_dir``: the
    text of ``val_path``, or else the last ``val_fraction`` of the corpus' tokens (bytes without a tokenizer),
    never trained on."""
    model_dir = Path(model_dir)
    corpus = dict(seq_len=seq_len, micro_batch=micro_batch, seed=seed, rank=rank, world_size=world_size)
    if not has_tokenizer(model_dir):
        _check_byte_vocabulary(model_dir, vocab_size)
        held = carve_held_out(path, max_bytes=max_bytes, seq_len=seq_len, val_path=val_path, val_fraction=val_fraction)
        train, val = ByteCorpus(data=held.train, **corpus), ByteCorpus(data=held.val, **corpus)
        train.description, val.description = held.train_description, held.val_description
        return train, val
    data, description = read_corpus_bytes(path, max_bytes=max_bytes)
    codec = _tokenizer_codec(model_dir, vocab_size)
    tokens = _token_ids(codec, data)
    if val_path is not None:
        val_data, val_description = read_corpus_bytes(val_path, max_bytes=max_bytes)
        val_tokens = _token_ids(codec, val_data)
        if val_tokens.numel() < seq_len + 1:
            raise ValueError(f"--val-data {str(val_path)!r} holds {val_tokens.numel()} tokens, fewer than seq_len + 1 "
                             f"= {seq_len + 1}")
        train_tokens, said = tokens, f"{description}, {tokens.numel():,} tokens ({codec.said})"
        val_said = f"{val_description}, {val_tokens.numel():,} tokens"
    else:
        n_val = held_out_tail(tokens.numel(), val_fraction, seq_len=seq_len, unit="tokens")
        train_tokens, val_tokens = tokens[:tokens.numel() - n_val], tokens[tokens.numel() - n_val:]
        said = f"{description}, {tokens.numel():,} tokens ({codec.said}; the last {n_val:,} held out)"
        val_said = f"the last {val_fraction:.0%} of the corpus, {n_val:,} tokens"
    return TokenCorpus(train_tokens, said, codec, **corpus), TokenCorpus(val_tokens, val_said, codec, **corpus)


def _check_byte_vocabulary(model_dir: Path, vocab_size: int) -> None:
    """Without a tokenizer the ids are bytes: refused, naming the folder, where the vocabulary cannot take them."""
    if vocab_size < 256:
        raise ValueError(
            f"model folder {model_dir} has no tokenizer ({' or '.join(TOKENIZER_FILES)}) and its vocab_size="
            f"{vocab_size} cannot take byte ids 0..255: put the model's tokenizer files in the folder")
    logger.info("%s has no tokenizer: training on bytes (ids 0..255 of a %d-token vocabulary)", model_dir, vocab_size)


def _tokenizer_codec(model_dir: Path, vocab_size: int) -> TokenizerCodec:
    """The folder's tokenizer (``ValueError`` naming the folder, or a broken file, where it does not load)."""
    transformers = require_transformers("a model folder's tokenizer")
    check_tokenizer_files(model_dir)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as err:  # tokenizers and transformers raise many kinds; the folder is what the user can fix
        raise ValueError(f"cannot load the tokenizer in {model_dir} "
                         f"({', '.join(n for n in TOKENIZER_SIDE_FILES if (model_dir / n).is_file())}): {err}") from err
    return TokenizerCodec(tokenizer, vocab_size, model_dir)


def _token_ids(codec: TokenizerCodec, data: bytes) -> torch.Tensor:
    """``data`` encoded by the tokenizer (int32 ids), each below the model's vocabulary (else ``ValueError``)."""
    tokens = torch.tensor(codec.encode(data.decode("utf-8", errors="replace")), dtype=torch.int32)
    if tokens.numel() and int(tokens.max()) > codec.max_id:
        raise ValueError(f"the tokenizer in {codec.model_dir} gives id {int(tokens.max())} but the model's vocab_size "
                         f"is {codec.max_id + 1}: the tokenizer is not this model's")
    return tokens

"""Validation loss and samples through the engine equal a plain PyTorch model holding the same weights."""

import pytest
import torch

import infinity
from infinity.train.data import ByteCorpus
from infinity.train.evaluation import Validation, carve_held_out, sample_text
from infinity.models.gpt import GPT, GPTConfig

CFG = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=32)
TEXT = (b"def add(a, b):\n    return a + b\n\n" * 200) + bytes(range(32, 127)) * 20


def _trained_engine(tmp_path, steps=3):
    """A small GPT trained a few steps with everything on NVMe, in fp32 (so the comparison can be tight)."""
    torch.manual_seed(0)
    config = {"zero_optimization": {"stage": 3,
                                    "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0},
                                    "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "gradient_clipping": 1.0}
    engine = infinity.initialize(GPT(CFG), config)
    corpus = ByteCorpus(data=TEXT, seq_len=CFG.seq_len, micro_batch=4, seed=1)
    for _ in range(steps):
        loss = engine(*corpus.next_batch())
        engine.backward(loss)
        engine.step()
    return engine


def _plain_copy(engine) -> GPT:
    model = GPT(CFG)
    model.load_state_dict(engine.full_state_dict())
    return model.eval()


def test_validation_loss_equals_a_plain_pytorch_evaluation_of_the_same_weights(tmp_path):
    held = carve_held_out(None, max_bytes=100_000, seq_len=CFG.seq_len, val_fraction=0.1)
    validation = Validation(held.val, batches=3, seq_len=CFG.seq_len, micro_batch=4, seed=5)
    with _trained_engine(tmp_path) as engine:
        got = validation.loss(engine)
        assert engine.module.training  # training mode restored
        assert validation.loss(engine) == got  # the same batches every time, nothing changed by evaluating
        plain = _plain_copy(engine)
    with torch.no_grad():
        expected = sum(float(plain(x, y)) for x, y in validation.batches) / len(validation.batches)
    assert got == pytest.approx(expected, rel=1e-5)


def test_greedy_sample_equals_plain_greedy_decoding(tmp_path):
    with _trained_engine(tmp_path) as engine:
        got = sample_text(engine, "def ", max_new_tokens=12, seq_len=CFG.seq_len)
        plain = _plain_copy(engine)
    ids = list(b"def ")
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(plain(torch.tensor([ids[-CFG.seq_len:]]))[0, -1].argmax()))
    assert got == bytes(ids[4:]).decode("utf-8", errors="replace")


def test_temperature_sampling_is_reproducible_by_seed(tmp_path):
    with _trained_engine(tmp_path, steps=1) as engine:
        a = sample_text(engine, "x", max_new_tokens=8, seq_len=CFG.seq_len, temperature=1.0, seed=3)
        b = sample_text(engine, "x", max_new_tokens=8, seq_len=CFG.seq_len, temperature=1.0, seed=3)
    assert a == b and len(a.encode("utf-8", errors="replace")) >= 1


def test_the_held_out_part_is_the_corpus_tail_and_never_trained_on(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_bytes(TEXT)
    held = carve_held_out(str(f), max_bytes=None, seq_len=16, val_fraction=0.25)
    assert held.train + held.val == TEXT and len(held.val) == int(len(TEXT) * 0.25)
    other = tmp_path / "val.txt"
    other.write_bytes(b"y" * 100)
    held = carve_held_out(str(f), max_bytes=None, seq_len=16, val_path=str(other))
    assert held.train == TEXT and held.val == b"y" * 100


def test_too_small_a_held_out_part_is_named(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_bytes(b"z" * 500)
    with pytest.raises(ValueError, match="--val-fraction"):
        carve_held_out(str(f), max_bytes=None, seq_len=64, val_fraction=0.05)
    short = tmp_path / "short.txt"
    short.write_bytes(b"abc")
    with pytest.raises(ValueError, match="--val-data.*short.txt"):
        carve_held_out(str(f), max_bytes=None, seq_len=64, val_path=str(short))


def test_sampling_a_model_that_returns_no_logits_is_refused(tmp_path):
    class LossOnly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, input_ids, targets=None):
            return (self.w * input_ids.float()).mean()

    with infinity.initialize(LossOnly()) as engine:
        with pytest.raises(ValueError, match="logits"):
            sample_text(engine, "a", max_new_tokens=1, seq_len=4)

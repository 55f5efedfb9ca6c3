"""`infinity train --hf-model`, `--save-pretrained`, and the DeepSpeed config Hugging Face users carry."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from infinity.cli import main  # noqa: E402
from infinity.commands import train  # noqa: E402
from infinity.config.schema import InfinityConfig  # noqa: E402
from infinity.config.auto import fill_auto  # noqa: E402

HF_DS_CONFIG = {  # the shape of the configs in Hugging Face's DeepSpeed docs
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto", "bf16_master_weights_and_grads": False},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                          "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "zero_allow_untested_optimizer": True,
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def test_auto_left_unfilled_is_rejected_naming_the_key():
    with pytest.raises(ValueError, match=r"config key optimizer\.params\.lr is \"auto\""):
        InfinityConfig.from_deepspeed(fill_auto(HF_DS_CONFIG, {
            "train_micro_batch_size_per_gpu": 2, "train_batch_size": 2, "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0, "fp16.enabled": False, "bf16.enabled": False,
            "optimizer.params.betas": [0.9, 0.99], "optimizer.params.eps": 1e-8,
            "optimizer.params.weight_decay": 0.0}, hidden_size=32))


def test_auto_filled_from_the_run_and_the_hf_keys_accepted():
    raw = fill_auto(HF_DS_CONFIG, {
        "train_micro_batch_size_per_gpu": 2, "train_batch_size": 4, "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5, "fp16.enabled": False, "bf16.enabled": True,
        "optimizer.params.betas": [0.9, 0.99], "optimizer.params.eps": 1e-8, "optimizer.params.weight_decay": 0.0,
    }, steps=10, warmup=2, lr=1e-4, min_lr=1e-5, hidden_size=32)
    assert raw["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-4, "warmup_num_steps": 2,
                                          "total_num_steps": 10}
    cfg = InfinityConfig.from_deepspeed(raw)
    assert cfg.scheduler is not None  # honoured: the engine sets each step's lr from it
    assert (cfg.micro_batch_size, cfg.train_batch_size, cfg.gradient_accumulation_steps) == (2, 4, 2)
    assert cfg.gradient_clipping == 0.5 and cfg.precision == "bf16" and cfg.optimizer.lr == 1e-4
    assert cfg.zero.prefetch_bucket_size == int(0.9 * 32 * 32) and cfg.zero.param_persistence_threshold == 320
    for key in ("zero_allow_untested_optimizer", "bf16.bf16_master_weights_and_grads",
                "zero_optimization.stage3_gather_16bit_weights_on_model_save", "zero_optimization.reduce_bucket_size"):
        assert key in cfg.not_applicable
    with pytest.raises(ValueError, match=r"scheduler\.params\.warmup_max_lr is \"auto\""):
        InfinityConfig.from_deepspeed({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}})


def _tiny_llama(folder, vocab_size, with_tokenizer: bool):
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    if with_tokenizer:  # a word-level tokenizer built here, saved the transformers way
        words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(vocab_size - 4)]
        model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
        tok = tokenizers.Tokenizer(model)
        tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                    bos_token="<s>", eos_token="</s>")
        fast.save_pretrained(folder)


def test_train_hf_model_with_its_tokenizer_and_save_pretrained(tmp_path, capsys):
    model_dir, out = tmp_path / "llama", tmp_path / "tuned"
    _tiny_llama(model_dir, 64, with_tokenizer=True)
    data = tmp_path / "corpus.txt"
    data.write_text(" ".join(f"w{(i * 7) % 60}" for i in range(3000)))
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(HF_DS_CONFIG))
    rc = main(["train", "--hf-model", str(model_dir), "--data", str(data), "--steps", "3", "--micro-batch", "2",
               "--seq-len", "32", "--precision", "fp32", "--config", str(config), "--save-pretrained", str(out),
               "--save-dir", str(tmp_path / "ckpt"), "--run-dir", str(tmp_path / "run"), "--json"])
    captured = capsys.readouterr()
    printed = captured.out
    assert rc == 0, captured.err
    summary = json.loads(printed.strip().splitlines()[-1])
    assert summary["model"] == str(model_dir) and len(summary["losses"]) == 3
    assert "3,000 tokens (" in printed and "x 32 tokens;" in printed and "Hugging Face layout" in printed
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    before = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    changed = [n for n, v in reloaded.state_dict().items() if not torch.equal(v, before.state_dict()[n])]
    assert changed  # trained, and the result is what transformers loads
    assert transformers.AutoTokenizer.from_pretrained(out)("w1 w2")["input_ids"] == [5, 6]

    # the run's checkpoint, consolidated in the Hugging Face layout, is the same model
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "from-ckpt"), "--hf"]) == 0
    consolidated = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "from-ckpt")
    for name, value in reloaded.state_dict().items():
        assert torch.equal(consolidated.state_dict()[name], value), name


def test_bytes_refused_when_the_vocabulary_cannot_take_them(tmp_path, capsys):
    model_dir = tmp_path / "llama"
    _tiny_llama(model_dir, 64, with_tokenizer=False)
    assert main(["train", "--hf-model", str(model_dir), "--steps", "1", "--max-bytes", "100000"]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer" in err and "vocab_size=64 cannot take byte ids" in err


def test_train_hf_model_with_activation_checkpointing_trains_the_same_bits(tmp_path, capsys, monkeypatch):
    """--activation-checkpointing calls the model's own activation_checkpointing_enable(): its layers recomputed in
    backward, the losses those of the run that keeps its activations."""
    enabled, enable = [], train._with_activation_checkpointing
    monkeypatch.setattr(train, "_with_activation_checkpointing",
                        lambda model: enabled.append(enable(model).is_activation_checkpointing))
    model_dir = tmp_path / "llama"
    _tiny_llama(model_dir, 64, with_tokenizer=True)
    data = tmp_path / "corpus.txt"
    data.write_text(" ".join(f"w{(i * 7) % 60}" for i in range(3000)))
    losses = []
    for flag in ([], ["--activation-checkpointing"]):
        argv = ["train", "--hf-model", str(model_dir), "--data", str(data), "--steps", "3", "--micro-batch", "2",
                "--seq-len", "32", "--precision", "fp32", "--offload-param", "cpu", "--offload-optimizer", "cpu",
                "--run-dir", str(tmp_path / f"run{len(losses)}"), "--json", *flag]
        assert main(argv) == 0
        losses.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["losses"])
    assert losses[0] == losses[1] and enabled == [True]


def _tiny_gpt2(folder):
    """GPT-2's shape: biases, LayerNorms, a tied head; 256 ids, so the corpus is read as bytes."""
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4,
                                                         n_positions=64)).save_pretrained(folder)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_model_decays_what_the_stock_trainer_decays(tmp_path, capsys, monkeypatch, family):
    """`infinity train --hf-model`'s weight decay falls on the parameters the stock Trainer's
    get_decay_parameter_names names (embeddings and matmul weights) and on no other (biases, LayerNorm and RMSNorm
    weights)."""
    model_dir = tmp_path / family
    if family == "llama":
        _tiny_llama(model_dir, 64, with_tokenizer=True)
    else:
        _tiny_gpt2(model_dir)
    data = tmp_path / "corpus.txt"
    data.write_text(" ".join(f"w{(i * 7) % 60}" for i in range(3000)))
    engines, initialize = [], train.initialize

    def initialize_and_keep(*args, **kwargs):
        engines.append(initialize(*args, **kwargs))
        return engines[-1]

    monkeypatch.setattr(train, "initialize", initialize_and_keep)
    assert main(["train", "--hf-model", str(model_dir), "--data", str(data), "--steps", "1", "--micro-batch", "2",
                 "--seq-len", "32", "--precision", "fp32", "--offload-param", "cpu", "--offload-optimizer", "cpu",
                 "--run-dir", str(tmp_path / "run")]) == 0
    (engine,) = engines
    decays = {slot.name: slot.weight_decay for slot in engine.layout.slots}

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    stock = transformers.Trainer(model=model, args=transformers.TrainingArguments(
        output_dir=str(tmp_path / "stock"), report_to=[], use_cpu=True))
    named = set(stock.get_decay_parameter_names(model))
    expected = {name: 0.1 if name in named else 0.0 for name, _ in model.named_parameters()}
    assert decays == expected
    decayed, kept = sum(d > 0 for d in decays.values()), sum(d == 0 for d in decays.values())
    assert decayed and kept
    assert f"; weight decay 0.1 on {decayed} tensors (2-D and up), none on {kept}\n" in capsys.readouterr().out


def test_hf_model_eval_every_measures_held_out_tokens_as_transformers_does(tmp_path, capsys):
    """--hf-model --eval-every: the last 5% of the corpus' tokens are held out (never trained on), and the final
    validation loss is the loss transformers computes with the saved model on the same held-out windows."""
    from infinity.train.evaluation import Validation
    from infinity.train.hf_data import TokenCorpus

    model_dir, out = tmp_path / "llama", tmp_path / "tuned"
    _tiny_llama(model_dir, 64, with_tokenizer=True)
    text = " ".join(f"w{(i * 7) % 60}" for i in range(3000))
    (tmp_path / "corpus.txt").write_text(text)
    assert main(["train", "--hf-model", str(model_dir), "--data", str(tmp_path / "corpus.txt"), "--steps", "4",
                 "--micro-batch", "2", "--seq-len", "32", "--precision", "fp32", "--eval-every", "2",
                 "--eval-batches", "3", "--save-pretrained", str(out), "--run-dir", str(tmp_path / "run"),
                 "--json"]) == 0
    printed = capsys.readouterr().out
    summary = json.loads(printed.strip().splitlines()[-1])
    assert "3,000 tokens (" in printed and "the last 150 held out)" in printed
    assert [step for step, _ in summary["val_losses"]] == [2, 4]

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    held_out = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][-150:], dtype=torch.int32)
    windows = Validation(TokenCorpus(held_out, "held out", None, seq_len=32, micro_batch=2), batches=3, seq_len=32,
                         micro_batch=2).batches
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        expected = sum(float(model(input_ids=ids, labels=ids).loss) for ids, _ in windows) / len(windows)
    assert summary["val_loss"] == pytest.approx(expected, rel=1e-5)


def test_hf_held_out_with_val_data_loads_the_tokenizer_once_and_keeps_each_files_ids(tmp_path, monkeypatch):
    """--val-data with a tokenizer: both files are encoded by one tokenizer loaded once, and each corpus holds exactly
    the ids transformers' own tokenizer gives its file."""
    from infinity.train.hf_data import hf_held_out

    model_dir = tmp_path / "llama"
    _tiny_llama(model_dir, 64, with_tokenizer=True)
    (tmp_path / "train.txt").write_text(" ".join(f"w{i % 60}" for i in range(400)))
    (tmp_path / "val.txt").write_text(" ".join(f"w{(i * 7) % 60}" for i in range(100)))
    reference = transformers.AutoTokenizer.from_pretrained(model_dir)
    loads = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: loads.append(a) or real(*a, **k))
    train_set, val_set = hf_held_out(model_dir, tmp_path / "train.txt", vocab_size=64, seq_len=16, micro_batch=2,
                                     val_path=tmp_path / "val.txt")
    assert len(loads) == 1
    for corpus, name in ((train_set, "train.txt"), (val_set, "val.txt")):
        expected = reference((tmp_path / name).read_text(), add_special_tokens=False)["input_ids"]
        assert corpus.bytes.tolist() == expected and corpus.codec is train_set.codec


def test_hf_model_samples_are_the_saved_models_greedy_tokens_decoded_by_its_tokenizer(tmp_path, capsys):
    """--hf-model --sample-every: the prompt tokenized, each new token the argmax of a forward, the text decoded by
    the folder's tokenizer; the same as transformers' forward of the saved model gives."""
    model_dir, out = tmp_path / "llama", tmp_path / "tuned"
    _tiny_llama(model_dir, 64, with_tokenizer=True)
    (tmp_path / "corpus.txt").write_text(" ".join(f"w{(i * 7) % 60}" for i in range(3000)))
    assert main(["train", "--hf-model", str(model_dir), "--data", str(tmp_path / "corpus.txt"), "--steps", "3",
                 "--micro-batch", "2", "--seq-len", "32", "--precision", "fp32", "--lr", "1e-2", "--sample-every", "3",
                 "--prompt", "w1 w2 w3", "--sample-tokens", "6", "--save-pretrained", str(out),
                 "--run-dir", str(tmp_path / "run")]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sample at step 3: ")]

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tokenizer("w1 w2 w3", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(input_ids=torch.tensor([ids[-32:]])).logits[0, -1].argmax()))
    assert printed == [f"sample at step 3: {tokenizer.decode(ids)!r}"]

"""`infinity train`: flags and config merge, every bad input refused before any work, a short run end to end."""

import json
import shutil
import tempfile
from collections import namedtuple

import pytest

from infinity.cli import build_parser, main
from infinity.commands import train
from infinity.commands.train_checks import TEMPORARY_SWAP_PATH
from infinity.config.sections import OffloadOptimizerConfig, OffloadParamConfig, OptimizerConfig, TraceConfig
from infinity.runtime.hardware import resolve_precision


def _args(*argv):
    argv = ["train", *argv]
    return build_parser(argv).parse_args(argv)


pytestmark = pytest.mark.usefixtures("fresh_cwd")  # conftest.py: runs write under ./runs


def _fails(capsys, *argv) -> str:
    assert main(["train", "--max-bytes", "200000", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("infinity train: error: ")
    return err


# --------------------------------------------------------------------------- the plan


def test_no_arguments_is_the_make_train_job():
    plan = train.make_plan(_args())
    assert plan.preset == "small" and plan.steps == train.DEFAULT_STEPS
    fast = resolve_precision("auto").precision  # bf16 where the machine computes it fast, else fp32
    assert (plan.offload_param, plan.offload_optimizer, plan.precision) == ("nvme", "nvme", fast)
    assert plan.nvme_path is None and plan.nvme_is_temporary
    config = plan.config
    assert config.zero.stage == 3
    assert config.zero.sub_group_size == train.DEFAULT_SUB_GROUP_SIZE
    # `--offload-* nvme` means the disk (in a temporary swap folder) ...
    for block in (config.zero.offload_param, config.zero.offload_optimizer):
        assert (block.device, block.max_in_cpu, block.nvme_path) == ("nvme", 0, TEMPORARY_SWAP_PATH)
    assert config.zero.host_memory_budget is None
    # ... unless a host-memory budget makes it a spill tier: then the engine keeps what fits (the defaults)
    zero = train.make_plan(_args("--host-memory", "2GiB")).config.zero
    assert zero.host_memory_budget == 2 << 30
    assert zero.offload_param == OffloadParamConfig(device="nvme", nvme_path=TEMPORARY_SWAP_PATH)
    assert zero.offload_optimizer == OffloadOptimizerConfig(device="nvme", nvme_path=TEMPORARY_SWAP_PATH)
    assert config.optimizer == OptimizerConfig(type="AdamW", lr=train.PRESET_LR["small"], betas=(0.9, 0.95), eps=1e-8,
                                               weight_decay=0.1)
    assert config.precision == fast
    assert config.gradient_clipping == 1.0
    assert config.micro_batch_size == train.DEFAULT_MICRO_BATCH
    assert config.gradient_accumulation_steps == 1


def test_flags_build_a_deepspeed_config(tmp_path):
    plan = train.make_plan(_args("--preset", "tiny", "--offload-param", "cpu", "--offload-optimizer", "nvme",
                                 "--nvme-path", str(tmp_path / "swap"), "--precision", "fp32", "--micro-batch", "3",
                                 "--grad-accum", "2", "--seq-len", "64", "--lr", "1e-3", "--steps", "7",
                                 "--trace", str(tmp_path / "t.json")))
    config = plan.config
    assert config.zero.offload_param == OffloadParamConfig(device="cpu")
    assert config.zero.offload_optimizer.device == "nvme"
    assert plan.nvme_path == str(tmp_path / "swap") and not plan.nvme_is_temporary
    assert (tmp_path / "swap").is_dir()  # made, and found writable
    assert config.precision == "fp32"
    assert (config.micro_batch_size, config.gradient_accumulation_steps) == (3, 2)
    assert config.optimizer.lr == 1e-3
    assert config.trace == TraceConfig(path=str(tmp_path / "t.json"))
    assert (plan.steps, plan.seq_len, plan.warmup, plan.min_lr) == (7, 64, 1, pytest.approx(1e-4))


def test_flags_given_override_the_config_file_and_the_rest_comes_from_it(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "fp16": {"enabled": False}, "bf16": {"enabled": False},
        "zero_optimization": {"stage": 3, "sub_group_size": 1000,
                              "offload_optimizer": {"device": "cpu"},
                              "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "nv"), "max_in_cpu": 5}},
    }))
    plan = train.make_plan(_args("--config", str(cfg), "--lr", "5e-4", "--grad-accum", "1"))
    config = plan.config
    assert config.optimizer == OptimizerConfig(type="Adam", lr=5e-4, weight_decay=0.0)  # the rest: the file's defaults
    assert (plan.lr, plan.micro_batch, plan.grad_accum) == (5e-4, 3, 1)
    assert plan.precision == "fp32"
    assert (plan.offload_param, plan.offload_optimizer) == ("nvme", "cpu")
    assert plan.nvme_path == str(tmp_path / "nv")
    assert config.zero.offload_param.max_in_cpu == 5  # the file's choice is kept
    assert config.zero.sub_group_size == 1000


def test_estimate_of_the_plan_uses_the_engine_config():
    plan = train.make_plan(_args("--preset", "tiny", "--seq-len", "32", "--micro-batch", "2"))
    from infinity.models.gpt import PRESETS, count_params

    est = train.estimate_for(plan, PRESETS["tiny"])
    assert est["setting"]["num_params"] == count_params(PRESETS["tiny"])
    assert est["setting"]["max_in_cpu"] == 0
    assert est["totals"]["nvme"] > 0 and est["tiers"]["device"]["activations"] > 0


# --------------------------------------------------------------------------- bad input, before any work


def test_missing_corpus_is_named(no_work, capsys):
    err = _fails(capsys, "--data", str(no_work / "missing_corpus"))
    assert "missing_corpus" in err and "does not exist" in err


def test_empty_corpus_is_named(no_work, capsys):
    empty = no_work / "empty.txt"
    empty.write_text("")
    err = _fails(capsys, "--data", str(empty))
    assert "empty.txt" in err and "empty" in err


def test_unknown_preset_lists_the_presets(no_work, capsys):
    err = _fails(capsys, "--preset", "gigantic")
    assert "unknown preset 'gigantic'" in err and "small" in err and "1.3b" in err


def test_config_that_is_not_json_is_named(no_work, capsys):
    bad = no_work / "ds_config.json"
    bad.write_text("{ this is not json")
    err = _fails(capsys, "--config", str(bad))
    assert "ds_config.json" in err and "not JSON" in err
    err = _fails(capsys, "--config", str(no_work / "absent.json"))
    assert "absent.json" in err and "does not exist" in err


def test_config_with_an_unknown_key_is_refused(no_work, capsys):
    bad = no_work / "typo.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 3, "sub_grup_size": 10}}))
    assert "sub_grup_size" in _fails(capsys, "--config", str(bad))


def test_nvme_path_that_is_not_writable_is_named(no_work, capsys):
    blocker = no_work / "a_file"
    blocker.write_text("x")
    err = _fails(capsys, "--nvme-path", str(blocker / "swap"))
    assert "nvme path" in err and "a_file/swap" in err and "not writable" in err
    err = _fails(capsys, "--nvme-path", str(blocker))
    assert "a_file" in err and "not a folder" in err


def test_disk_too_small_names_both_numbers(no_work, monkeypatch, capsys):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    err = _fails(capsys, "--nvme-path", str(no_work), "--preset", "10m")
    assert "not enough room" in err and str(no_work) in err and "1,000 bytes" in err
    needed = int(err.split("need about ")[1].split("(")[1].split(" bytes")[0].replace(",", ""))
    assert needed > 100 * 10**6  # 10M parameters x 14 bytes on NVMe


def test_the_disk_check_leaves_out_the_optional_second_side(no_work, monkeypatch, capsys):
    """The engine reserves a speculative step's second side only where the disk has room; a disk with room for
    the states but not for both sides must not be refused."""
    from infinity.models.gpt import PRESETS
    from infinity.placement.estimate_gpt import estimate_gpt
    from infinity.placement.placement import distinct_device_requested

    # the estimate train makes: device memory apart from host memory in the distinct-device mode
    both = estimate_gpt(PRESETS["10m"], micro_batch=8, seq_len=256, offload_param="nvme", offload_optimizer="nvme",
                        precision="bf16", gpu=distinct_device_requested(), step_undo=True, overlap_step=True, max_in_cpu=0,
                        host_memory_budget=100 << 20)
    one_side = both["totals"]["nvme"] - both["tiers"]["nvme"]["step_undo"]
    assert both["tiers"]["nvme"]["step_undo"] > 5 * 10**7  # the second side is worth checking for
    usage = namedtuple("usage", "total used free")
    argv = ["--nvme-path", str(no_work), "--preset", "10m", "--host-memory", "100MiB", "--precision", "bf16"]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - one_side - 10**7, one_side + 10**7))
    with pytest.raises(AssertionError, match="work started"):  # passes every check, then would build the model
        main(["train", *argv])
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - one_side // 2, one_side // 2))
    assert "not enough room" in _fails(capsys, *argv)


def test_the_disk_check_is_skipped_where_the_disk_itself_is_to_say(no_work, monkeypatch, capsys):
    """INFINITY_NO_ROOM_CHECK=1 (bench_scale.py --above): the estimate's bytes are not held against the free room,
    so the engine's own reservations on the disk decide; without it the same run is refused."""
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    argv = ["--nvme-path", str(no_work), "--preset", "10m"]
    assert "not enough room" in _fails(capsys, *argv)
    monkeypatch.setenv("INFINITY_NO_ROOM_CHECK", "1")
    with pytest.raises(AssertionError, match="work started"):  # passes every check, then would build the model
        main(["train", "--max-bytes", "200000", *argv])


def test_no_disk_check_without_nvme(no_work, monkeypatch, capsys):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1, 1, 0))
    with pytest.raises(AssertionError, match="work started"):  # passes every check, then would build the model
        main(["train", "--preset", "tiny", "--offload-param", "cpu", "--offload-optimizer", "none"])


@pytest.mark.parametrize("argv, message", [
    (["--preset", "tiny", "--model", "m.py"], "--preset or --model"),
    (["--model", "no_such_model.py"], "no_such_model.py"),
    (["--steps", "0"], "--steps must be positive"),
    (["--micro-batch", "0"], "--micro-batch must be positive"),
    (["--preset", "tiny", "--seq-len", "4096"], "longer than preset 'tiny' allows (128)"),
    (["--save-every", "10"], "--save-every needs --save-dir"),
    (["--lr", "1e-3", "--min-lr", "1e-2"], "--min-lr"),
    (["--steps", "10", "--warmup", "11"], "--warmup 11 is more than --steps 10"),
    (["--save-dtype", "bf16"], "--save-dtype needs --save-pretrained"),
    (["--wait-for-lock"], "--wait-for-lock needs --save-dir"),
    (["--overwrite"], "--overwrite needs --save-dir, --save-pretrained or --run-dir"),
    (["--offload-param", "cpu", "--offload-optimizer", "cpu", "--buffered-io"],
     "--buffered-io needs a tier on NVMe: nothing goes there (params -> cpu, optimizer -> cpu)"),
    (["--lr-schedule", "constant", "--min-lr", "1e-5"], "--min-lr has no effect with --lr-schedule constant"),
])
def test_other_bad_flags(no_work, capsys, argv, message):
    assert message in _fails(capsys, *argv)


def test_resume_from_a_missing_folder(no_work, capsys):
    assert "missing_ckpt" in _fails(capsys, "--resume", str(no_work / "missing_ckpt"))


# --------------------------------------------------------------------------- end to end


def _run_json(capsys, *argv) -> dict:
    assert main(["train", "--preset", "tiny", "--seq-len", "32", "--micro-batch", "2", "--max-bytes", "200000", "--json",
                 *argv]) == 0  # later flags win: a test may name another preset
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_short_run_ends_with_a_json_line_and_removes_its_swap_folder(capsys, monkeypatch, tmp_path):
    pytest.importorskip("infinity.engine.engine")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = _run_json(capsys, "--steps", "4")
    assert len(out["losses"]) == 4 and all(isinstance(x, float) for x in out["losses"])
    assert out["tokens_per_s"] > 0 and out["peak_rss_bytes"] > 0
    assert out["tiers"]["nvme"]["bytes_written"] > 0 and out["tiers"]["nvme"]["bytes_read"] > 0
    assert list(tmp_path.iterdir()) == []  # the private swap folder is gone


@pytest.mark.parametrize("preset, offload", [
    ("tiny", ("none", "none")), ("tiny", ("cpu", "cpu")), ("tiny", ("nvme", "nvme")), ("tiny", ("nvme", "cpu")),
    ("tiny", ("none", "nvme")), ("small", ("nvme", "nvme")), ("10m", ("nvme", "nvme")), ("10m", ("cpu", "none")),
])
def test_estimate_is_within_15_percent_of_what_train_measures(capsys, tmp_path, preset, offload):
    pytest.importorskip("infinity.engine.engine")
    out = _run_json(capsys, "--preset", preset, "--steps", "2", "--seq-len", "16", "--micro-batch", "1",
                    "--offload-param", offload[0], "--offload-optimizer", offload[1],
                    *(["--nvme-path", str(tmp_path)] if "nvme" in offload else []))
    for tier in ("device", "host", "nvme"):
        measured, estimated = out["tiers"][tier]["peak_nbytes"], out["estimate"][tier]
        assert estimated == pytest.approx(measured, rel=0.15, abs=64 * 1024), tier


def test_a_users_model_file_trains(capsys, tmp_path):
    pytest.importorskip("infinity.engine.engine")
    f = tmp_path / "my_model.py"
    f.write_text(
        "from infinity.models.gpt import GPT, GPTConfig\n"
        "def build_model():\n"
        "    return GPT(GPTConfig(n_layer=1, n_head=2, d_model=32, seq_len=32))\n"
    )
    assert main(["train", "--model", str(f), "--steps", "2", "--seq-len", "32", "--micro-batch", "2",
                 "--max-bytes", "100000", "--offload-param", "cpu", "--offload-optimizer", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["model"] == str(f) and out["preset"] is None and len(out["losses"]) == 2


def test_activation_checkpointing_trains_the_same_bits_and_the_estimate_keeps_less(capsys, tmp_path):
    pytest.importorskip("infinity.engine.engine")
    argv = ["--steps", "3", "--seq-len", "128", "--offload-param", "cpu", "--offload-optimizer", "cpu"]
    kept = _run_json(capsys, *argv)
    recomputed = _run_json(capsys, *argv, "--activation-checkpointing")
    assert recomputed["losses"] == kept["losses"]  # recomputing a block gives the same values
    plan = train.make_plan(_args("--preset", "tiny", "--seq-len", "128", "--micro-batch", "8"))
    full = train.estimate_for(plan, train.get_preset("tiny"))["tiers"]["device"]["activations"]
    plan.activation_checkpointing = True
    less = train.estimate_for(plan, train.get_preset("tiny"))["tiers"]["device"]["activations"]
    assert 0 < less < full


def test_activation_checkpointing_of_a_model_without_the_method_is_refused_by_name(capsys, tmp_path):
    f = tmp_path / "plain.py"
    f.write_text(
        "import torch\n"
        "class Plain(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = torch.nn.Embedding(256, 8)\n"
        "    def forward(self, ids, targets):\n"
        "        return self.emb(ids).float().pow(2).mean()\n"
        "def build_model():\n"
        "    return Plain()\n"
    )
    err = _fails(capsys, "--model", str(f), "--activation-checkpointing", "--steps", "1",
                 "--offload-param", "cpu", "--offload-optimizer", "cpu")
    assert "--activation-checkpointing" in err and "Plain" in err and "activation_checkpointing_enable" in err


def test_resume_from_a_checkpoint_continues_the_same_run(capsys, tmp_path):
    if not train.engine_has_checkpoints():
        pytest.skip("the engine has no checkpoints yet")
    full = _run_json(capsys, "--steps", "4", "--save-dir", str(tmp_path / "ck"), "--save-every", "2")
    resumed = _run_json(capsys, "--steps", "4", "--resume", str(tmp_path / "ck" / "step2"))
    assert resumed["losses"][:2] == full["losses"][:2]  # restored, not recomputed
    assert resumed["losses"][2:] == pytest.approx(full["losses"][2:], rel=1e-6)  # same weights, data and lr


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A 2-step run of the tiny preset saved at steps 1 and 2 (its flags: ``RESUMED``)."""
    if not train.engine_has_checkpoints():
        pytest.skip("the engine has no checkpoints yet")
    folder = tmp_path_factory.mktemp("saved_run")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        assert main(["train", *RESUMED, "--steps", "2", "--save-dir", str(folder / "ck"), "--save-every", "1",
                     "--offload-param", "cpu", "--offload-optimizer", "cpu"]) == 0
    return folder / "ck"


RESUMED = ("--preset", "tiny", "--seq-len", "16", "--micro-batch", "2", "--max-bytes", "100000")


@pytest.mark.parametrize("argv, message", [
    (["--steps", "2", "--lr", "1e-3"], "--lr: the checkpoint's run has 0.003, given 0.001"),
    (["--steps", "2", "--lr", "1e-4"], "--lr: the checkpoint's run has 0.003, given 0.0001"),  # (below its min_lr)
    (["--steps", "2", "--micro-batch", "4"], "--micro-batch: the checkpoint's run has 2, given 4"),
    (["--steps", "2", "--warmup", "2"], "--warmup: the checkpoint's run has 1, given 2"),
    (["--steps", "2", "--seq-len", "32"], "--seq-len: the checkpoint's run has 16, given 32"),
    (["--steps", "2", "--seed", "1"], "--seed: the checkpoint's run has 0, given 1"),
    (["--steps", "2", "--grad-accum", "2"], "--grad-accum: the checkpoint's run has 1, given 2"),
    (["--steps", "2", "--lr-schedule", "linear"], "--lr-schedule: the checkpoint's run has cosine, given linear"),
    (["--steps", "1"], "--steps: the checkpoint's run has 2, given 1"),
    (["--steps", "5"], "--steps 5 extends the run of 2 steps: its cosine schedule would then follow a longer curve"),
    (["--steps", "2", "--config", "{clipping}"],
     "--config's gradient_clipping: the checkpoint's run has 1.0, given 0.5"),
    (["--steps", "2", "--config", "{decay}"], "--config's optimizer: the checkpoint's run has AdamW (betas 0.9, 0.95, "
                                              "eps 1e-08, weight decay 0.1), given AdamW (betas 0.9, 0.999, eps 1e-08, "
                                              "weight decay 0)"),
])
def test_resume_with_flags_that_change_the_training_is_refused_by_name(saved_run, no_work, capsys, argv, message):
    for name, body in (("clipping", {"gradient_clipping": 0.5}),
                       ("decay", {"optimizer": {"type": "AdamW", "params": {"weight_decay": 0.0}}})):
        if f"{{{name}}}" in argv:
            (no_work / f"{name}.json").write_text(json.dumps(body))
            argv = [str(no_work / f"{name}.json") if a == f"{{{name}}}" else a for a in argv]
    # (the checkpoint's own flags come first, the given ones after: later flags win)
    err = _fails(capsys, *RESUMED, *argv, "--resume", str(saved_run / "step1"))
    assert message in err and f"--resume {saved_run / 'step1'}" in err
    if "extends" in message:
        assert "give --extend-steps to accept that" in err


def test_resume_with_the_same_flags_or_free_ones_or_extend_steps_plans(saved_run, tmp_path):
    same = train.make_plan(_args(*RESUMED, "--steps", "2", "--resume", str(saved_run), "--run-dir", str(tmp_path),
                                 "--offload-param", "nvme", "--offload-optimizer", "none"))  # (not the training's)
    assert same.save.resume == str(saved_run) and same.run_settings["steps"] == 2
    longer = train.make_plan(_args(*RESUMED, "--steps", "40", "--resume", str(saved_run), "--extend-steps"))
    assert (longer.steps, longer.warmup) == (40, 1)  # the warmup left out is the saved run's, not 5% of 40


def test_extend_steps_without_resume_is_refused(no_work, capsys):
    assert "--extend-steps needs --resume" in _fails(capsys, "--extend-steps")


def test_extend_steps_that_extend_nothing_is_refused(saved_run, no_work, capsys):
    err = _fails(capsys, *RESUMED, "--steps", "2", "--resume", str(saved_run), "--extend-steps")
    assert "--extend-steps has no effect here: --steps 2 does not extend the checkpoint's run of 2 steps" in err


def test_memory_too_small_is_refused_before_work(no_work, monkeypatch, capsys):
    import psutil

    vm = namedtuple("vm", "available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: vm(10**6))
    err = _fails(capsys, "--preset", "tiny", "--offload-param", "cpu", "--offload-optimizer", "cpu")
    assert "needs about" in err and "977 KiB is available" in err


def test_a_config_file_without_offload_keeps_the_defaults_and_its_paths_are_kept(tmp_path):
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    plan = train.make_plan(_args("--config", str(plain)))  # (said on the start line: test_say_before.py)
    assert (plan.offload_param, plan.offload_optimizer) == ("nvme", "nvme") and plan.nvme_is_temporary
    two = tmp_path / "two.json"
    two.write_text(json.dumps({"zero_optimization": {
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "a")},
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "b")}}}))
    zero = train.make_plan(_args("--config", str(two))).config.zero
    assert (zero.offload_param.nvme_path, zero.offload_optimizer.nvme_path) == (str(tmp_path / "a"), str(tmp_path / "b"))
    zero = train.make_plan(_args("--config", str(two), "--nvme-path", str(tmp_path / "c"))).config.zero
    assert zero.offload_param.nvme_path == zero.offload_optimizer.nvme_path == str(tmp_path / "c")


def test_train_batch_size_must_agree(no_work, capsys):
    cfg = no_work / "tbs.json"
    cfg.write_text(json.dumps({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}))
    assert "train_batch_size=30" in _fails(capsys, "--config", str(cfg))
    cfg.write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                               "gradient_accumulation_steps": 2}))
    assert "train_batch_size=32" in _fails(capsys, "--config", str(cfg))
    assert "train_batch_size=32" in _fails(capsys, "--config", str(cfg), "--grad-accum", "4")
    cfg.write_text(json.dumps({"train_batch_size": 32}))
    assert "--micro-batch must be positive" in _fails(capsys, "--config", str(cfg), "--micro-batch", "0")


def test_the_accumulation_steps_left_out_come_from_the_batch_sizes_as_deepspeed_derives_them(tmp_path):
    cfg = tmp_path / "tbs.json"
    cfg.write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}))
    plan = train.make_plan(_args("--config", str(cfg)))
    assert (plan.micro_batch, plan.grad_accum) == (4, 8) and plan.config.gradient_accumulation_steps == 8


def test_each_preset_has_its_own_default_lr():
    from infinity.models.gpt import PRESETS

    assert set(train.PRESET_LR) == set(PRESETS)
    assert train.make_plan(_args("--preset", "1.3b")).lr == 2e-4
    assert train.make_plan(_args("--preset", "1.3b", "--lr", "1e-3")).lr == 1e-3


def test_json_counts_host_device_bytes_in_the_distinct_device_mode(capsys, monkeypatch, tmp_path):
    """What a GPU run would move over PCIe; nothing crosses where device memory is host memory."""
    pytest.importorskip("infinity.engine.engine")
    monkeypatch.delenv("INFINITY_DISTINCT_DEVICE", raising=False)  # `make test`'s second pass sets it for everything
    on_cpu = tmp_path / "on_cpu.json"  # with a GPU present, `auto` would compute there and copies would cross
    on_cpu.write_text(json.dumps({"device": "cpu"}))
    flags = ("--config", str(on_cpu), "--steps", "2", "--offload-param", "cpu", "--offload-optimizer", "cpu",
             "--precision", "fp32")
    one_memory = _run_json(capsys, *flags)
    assert one_memory["copies"] == {"host_to_device_nbytes": 0, "device_to_host_nbytes": 0}
    monkeypatch.setenv("INFINITY_DISTINCT_DEVICE", "1")
    distinct = _run_json(capsys, *flags)
    assert distinct["losses"] == one_memory["losses"]  # the same training, by another route
    params = distinct["num_params"]
    # every step: each fp32 gradient slice comes down once, and every parameter goes up at least once
    assert distinct["copies"]["device_to_host_nbytes"] == 2 * params * 4
    assert distinct["copies"]["host_to_device_nbytes"] >= 2 * params * 4


# --------------------------------------------------------------------------- weight decay


def _decay_reference(corpus_path, *, steps: int, lr: float, decay_all: bool) -> dict:
    """Plain PyTorch's run of `_run_decay`'s flags: the tiny preset from seed 0, the same batches, a constant lr,
    clipping 1.0, torch.optim.AdamW with betas (0.9, 0.95) and weight decay 0.1 on the tensors of 2 or more
    dimensions (nanoGPT's groups), or on every tensor with ``decay_all``."""
    import torch

    from infinity.train.data import ByteCorpus

    torch.manual_seed(0)
    model = train.GPT(train.get_preset("tiny"))
    params = list(model.parameters())
    groups = ([{"params": params}] if decay_all else
              [{"params": [p for p in params if p.dim() >= 2]}, {"params": [p for p in params if p.dim() < 2],
                                                                 "weight_decay": 0.0}])
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    corpus = ByteCorpus(corpus_path, seq_len=32, micro_batch=2, seed=0)
    for _ in range(steps):
        model(*corpus.next_batch()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def test_weight_decay_spares_biases_and_norms_as_torch_adamw_groups_do(capsys, tmp_path):
    """`infinity train`'s default weight decay (0.1) falls on the tensors of 2 or more dimensions only: its weights
    are plain PyTorch's with those two AdamW groups, and not those of decaying every tensor."""
    pytest.importorskip("infinity.engine.engine")
    import torch
    from safetensors.torch import load_file

    corpus, out, on_cpu = tmp_path / "corpus.txt", tmp_path / "out", tmp_path / "on_cpu.json"
    corpus.write_bytes(bytes(range(32, 127)) * 200)
    on_cpu.write_text(json.dumps({"device": "cpu"}))  # the reference computes on the CPU (a GPU's sums differ)
    steps, lr = 4, 3e-3
    assert main(["train", "--preset", "tiny", "--data", str(corpus), "--steps", str(steps), "--seq-len", "32",
                 "--micro-batch", "2", "--lr", str(lr), "--lr-schedule", "constant", "--warmup", "0",
                 "--precision", "fp32", "--offload-param", "cpu", "--offload-optimizer", "cpu",
                 "--config", str(on_cpu), "--save-pretrained", str(out)]) == 0
    assert "; weight decay 0.1 on 10 tensors (2-D and up), none on 18\n" in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    trained = {}
    for file in sorted(set(index["weight_map"].values())):
        trained.update(load_file(out / file))
    grouped = _decay_reference(corpus, steps=steps, lr=lr, decay_all=False)
    d = train.get_preset("tiny").d_model
    for name, value in grouped.items():
        if name.endswith("attn.qkv.bias"):  # the key bias's gradient is 0 but for rounding (softmax ignores a
            keep = torch.ones_like(value, dtype=torch.bool)  # score shift), which Adam scales up to lr-sized steps
            keep[d:2 * d] = False
            trained[name], value = trained[name][keep], value[keep]
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    decayed_all = _decay_reference(corpus, steps=steps, lr=lr, decay_all=True)
    for name in ("blocks.0.ln1.weight", "blocks.1.ln2.weight", "ln_f.weight"):  # ~lr x 0.1 x 4 steps x 1.0 apart
        assert (trained[name] - decayed_all[name]).abs().max() > 1e-4, name

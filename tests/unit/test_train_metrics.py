"""`infinity train` as a run one can watch: metrics.csv, validation, samples, plots, grad norm, NaN stops."""

import json
import sys
import types

import pytest
import torch

import infinity
from infinity.cli import main
from infinity.commands import train
from infinity.train.metrics_log import COLUMNS, MetricsLog, read_metrics

TINY = ["--preset", "tiny", "--seq-len", "32", "--micro-batch", "2", "--max-bytes", "200000"]


@pytest.fixture(autouse=True)
def _in_a_fresh_folder(tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


def _train(capsys, *argv) -> tuple[int, str, str]:
    code = main(["train", *TINY, *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_metrics_csv_has_one_row_per_step_with_the_named_columns(capsys, tmp_path):
    code, out, _ = _train(capsys, "--steps", "5", "--run-dir", str(tmp_path / "run"), "--eval-every", "2",
                          "--eval-batches", "2", "--json")
    assert code == 0
    rows = read_metrics(tmp_path / "run" / "metrics.csv")
    summary = json.loads(out.strip().splitlines()[-1])
    with open(tmp_path / "run" / "metrics.csv") as f:
        assert f.readline().strip().split(",") == list(COLUMNS)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in rows] == pytest.approx(summary["losses"])
    for r in rows:
        assert r["lr"] > 0 and r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["step_s"] > 0
        assert r["exposed_io_s"] is not None and r["nvme_bytes_read"] >= 0 and r["nvme_peak_nbytes"] > 0
    # A step's window may read nothing from NVMe: the next forward copies its compute shards from the staging
    # sets, and a clipped step's states are read ahead in the window before (behind the forward). Not all do.
    assert sum(r["nvme_bytes_read"] for r in rows) > 0
    # validation at steps 2, 4 and at the end, in the CSV, the summary and the progress lines
    assert [(r["step"], r["val_loss"]) for r in rows if r["val_loss"] is not None] == [
        tuple(v) for v in summary["val_losses"]]
    assert [s for s, _ in summary["val_losses"]] == [2, 4, 5]
    assert f"validation loss {summary['val_loss']:.3f}" in out and " val " in out


def test_lr_column_follows_the_chosen_schedule(capsys, tmp_path):
    from infinity.config.lr_schedule import lr_at

    code, _, _ = _train(capsys, "--steps", "6", "--run-dir", str(tmp_path), "--lr-schedule", "wsd", "--warmup", "2",
                        "--lr", "1e-3", "--min-lr", "0", "--decay-fraction", "0.5")
    assert code == 0
    lrs = [r["lr"] for r in read_metrics(tmp_path / "metrics.csv")]
    assert lrs == pytest.approx([lr_at(s, peak_lr=1e-3, warmup_steps=2, total_steps=6, schedule="wsd",
                                       decay_fraction=0.5) for s in range(6)])


def test_a_deepspeed_scheduler_block_sets_the_lr_of_each_step(capsys, tmp_path):
    from infinity.config.lr_schedule import DeepSpeedScheduler

    cfg = tmp_path / "ds.json"
    params = {"warmup_num_steps": 2, "warmup_type": "linear", "cos_min_ratio": 0.1}
    cfg.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 2e-3}},
                               "scheduler": {"type": "WarmupCosineLR", "params": params}}))
    code, _, _ = _train(capsys, "--steps", "5", "--config", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert code == 0
    lrs = [r["lr"] for r in read_metrics(tmp_path / "run" / "metrics.csv")]
    expected = DeepSpeedScheduler(type="WarmupCosineLR", total_num_steps=5, **params)  # --steps fills total_num_steps
    assert lrs == pytest.approx([expected.lr_at(k, 2e-3) for k in range(5)])


def test_plot_writes_a_valid_png(capsys, tmp_path):
    assert _train(capsys, "--steps", "3", "--run-dir", str(tmp_path), "--eval-every", "2", "--eval-batches", "1")[0] == 0
    assert main(["plot", str(tmp_path)]) == 0
    png = tmp_path / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(str(png)).shape
    assert width > 500 and height > 300
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err


def test_plot_errors_name_the_users_output_not_a_temporary_file(capsys, tmp_path):
    assert _train(capsys, "--steps", "2", "--run-dir", str(tmp_path))[0] == 0
    before = sorted(p.name for p in tmp_path.iterdir())
    for output, said in ((tmp_path / "no" / "x.png", f"folder {str(tmp_path / 'no')!r} does not exist"),
                         (tmp_path, "is a folder: name the picture file in it"),
                         ("/proc/x.png", "'/proc/x.png'")):  # (a folder no file can be made in, even by root)
        assert main(["plot", str(tmp_path), "-o", str(output)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("infinity plot: error: ") and said in err and ".tmp-" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing left beside the run


def test_plot_writes_the_format_its_output_names(capsys, tmp_path):
    """It wrote PNG bytes under any name (x.svg, x.jpgz)."""
    assert _train(capsys, "--steps", "2", "--run-dir", str(tmp_path))[0] == 0
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "x.jpgz")]) == 2
    assert "--output" in capsys.readouterr().err and not (tmp_path / "x.jpgz").exists()
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "x.svg")]) == 0
    assert b"<svg" in (tmp_path / "x.svg").read_bytes()[:1000]


def test_samples_are_printed_every_n_steps(capsys, tmp_path):
    code, out, _ = _train(capsys, "--steps", "4", "--run-dir", str(tmp_path), "--sample-every", "2", "--prompt", "def ",
                          "--sample-tokens", "5")
    assert code == 0
    samples = [line for line in out.splitlines() if line.startswith("sample at step")]
    assert [s.split(":")[0] for s in samples] == ["sample at step 2", "sample at step 4"]
    assert all(s.split(": ", 1)[1].startswith("'def ") for s in samples)


def test_missing_tensorboard_is_said_at_start_and_the_run_goes_on(capsys, tmp_path, monkeypatch):
    from infinity.commands import train_monitor

    monkeypatch.setattr(train_monitor, "tensorboard_available", lambda: False)
    code, out, _ = _train(capsys, "--steps", "1", "--run-dir", str(tmp_path), "--tensorboard", str(tmp_path / "tb"))
    assert code == 0 and "tensorboard is not installed" in out
    assert len(read_metrics(tmp_path / "metrics.csv")) == 1


def test_tensorboard_gets_every_scalar_when_installed(tmp_path, monkeypatch):
    written = []

    class FakeWriter:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, tag, value, step):
            written.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            pass

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    with MetricsLog(tmp_path, tensorboard_dir=tmp_path / "tb") as log:
        log.log({"step": 1, "loss": 2.5, "lr": 1e-3})
        log.log({"step": 2, "loss": 2.0, "lr": 1e-3, "val_loss": 2.2})
    assert ("Train/loss", 2.0, 2) in written and ("Train/val_loss", 2.2, 2) in written
    assert len(read_metrics(tmp_path / "metrics.csv")) == 2


def test_a_resumed_run_keeps_the_rows_up_to_its_checkpoint(tmp_path):
    with MetricsLog(tmp_path) as log:
        for step in range(1, 6):
            log.log({"step": step, "loss": float(step)})
    with MetricsLog(tmp_path, resume_after=3) as log:
        log.log({"step": 4, "loss": 40.0})
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.csv")] == [(1, 1.0), (2, 2.0), (3, 3.0),
                                                                                         (4, 40.0)]


def test_a_fresh_run_in_a_run_dir_with_an_earlier_runs_metrics_is_refused_before_work(capsys, tmp_path):
    """A second run given the same --run-dir replaced the first run's metrics.csv without a word; it is refused
    (naming the flag and the file) unless --overwrite or --resume, and the file is kept byte for byte."""
    run_dir = tmp_path / "run"
    assert _train(capsys, "--steps", "2", "--run-dir", str(run_dir))[0] == 0
    before = (run_dir / "metrics.csv").read_bytes()
    code, out, err = _train(capsys, "--steps", "3", "--run-dir", str(run_dir))
    assert code == 2 and "--run-dir" in err and "metrics.csv" in err and "2 step(s)" in err and "step " not in out
    assert (run_dir / "metrics.csv").read_bytes() == before
    assert _train(capsys, "--steps", "3", "--run-dir", str(run_dir), "--overwrite")[0] == 0
    assert [r["step"] for r in read_metrics(run_dir / "metrics.csv")] == [1, 2, 3]


def test_global_grad_norm_equals_plain_pytorch(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    reference = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(5, 8), torch.randn(5, 3)
    config = {"gradient_clipping": 1.0, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    with infinity.initialize(model, config) as engine:
        assert engine.get_global_grad_norm() is None
        loss = torch.nn.functional.mse_loss(engine(x), y.to(engine.device))  # the output is on the device
        engine.backward(loss)
        engine.step()
        got = engine.get_global_grad_norm()
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    with torch.no_grad():
        for p, r in zip(plain.parameters(), reference):
            p.copy_(r)
    torch.nn.functional.mse_loss(plain(x), y).backward()
    expected = torch.norm(torch.stack([p.grad.norm() for p in plain.parameters()])).item()
    assert got == pytest.approx(expected, rel=1e-5)


NAN_MODEL = """
import torch
from infinity.models.gpt import GPT, GPTConfig

class NanAfter(GPT):
    # the loss of the third training forward is NaN (as from an overflow); evaluation is left alone
    calls = 0

    def forward(self, input_ids, targets=None):
        out = super().forward(input_ids, targets)
        if targets is not None and self.training:
            NanAfter.calls += 1
            if NanAfter.calls == 3:
                return out * float("nan")
        return out

def build_model():
    return NanAfter(GPTConfig(n_layer=1, n_head=2, d_model=32, seq_len=32))
"""


def test_a_nan_loss_stops_the_run_with_a_message_and_a_checkpoint(capsys, tmp_path):
    f = tmp_path / "nan_model.py"
    f.write_text(NAN_MODEL)
    argv = ["train", "--model", str(f), "--steps", "6", "--seq-len", "32", "--micro-batch", "2", "--max-bytes", "100000",
            "--offload-param", "cpu", "--offload-optimizer", "cpu", "--run-dir", str(tmp_path / "run"),
            "--save-dir", str(tmp_path / "ck")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "stopped: the loss is nan at step 3" in err and "--lr" in err
    assert str(tmp_path / "ck" / "step2") in err
    assert (tmp_path / "ck" / "step2").is_dir() and not (tmp_path / "ck" / "step6").exists()
    rows = read_metrics(tmp_path / "run" / "metrics.csv")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["loss"] != rows[2]["loss"]  # NaN recorded
    # the checkpoint holds the weights of the last good step: they resume and train on (steps 3 and 4, until the
    # model file's third forward again; the run's --steps kept: a resume that changes it is refused)
    assert main(argv[:1] + ["--model", str(f), "--steps", "6", "--seq-len", "32", "--micro-batch", "2", "--max-bytes",
                            "100000", "--offload-param", "cpu", "--offload-optimizer", "cpu",
                            "--resume", str(tmp_path / "ck")]) == 1
    assert "stopped: the loss is nan at step 5" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "x"], "--prompt needs --sample-every"),
    (["--eval-batches", "3"], "--eval-batches needs --eval-every"),
    (["--eval-every", "0"], "--eval-every must be positive"),
    (["--eval-every", "2", "--val-data", "no_such_val.txt"], "no_such_val.txt"),
    (["--eval-every", "2", "--val-fraction", "1.5"], "--val-fraction"),
    (["--decay-fraction", "0.3"], "--decay-fraction needs --lr-schedule wsd"),
    (["--sample-every", "2", "--temperature", "-1"], "--temperature"),
])
def test_bad_watch_flags_are_named_before_any_work(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(train, "_build_model", lambda *a, **k: pytest.fail("work started"))
    assert main(["train", *TINY, *argv]) == 2
    assert message in capsys.readouterr().err


def test_warmup_flags_with_a_config_scheduler_are_refused(capsys, tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}}))
    assert main(["train", *TINY, "--config", str(cfg), "--warmup", "4"]) == 2
    assert "scheduler block" in capsys.readouterr().err


def test_lr_schedule_flag_replaces_a_config_scheduler_block(tmp_path):
    from infinity.cli import build_parser

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3}}}))

    def plan(*argv):
        argv = ["train", "--preset", "tiny", "--steps", "9", "--config", str(cfg), *argv]
        return train.make_plan(build_parser(argv).parse_args(argv))

    kept = plan()
    assert kept.monitor.lr_schedule == "deepspeed"
    assert (kept.config.scheduler.warmup_num_steps, kept.config.scheduler.total_num_steps) == (3, 9)
    replaced = plan("--lr-schedule", "linear")
    assert replaced.monitor.lr_schedule == "linear" and replaced.config.scheduler is None


INF_GRAD_MODEL = NAN_MODEL.replace("return out * float(\"nan\")", "return InfGrad.apply(out)").replace(
    "class NanAfter(GPT):", '''class InfGrad(torch.autograd.Function):
    # a finite loss whose gradient overflows
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")

class NanAfter(GPT):''')


def test_a_non_finite_gradient_norm_stops_the_run_without_saving_that_step(capsys, tmp_path):
    f = tmp_path / "inf_model.py"
    f.write_text(INF_GRAD_MODEL)
    assert main(["train", "--model", str(f), "--steps", "6", "--seq-len", "32", "--micro-batch", "2", "--max-bytes",
                 "100000", "--offload-param", "cpu", "--offload-optimizer", "cpu", "--run-dir", str(tmp_path / "run"),
                 "--save-dir", str(tmp_path / "ck"), "--save-every", "2"]) == 1
    err = capsys.readouterr().err
    assert "stopped: the gradient norm is" in err and "at step 3" in err
    assert (tmp_path / "ck" / "step2").is_dir() and not (tmp_path / "ck" / "step3").exists()
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.csv")] == [1, 2, 3]

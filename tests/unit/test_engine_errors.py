"""Bad input to the engine gets a clear error."""

import pytest
import torch

import infinity


def test_model_without_parameters():
    with pytest.raises(ValueError, match="has no parameters"):
        infinity.initialize(torch.nn.ReLU(), {})


def test_not_a_module():
    with pytest.raises(ValueError, match="torch.nn.Module"):
        infinity.initialize(lambda x: x, {})


def test_step_before_backward():
    engine = infinity.initialize(torch.nn.Linear(3, 1), {})
    try:
        engine(torch.randn(2, 3)).sum()
        with pytest.raises(RuntimeError, match=r"step\(\) called before backward\(\)"):
            engine.step()
    finally:
        engine.close()


def test_backward_of_a_loss_without_grad():
    engine = infinity.initialize(torch.nn.Linear(3, 1), {})
    try:
        with torch.no_grad():
            loss = engine(torch.randn(2, 3)).sum()
        with pytest.raises(ValueError, match="does not require grad"):
            engine.backward(loss)
    finally:
        engine.close()


def test_nvme_path_that_cannot_be_made_is_named(tmp_path):
    """A missing nvme_path is made (test_lose_nothing.py); one under a file cannot be, and is named."""
    (tmp_path / "nope").write_text("a file, not a folder")
    config = {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "nope" / "deeper")}}}
    with pytest.raises(OSError, match="nope"):
        infinity.initialize(torch.nn.Linear(3, 1), config)


def test_meta_module_without_reset_parameters():
    class Raw(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(3, device="meta"))

    with pytest.raises(ValueError, match="reset_parameters"):
        infinity.initialize(Raw(), {})


def test_an_engine_that_failed_to_build_leaves_nothing_for_the_exit_to_close():
    """The engine registers its parameters before the buffers are checked; the exit's closing of left-open engines
    then met a half-built one and warned of a missing part (naming the model, under the DeepSpeed door)."""
    from infinity.engine.gathered import engine_of

    class WithBuffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)
            self.register_buffer("pos", torch.arange(3.0))  # on meta under the meta device: no value to give it

    with torch.device("meta"):
        model = WithBuffer()
    with pytest.raises(ValueError, match="buffer 'pos'") as failed:
        infinity.initialize(model, {})
    left = engine_of(model.lin.weight)  # alive while the error's traceback holds it, as when a script dies of it
    assert left is not None and not getattr(failed.value, "__notes__", None)  # its own closing raised nothing
    left.close()  # what the exit does with it: nothing left to close, nothing to raise

"""A backward that raises part-way (after some gradients arrived) is taken back, so a loop that catches the error
(an out-of-memory skip, say) trains as if that backward never ran; where it cannot be taken back, the engine
says so instead of training on wrong gradients."""

import logging

import pytest
import torch

import infinity


class _Raise(torch.autograd.Function):
    """Identity whose backward raises while ``armed``: the layers after it have their gradients by then."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _Raise.armed:
            raise RuntimeError("raised in backward")
        return grad


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.second = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.second(_Raise.apply(self.first(x))).pow(2).mean()


def _config(*, overlap: bool, clip: float = 0.0, accum: int = 1) -> dict:
    return {
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
        "gradient_clipping": clip,
        "gradient_accumulation_steps": accum,
        # one sub-group per parameter: the second layer's are final (and updated, overlapped) before the raise
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "sub_group_size": 64,
                              "overlap_step_with_backward": overlap},
    }


def _batch(i: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(i))


def _engine(config: dict):
    torch.manual_seed(0)
    return infinity.initialize(_Net(), config)


def _failed_backward(engine, batch: torch.Tensor) -> None:
    loss = engine(batch)
    _Raise.armed = True
    try:
        with pytest.raises(RuntimeError, match="raised in backward"):
            engine.backward(loss)
    finally:
        _Raise.armed = False


def _steps(engine, batches) -> dict[str, torch.Tensor]:
    for batch in batches:
        engine.backward(engine(batch))
        engine.step()
    return {name: value.clone() for name, value in engine.full_state_dict().items()}


def _assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for name, value in want.items():
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("overlap, clip", [(False, 0.0), (True, 1e-3)], ids=["after-backward", "overlapped-clipped"])
def test_a_retried_backward_gives_the_step_it_would_have(overlap, clip):
    """Overlapped with clipping, the second layer was updated speculatively before the raise: it is undone."""
    config = _config(overlap=overlap, clip=clip)
    with _engine(config) as reference, _engine(config) as engine:
        want = _steps(reference, [_batch(0), _batch(1)])
        _failed_backward(engine, _batch(0))
        got = _steps(engine, [_batch(0), _batch(1)])
        assert engine.global_step == reference.global_step == 2
    _assert_same_state(got, want)


def test_a_backward_raising_mid_accumulation_drops_the_step_and_starts_it_again(caplog):
    """The step's last backward had added part of its gradients to the first micro-batch's: that step's
    gradients are dropped (logged), and the next two micro-batches make the step, as on a fresh engine."""
    config = _config(overlap=False, accum=2)
    with _engine(config) as reference, _engine(config) as engine:
        want = _steps(reference, [_batch(2), _batch(3)])
        engine.backward(engine(_batch(0)))
        engine.step()
        with caplog.at_level(logging.WARNING, logger="infinity.optim.step_cycle"):
            _failed_backward(engine, _batch(1))
        assert "gradients are dropped (1 micro-batch(es))" in caplog.text
        assert engine.micro_step == 0 and not engine.step_in_progress
        got = _steps(engine, [_batch(2), _batch(3)])
        assert engine.global_step == 1
    _assert_same_state(got, want)


def test_in_place_overlapped_updates_refuse_to_go_on_until_a_checkpoint_is_loaded(tmp_path):
    """Without clipping or fp16, the overlapped step's updates keep no undo copy: the next backward and step
    name the way out, and a loaded checkpoint makes training go on exactly as from that checkpoint."""
    config = _config(overlap=True)
    with _engine(config) as engine, _engine(config) as reference:
        engine.save_checkpoint(tmp_path, tag="start")
        _failed_backward(engine, _batch(0))
        with pytest.raises(RuntimeError, match=r"updated \d+ sub-group\(s\) in place.*engine\.load_checkpoint"):
            engine.backward(engine(_batch(0)))
        with pytest.raises(RuntimeError, match="cannot be taken back"):
            engine.step()
        engine.load_checkpoint(tmp_path, tag="start")
        got = _steps(engine, [_batch(0), _batch(1)])
        reference.load_checkpoint(tmp_path, tag="start")
        want = _steps(reference, [_batch(0), _batch(1)])
    _assert_same_state(got, want)

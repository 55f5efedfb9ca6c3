"""What ``infinity train`` says of the step-time model: the predicted step at the start (from the figures
``infinity bench --machine`` cached) and, at the end, the measured step over it."""

from __future__ import annotations

import statistics

from infinity.placement.step_time import StepPrediction, format_prediction, gpt_shape, predict_from_estimate
from infinity.runtime.machine_figures import load_cached

__all__ = ["predicted_step", "measured_over_predicted"]


def predicted_step(plan, model) -> tuple[StepPrediction | None, str]:
    """The prediction for this run (None without cached figures) and the start line saying it."""
    figures = load_cached()
    if figures is None:
        return None, "predicted step: no figures of this machine yet (`infinity bench --machine` measures them)"
    cfg = model if hasattr(model, "n_layer") else getattr(model, "config", None)
    shape = gpt_shape(cfg) if hasattr(cfg, "n_layer") and hasattr(cfg, "d_model") else None
    try:
        prediction = predict_from_estimate(
            figures, plan.estimate, micro_batch=plan.micro_batch, seq_len=plan.seq_len, shape=shape,
            overlap_step_with_backward=plan.config.zero.overlap_step_with_backward,
            overlap_step_with_forward=plan.config.zero.overlap_step_with_forward)
    except ValueError as err:  # a path the figures lack (no disk measured, say)
        return None, f"predicted step: {err}"
    return prediction, format_prediction(prediction)


def measured_over_predicted(prediction: StepPrediction | None, step_seconds: list[float]) -> tuple[dict, str | None]:
    """The summary's keys and the closing line: the median step after the first (which warms up) over the
    prediction."""
    if prediction is None or not step_seconds:
        return {}, None
    steady = step_seconds[1:] or step_seconds
    measured = statistics.median(steady)
    ratio = measured / prediction.predicted_s if prediction.predicted_s > 0 else float("nan")
    keys = {"predicted_step_s": prediction.predicted_s, "step_bound_by": prediction.bound_by,
            "median_step_s": measured, "measured_over_predicted": ratio}
    return keys, (f"step: median {measured:.3g} s (after the first), predicted {prediction.predicted_s:.3g} s "
                  f"(bound by {prediction.bound_by}): measured / predicted {ratio:.2f}")

"""Dynamic loss scaling for fp16: the scale doubles after a window of clean
steps and halves (after ``hysteresis`` overflows) when gradients overflow; an
overflowing step is skipped."""

from __future__ import annotations

from infinity.config.sections import LossScaleConfig


class LossScaler:
    def __init__(self, config: LossScaleConfig):
        self.dynamic = config.loss_scale == 0
        self.scale = float(2 ** config.initial_scale_power) if self.dynamic else float(config.loss_scale)
        self.applied_scale = self.scale
        self._window = config.loss_scale_window
        self._hysteresis = config.hysteresis
        self._min = config.min_loss_scale
        self._clean_steps = 0
        self._overflows_left = config.hysteresis

    def update(self, *, overflow: bool) -> bool:
        """Record this step's outcome; True when the step should be applied."""
        self.applied_scale = self.scale
        if not self.dynamic:
            return not overflow
        if overflow:
            self._clean_steps = 0
            self._overflows_left -= 1
            if self._overflows_left <= 0:
                self.scale = max(self.scale / 2, self._min)
                self._overflows_left = self._hysteresis
            return False
        self._clean_steps += 1
        if self._clean_steps % self._window == 0:
            self.scale *= 2
            self._overflows_left = self._hysteresis
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "overflows_left": self._overflows_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._overflows_left = int(state["overflows_left"])

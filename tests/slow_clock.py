"""A machine many times slower, as headlab's clocks see it: for the tests that budgets in tokens and steps give the
same results whatever the speed, and that minute caps stop cleanly."""

from __future__ import annotations

import sys
import time


class ScaledClock:
    """A `time` module whose clocks run `factor` times faster than the real ones (time.sleep and the rest stay
    real); `factor` may be changed while it is in use."""

    def __init__(self, factor: float):
        self.factor, self.origin = factor, time.perf_counter()

    def perf_counter(self) -> float:
        return self.origin + (time.perf_counter() - self.origin) * self.factor

    def time(self) -> float:
        return time.time() + (time.perf_counter() - self.origin) * (self.factor - 1)

    def __getattr__(self, name):
        return getattr(time, name)


def slow_machine(monkeypatch, factor: float) -> ScaledClock:
    """Every loaded headlab module that reads the clock sees a machine `factor` times slower; returns the clock."""
    clock = ScaledClock(factor)
    for name, module in list(sys.modules.items()):
        if name.startswith("headlab") and getattr(module, "time", None) is time:
            monkeypatch.setattr(module, "time", clock)
    return clock

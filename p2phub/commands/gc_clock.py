"""The cycle collector's time inside a timed span, for the benches: a method that allocates
an object per request pays for collections of the whole process's heap, and that cost belongs
in its figures, said apart from the rest."""

from __future__ import annotations

import gc
import time
from typing import Any


class GcClock:
    """Time the cycle collector ran (every generation) while installed: a method's run that
    allocates an object per request pays for collections of the whole process's heap (the
    report's gc_ms per method and run)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0          # collections of the oldest generation
        self._t0 = 0.0

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.full += info.get("generation") == 2

    def __enter__(self) -> "GcClock":
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._cb)

"""StepGate: lets another thread stop the generation loop at a step boundary (pause), act on the
scheduler, then let it go on (resume). The loop runs each step inside `gate.step()`; so does
anything else that touches the scheduler from another thread (an abort): one at a time."""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator


class StepGate:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._paused = 0  # nested pauses (e.g. the controller pausing, then an update)
        self._in_step = False
        self._queued = 0  # exclusive() callers waiting: they go before the next step

    @property
    def paused(self) -> bool:
        return self._paused > 0

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        with self._cv:
            self._cv.wait_for(lambda: self._paused == 0 and not self._in_step and not self._queued)
            self._in_step = True
        try:
            yield
        finally:
            self._leave()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Act on the scheduler between two steps, ahead of the next one (a loop of steps would
        otherwise take the gate back first, every time)."""
        with self._cv:
            self._queued += 1
            try:
                self._cv.wait_for(lambda: self._paused == 0 and not self._in_step)
            finally:
                self._queued -= 1
            self._in_step = True
        try:
            yield
        finally:
            self._leave()

    def _leave(self) -> None:
        with self._cv:
            self._in_step = False
            self._cv.notify_all()

    def pause(self) -> None:
        """Returns once no step is running; none starts until a matching resume()."""
        with self._cv:
            self._paused += 1
            self._cv.wait_for(lambda: not self._in_step)

    def resume(self) -> None:
        with self._cv:
            self._paused = max(0, self._paused - 1)
            self._cv.notify_all()

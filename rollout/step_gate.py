"""StepGate: one holder of the scheduler at a time, and a pause at a step boundary.

The generation loop runs each step inside `gate.step()`. Anything else that acts on the
scheduler — an abort from another thread, a pause's drain / abort / retract, the clean-up of a
call that ended early — runs inside `gate.exclusive()`, which goes between two steps ahead of
the next one (a loop of steps would otherwise take the gate back first, every time) and does not
wait for a pause to end: a pause stops steps, not other holders, so a thread that paused can act
on the scheduler itself. `pause()` returns once no one holds the gate; no step starts until a
matching `resume()` (from any thread: a controller pauses and resumes with two Ray calls)."""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional


class StepGate:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._paused = 0  # nested pauses (e.g. the controller pausing, then an update)
        self._holder: Optional[int] = None  # the thread running a step or an exclusive block
        self._depth = 0  # its nested exclusive blocks
        self._queued = 0  # exclusive() callers waiting: they go before the next step

    @property
    def paused(self) -> bool:
        return self._paused > 0

    @property
    def held_here(self) -> bool:
        """This thread is inside a step or an exclusive block."""
        return self._holder == threading.get_ident()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        with self._cv:
            self._cv.wait_for(lambda: self._paused == 0 and self._holder is None and not self._queued)
            self._holder, self._depth = threading.get_ident(), 1
        try:
            yield
        finally:
            self._release()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cv:
            if self._holder == me:  # nested: inside this thread's own step or block
                self._depth += 1
            else:
                self._queued += 1
                try:
                    self._cv.wait_for(lambda: self._holder is None)
                finally:
                    self._queued -= 1
                self._holder, self._depth = me, 1
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        with self._cv:
            self._depth -= 1
            if self._depth == 0:
                self._holder = None
                self._cv.notify_all()

    def pause(self) -> None:
        """Returns once no other thread holds the gate; no step starts until a matching resume()."""
        me = threading.get_ident()
        with self._cv:
            self._paused += 1
            try:
                self._cv.wait_for(lambda: self._holder is None or self._holder == me)
            except BaseException:  # interrupted (Ctrl-C): not left paused
                self._paused = max(0, self._paused - 1)
                self._cv.notify_all()
                raise

    def resume(self) -> None:
        with self._cv:
            self._paused = max(0, self._paused - 1)
            self._cv.notify_all()

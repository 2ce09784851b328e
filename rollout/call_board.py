"""CallBoard: the generate calls in flight on one engine share its batch.

Why: agentic rollouts run every trajectory as its own task, each calling `agenerate` (or a
controller's `generate_async`) one turn at a time, dozens at once. Served one call after
another they would decode at batch 1; here every call's requests join the one scheduler, and
the calls' own threads take turns running its steps — for all of them — while they wait for
their samples. No thread of the engine's own: a call's thread steps only while it has nothing
to yield, so a caller that stops iterating leaves the stepping to the others.

- One thread steps at a time: the drive. A call with no finished sample waiting takes the drive
  if it is free, else waits until a sample of its own arrives or it is woken to take the drive.
  Each call waits on its own condition, woken only for its samples or for the drive (one caller
  at a time, first come first served): dozens of waiting calls cost nothing a step (a
  notify-all would wake every one of them at every step).
- Each finished request goes to its call (by request id); one whose call ended early (closed,
  failed) goes nowhere.
- A step that fails fails every call in flight with its error (the scheduler's state is reset:
  nothing of them reaches a later call).
- Calls are the board's shared users; `exclusive()` (releasing or resuming memory, a prefill
  outside generation) waits until no call is open and holds new ones back meanwhile."""
from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

from rollout.request import Request

logger = logging.getLogger(__name__)

WAIT_WARN_S = 30.0  # a caller waiting this long for exclusive use logs why, and again each time


@dataclass(eq=False)
class Call:
    """One generate call's requests: those not yet finished, and those finished but not yet
    taken by its thread (which waits on `wake`)."""
    unfinished: set[int]
    wake: threading.Condition
    finished: deque[Request] = field(default_factory=deque)
    error: Optional[BaseException] = None


class CallBoard:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)  # access: calls open, exclusive use
        self._owner: dict[int, Call] = {}  # request id -> its call, while unfinished
        self._driving = False
        self._waiting: dict[Call, None] = {}  # calls waiting on their `wake`, in arrival order
        self._open = 0  # calls inside `call()`
        self._exclusive = False
        self._exclusive_waiting = 0

    # ---- access -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """A generate call's use of the engine (shared with other calls)."""
        with self._cv:
            self._cv.wait_for(lambda: not self._exclusive and not self._exclusive_waiting)
            self._open += 1
        try:
            yield
        finally:
            with self._cv:
                self._open -= 1
                self._cv.notify_all()

    @contextlib.contextmanager
    def exclusive(self, what: str) -> Iterator[None]:
        """The engine alone, once no call is open; a wait that is long says for what (a call
        left open — a generate_iter not exhausted or closed, by this very thread: forever)."""
        waited = 0.0
        with self._cv:
            self._exclusive_waiting += 1
            try:
                while not self._cv.wait_for(lambda: not self._open and not self._exclusive,
                                            timeout=WAIT_WARN_S):
                    waited += WAIT_WARN_S
                    logger.warning("%s has waited %.0f s for this engine: %d generate call(s) "
                                   "hold it (a generate_iter not exhausted or closed?)", what,
                                   waited, self._open)
            finally:
                self._exclusive_waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cv:
                self._exclusive = False
                self._cv.notify_all()

    # ---- requests and their samples -----------------------------------------------------------
    def open(self, reqs: Sequence[Request]) -> Call:
        call = Call({r.rid for r in reqs}, threading.Condition(self._lock))
        with self._lock:
            for r in reqs:
                self._owner[r.rid] = call
        return call

    def close(self, call: Call) -> set[int]:
        """The call ends; returns the ids of its requests still unfinished (none if it ran out)."""
        with self._lock:
            for rid in call.unfinished:
                self._owner.pop(rid, None)
            left, call.unfinished = call.unfinished, set()
            self._waiting.pop(call, None)
            self._wake_a_driver()
            return left

    def deliver(self, finished: Sequence[Request]) -> None:
        with self._lock:
            for req in finished:
                call = self._owner.pop(req.rid, None)
                if call is not None:
                    call.unfinished.discard(req.rid)
                    call.finished.append(req)
                    call.wake.notify()

    def fail_all(self, error: BaseException) -> None:
        """A step failed: every call in flight ends with `error`."""
        with self._lock:
            for call in set(self._owner.values()):
                call.error = error
                call.wake.notify()
            self._owner.clear()

    def take_or_drive(self, call: Call) -> Optional[list[Request]]:
        """The call's finished requests, once it has some ([] once it has none left); or None:
        the caller now holds the drive and runs a step (then `release_drive`). Raises the error
        that ended the call."""
        with self._lock:
            while True:
                if call.finished:
                    out = list(call.finished)
                    call.finished.clear()
                    self._wake_a_driver()  # this thread goes off to yield
                    return out
                if call.error is not None:
                    raise call.error
                if not call.unfinished:
                    self._wake_a_driver()
                    return []
                if not self._driving:
                    self._driving = True
                    return None
                self._waiting[call] = None
                try:
                    call.wake.wait()
                finally:
                    self._waiting.pop(call, None)

    def release_drive(self) -> None:
        with self._lock:
            self._driving = False
            self._wake_a_driver()

    def _wake_a_driver(self) -> None:
        """The drive is free: wake the first waiting call that would take it (one with nothing
        of its own to take)."""
        if self._driving:
            return
        for call in self._waiting:
            if not call.finished and call.error is None and call.unfinished:
                call.wake.notify()
                return

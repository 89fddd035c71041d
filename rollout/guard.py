"""One caller at a time, and Ctrl-C only where it cannot tear the bookkeeping.

The engine is single-threaded by design: a second thread (or a callback re-entering the engine
from inside one of its calls) gets a RuntimeError saying so, instead of corrupting queues and
slot counts. A lock that serialised callers would hide the misuse and deadlock a re-entering
callback.

KeyboardInterrupt can arrive between any two bytecodes. While the engine changes its
bookkeeping it holds SIGINT and delivers it when the change is complete (microseconds later);
during a forward pass, where most of a step's time goes and nothing is changed, it is let
through at once and the step is rolled back. Only the main thread receives signals, so only it
swaps handlers; a handler installed by other code is restored and called as it would have been.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class EngineGuard:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: tuple[str, str] | None = None  # (call, thread name)
        self._previous = None  # the SIGINT handler while holding
        self._caught = False

    @contextlib.contextmanager
    def exclusive(self, call: str) -> Iterator[None]:
        if not self._lock.acquire(blocking=False):
            busy, thread = self._busy or ("?", "?")
            raise RuntimeError(
                f"{call}: the engine is busy in {busy} (thread {thread!r}); it is "
                f"single-threaded: call it from one thread at a time, and not from callbacks "
                f"it runs")
        self._busy = (call, threading.current_thread().name)
        try:
            yield
        finally:
            self._busy = None
            self._lock.release()

    @contextlib.contextmanager
    def hold_interrupts(self) -> Iterator[None]:
        """SIGINT arriving inside the block is delivered when it ends."""
        if self._previous is not None or not _can_swap():
            yield
            return
        self._previous, self._caught = signal.getsignal(signal.SIGINT), False
        signal.signal(signal.SIGINT, self._catch)
        try:
            yield
        finally:
            previous, self._previous = self._previous, None
            signal.signal(signal.SIGINT, previous)
            if self._caught:
                self._caught = False
                _deliver(previous)

    @contextlib.contextmanager
    def allow_interrupts(self) -> Iterator[None]:
        """Inside a held block: SIGINT raises at once (one held so far is delivered now)."""
        previous = self._previous
        if previous is None:
            yield
            return
        signal.signal(signal.SIGINT, previous)
        try:
            if self._caught:
                self._caught = False
                _deliver(previous)
            yield
        finally:
            signal.signal(signal.SIGINT, self._catch)

    def _catch(self, signum, frame) -> None:
        self._caught = True


def _can_swap() -> bool:
    return (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is not None)  # None: set outside Python


def _deliver(handler) -> None:
    if callable(handler):
        handler(signal.SIGINT, None)
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signal.SIGINT)

"""One caller at a time, and Ctrl-C only where it cannot tear the bookkeeping.

The engine is single-threaded by design: a second thread (or a callback re-entering the engine
from inside one of its calls) gets a RuntimeError saying so, instead of corrupting queues and
slot counts. A lock that serialised callers would hide the misuse and deadlock a re-entering
callback.

KeyboardInterrupt can arrive between any two bytecodes. For the whole of a call the engine
installs its own SIGINT handler, which holds an interrupt while bookkeeping changes and
delivers it when the call's results are safe (before they are committed, or as the call
ends); during a forward pass, where most of a step's time goes and nothing is changed, it lets
it through at once and the step is rolled back. The handler stays installed for the whole call
and only a flag opens the let-through window, so an interrupt landing on the way into or out of
any block (Python checks for signals at every call, `__exit__` included) still meets the
engine's handler. Only the main thread receives signals, so only it swaps handlers; a handler
installed by other code is restored and called as it would have been.
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
        self._caught = False  # an interrupt is held
        self._letting = False  # inside a let-through window

    @contextlib.contextmanager
    def exclusive(self, call: str) -> Iterator[None]:
        """Run inside hold_interrupts(): a Ctrl-C between taking and releasing the lock must
        not leave it taken."""
        if not self._lock.acquire(blocking=False):
            busy, thread = self._busy or ("?", "?")
            raise RuntimeError(
                f"{call}: the engine is busy in {busy} (thread {thread!r}); it is "
                f"single-threaded: call it from one thread at a time, and not from callbacks "
                f"it runs")
        try:
            self._busy = (call, threading.current_thread().name)
            yield
        finally:
            self._busy = None
            self._lock.release()

    @contextlib.contextmanager
    def hold_interrupts(self) -> Iterator[None]:
        """SIGINT arriving inside the block is held, and delivered when it ends (or earlier by
        `deliver_held`)."""
        if self._previous is not None or not _can_swap():
            yield
            return
        self._caught = self._letting = False
        previous = signal.getsignal(signal.SIGINT)
        # signal.signal runs handlers of signals already pending, under the old handler: an
        # interrupt raised there leaves nothing half done.
        signal.signal(signal.SIGINT, self._catch)
        self._previous = previous
        try:
            yield
        finally:
            self._previous, self._letting = None, False
            signal.signal(signal.SIGINT, previous)  # pending ones still reach _catch first
            if self._caught:
                self._caught = False
                _deliver(previous)

    def deliver_held(self) -> None:
        """Deliver a held interrupt now: before a call commits what a raise must not lose."""
        if self._caught and self._previous is not None:
            self._caught = False
            _deliver(self._previous)

    @contextlib.contextmanager
    def allow_interrupts(self) -> Iterator[None]:
        """Inside a held block: SIGINT raises at once (one held so far is delivered now)."""
        self.deliver_held()
        self._letting = True
        try:
            yield
        finally:
            self._letting = False

    def _catch(self, signum, frame) -> None:
        if self._letting:
            # Unwinding from here on (a rollback) is bookkeeping again: hold the next one.
            self._letting = False
            _deliver(self._previous)
        else:
            self._caught = True


def _can_swap() -> bool:
    return (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is not None)  # None: set outside Python


def _deliver(handler) -> None:
    if callable(handler):
        handler(signal.SIGINT, None)
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signal.SIGINT)

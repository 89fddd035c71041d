"""Where a multi-turn run's environment calls run (rollout/agent.py): synchronous methods on a
pool of daemon threads, coroutines on event loops of their own.

- A synchronous call takes a free pool thread. The threads are daemons: a call that never
  returns (a hung tool, given up on at env_timeout) keeps neither the run nor the process from
  ending, as a ThreadPoolExecutor's would (the interpreter joins those at exit).
- An environment's coroutines all run on one loop, always the same (its reset and every step):
  what reset makes that is bound to a loop (a client session, a lock, a subprocess) works in
  the steps. There are as many loops as pool threads, each on a thread of its own, the
  environments spread over them: an async step that blocks (a synchronous client inside
  async code) stalls the environments that share its loop, not all of them. A coroutine that
  outlives env_timeout is cancelled. The loops are the run's own, whatever loop the caller
  runs (a notebook's).
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from concurrent.futures import Future

# Seconds the end of a run waits for cancelled coroutines to unwind, all loops together (a
# coroutine that catches its cancellation and goes on, or one that blocks its loop, is left to
# its loop's daemon thread).
CLOSE_WAIT = 5.0


class EnvCalls:
    def __init__(self, workers: int) -> None:
        self.pool = _DaemonPool(workers)
        self.loops: list[_Loop | None] = [None] * workers

    def call(self, slot: int, method, *args) -> Future:
        """`method(*args)` under way for the environment of `slot` (any int: its loop is slot
        modulo the loops). The future's `started` is when the call began running (None while
        a synchronous one waits for a free pool thread): env_timeout counts from there."""
        loop = self._loop(slot)
        if inspect.iscoroutinefunction(method):
            future = loop.submit(_awaited(method, *args))
            future.started = time.monotonic()
            return future
        return self.pool.submit(loop.call, method, *args)

    def abandoned(self) -> None:
        """A synchronous call given up on runs on in its thread: the pool gets a thread more,
        so that calls queued behind it still run (and can time out)."""
        self.pool.grow()

    def _loop(self, slot: int) -> _Loop:
        i = slot % len(self.loops)
        if self.loops[i] is None:  # (made on the run's thread only: no race)
            self.loops[i] = _Loop(i)
        return self.loops[i]

    def close(self, wait: bool) -> None:
        """Cancel the coroutines still running (a failed run's), then, with `wait`, let the
        synchronous calls under way finish; queued ones are cancelled. The loops unwind
        together, CLOSE_WAIT at most for all: a loop that a blocking coroutine holds answers
        nothing, and each in turn would cost the run its own wait."""
        loops = [loop for loop in self.loops if loop is not None]
        for loop in loops:
            loop.stop()
        deadline = time.monotonic() + CLOSE_WAIT
        for loop in loops:
            loop.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self.pool.shutdown(wait)


async def _awaited(method, *args):
    """A coroutine function's call made on its loop: one that fails as it is called (arguments
    it does not take) fails its future, as a synchronous method's does, not the caller."""
    return await method(*args)


class _DaemonPool:
    """Up to `workers` daemon threads taking calls from a queue (concurrent.futures' executor
    without its join at interpreter exit), each started when a call finds none idle."""

    def __init__(self, workers: int) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.workers, self.threads = workers, []
        self.idle = 0  # threads done with their last call, not yet handed another
        self.lock = threading.Lock()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        future.started = None  # (set when a thread takes it)
        self.queue.put((future, fn, args))
        with self.lock:  # an idle thread takes it, else a new one while there is room
            if self.idle:
                self.idle -= 1
            else:
                self._start_thread()
        return future

    def grow(self) -> None:
        """One thread more allowed (one is stuck in a call given up on), started at once."""
        with self.lock:
            self.workers += 1
            self._start_thread()

    def _start_thread(self) -> None:
        """(under the lock) A thread more while there is room."""
        if len(self.threads) < self.workers:
            thread = threading.Thread(target=self._work, daemon=True,
                                      name=f"rollout-env-{len(self.threads)}")
            self.threads.append(thread)
            thread.start()

    def _work(self) -> None:
        while (item := self.queue.get()) is not None:
            future, fn, args = item
            future.started = time.monotonic()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # the caller reads it from the future
                    future.set_exception(e)
            with self.lock:
                self.idle += 1

    def shutdown(self, wait: bool) -> None:
        while True:  # what has not started is cancelled
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self.threads:
            self.queue.put(None)
        if wait:
            for thread in self.threads:
                thread.join()


class _Loop:
    """An event loop on a daemon thread of its own."""

    def __init__(self, index: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.closing = False
        self.thread = threading.Thread(target=self._run, name=f"rollout-env-loop-{index}",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                self.loop.run_forever()
                break
            except (KeyboardInterrupt, SystemExit):
                # A coroutine raised it: asyncio sets it on the task and raises it out of the
                # loop too. Ended here, the loop would never hand it to the caller's future (a
                # callback of the next iteration does), nor serve its other environments: run
                # on, and the caller raises it. (Unless stop() stopped the loop meanwhile:
                # the stop is lost with the iteration.)
                if self.closing:
                    break
        # On the loop's own thread: a loop that a blocking coroutine holds past the end of the
        # run unwinds and closes when it is let go, the run not waiting for it.
        self._cancel_rest()
        self.loop.close()

    def _cancel_rest(self) -> None:
        """(The loop stopped) Cancel what still runs and let it unwind; a coroutine that will
        not stop keeps this daemon thread."""
        rest = asyncio.all_tasks(self.loop)
        for task in rest:
            task.cancel()
        if rest:
            try:
                self.loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))
            except (KeyboardInterrupt, SystemExit):  # raised as it was cancelled: the run,
                pass                                 # which would take it, has ended

    def submit(self, coroutine) -> Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def call(self, method, *args):
        """A method's result, on a pool thread: a coroutine it returns awaited on the loop."""
        result = method(*args)
        return self.submit(result).result() if inspect.iscoroutine(result) else result

    def stop(self) -> None:
        """Stop the loop: its thread then cancels what still runs, and closes it."""
        self.closing = True
        self.loop.call_soon_threadsafe(self.loop.stop)

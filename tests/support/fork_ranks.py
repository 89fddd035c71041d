"""Fork W CPU ranks of one gloo world and wait for them (tests/support/tp_launch.py,
tests/support/recipes_tp_launch.py). Forked, not spawned: the heavy imports happen once in the parent;
on a 2-core CI machine W fresh interpreters importing torch and transformers would take longer
than the tests. A rank that fails makes the others stop: they would wait on it forever."""

import multiprocessing as mp
import socket
import time


def fork_ranks(target, world: int, args: tuple, timeout: float) -> int:
    """Run target(rank, world, port, *args) in `world` forked processes (`port`: a free local
    TCP port for the rendezvous); the largest absolute exit code, 0 when all succeeded."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs):
        failed = any(p.exitcode not in (None, 0) for p in procs)
        if failed or time.monotonic() > deadline:
            for p in procs:
                if p.is_alive():
                    p.kill()
            break
        time.sleep(0.1)
    for p in procs:
        p.join()
    return max(abs(p.exitcode) for p in procs)

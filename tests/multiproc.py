"""Run a function in several torch.distributed processes from a pytest test.

``spawn(fn, world_size, *args)`` starts ``world_size`` processes, gives each the caller's environment plus
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (a free port) and
``OMP_NUM_THREADS=1``, calls ``fn(rank, world_size, *args)`` and returns the per-rank return values
(index = rank). ``fn`` must be a module-level function and its return value picklable. Any exception, a
non-zero exit or the timeout fails the test with every rank's traceback. Tests using it are marked
``multiprocess``.

Without CUDA the processes are forks of a ``forkserver`` that imported torch, megatron-core, transformers and
the actor once per test session (:data:`PRELOAD`); a fresh interpreter spends ~8-10 s of CPU on those imports
(2-core machine), for every rank of every call. With CUDA they are fresh interpreters (``spawn``): an import
may query the driver, and a process forked after that cannot use CUDA.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable

__all__ = ["spawn", "free_port", "MultiprocessFailure"]

# What every rank imports anyway; the fork server imports it once, before it forks any rank.
PRELOAD = ["torch", "torch.distributed", "megatron.core", "transformers", "megatron_gigpo.actor.policy"]

_GRACE_AFTER_FAILURE_S = 5.0


class MultiprocessFailure(AssertionError):
    """One or more spawned ranks raised, crashed or timed out."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _context():
    import torch

    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: at the session's first spawn
    return ctx


def _child(fn: Callable, rank: int, world_size: int, port: int, args: tuple, results: Any,
           environ: dict[str, str]) -> None:
    os.environ.clear()  # a fork server's child has the server's environment, not the caller's
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    try:
        import torch

        torch.set_num_threads(1)
        value = fn(rank, world_size, *args)
        # Pickle here with the plain pickler: multiprocessing's ForkingPickler would pass tensors
        # through shared memory that vanishes when this process exits.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # report everything, including SystemExit from argparse-style code
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def spawn(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the values by rank.

    Raises:
        MultiprocessFailure: a rank raised (its traceback is in the message), exited non-zero without
            reporting, or the ranks did not all finish within ``timeout`` seconds.
    """
    __tracebackhide__ = True  # show the ranks' tracebacks, not this loop
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    # Not daemonic: ranks may start processes of their own (dist_checkpointing's torch_dist writer starts a
    # multiprocessing manager and writer processes, which daemonic processes may not have). The ``finally``
    # below kills any rank still alive, so none outlives the call.
    procs = [
        ctx.Process(target=_child, args=(fn, rank, world_size, port, args, results, dict(os.environ)), daemon=False)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    first_error_time: float | None = None
    try:
        while len(values) + len(errors) < world_size:
            now = time.monotonic()
            if now > deadline:
                errors.setdefault(-1, f"timed out after {timeout:.0f} s")
                break
            if first_error_time is not None and now > first_error_time + _GRACE_AFTER_FAILURE_S:
                break  # the other ranks are probably stuck in a collective with the failed one
            try:
                rank, status, payload = results.get(timeout=0.2)
            except queue.Empty:
                for rank, proc in enumerate(procs):
                    reported = rank in values or rank in errors
                    if not reported and proc.exitcode not in (None, 0):
                        errors[rank] = f"exited with code {proc.exitcode} without reporting"
                if errors and first_error_time is None:
                    first_error_time = time.monotonic()
                continue
            if status == "ok":
                values[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                if first_error_time is None:
                    first_error_time = time.monotonic()
    finally:
        for proc in procs:
            proc.join(timeout=10 if not errors else 1)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        results.close()
    if errors:
        report = "\n".join(f"--- rank {rank} ---\n{text}" for rank, text in sorted(errors.items()))
        raise MultiprocessFailure(f"{fn.__name__} failed on {world_size} processes:\n{report}")
    return [values[rank] for rank in range(world_size)]

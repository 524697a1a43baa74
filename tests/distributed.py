"""Run a function on several real processes over gloo/loopback, with bounded timeouts.

Usage in a test::

    results = run_ranks(_worker, world_size=2, args=(...,))

``_worker(rank, world_size, *args)`` must be a module-level function; it runs after
``init_process_group("gloo")`` and its (picklable) return value is collected per rank.
Any exception on any rank fails the call with that rank's traceback; a rank that does not
finish within ``timeout`` seconds is killed and the call fails — nothing hangs.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

from geofp8.tools.train.launch import end_process_group

COLLECTIVE_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what the server imports once: torch (2 s of CPU a process here, most of a short test's time)
# and transformers' Llama, which every trainer and framework rank builds (another 2 s); this
# module, GeoFP8 with it, and pytest, which a rank imports to take its worker from a test
# module (a quarter of a CPU-s a rank); a module that is not installed is skipped. Their
# import-time settings are the server's (GeoFP8's one: the TRITON_INTERPRET of the process
# that started the server, tests/interpreted.py's child or the suite, which never sets it).
PRELOAD = ["torch", "torch.distributed", "transformers.models.llama.modeling_llama",
           "distributed", "pytest"]


def _context():
    """Ranks are forked from a server that has imported ``PRELOAD`` once, not spawned
    afresh; each still starts from a clean single-threaded process, and takes the caller's
    environment as it is now (_entry)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(rank, world_size, port, fn, args, queue, environ):
    os.environ.clear()  # the caller's, not the server's from when it started
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import torch
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        # plain pickle sends tensors by value; torch's queue would share memory that dies
        # with this process before the parent reads it
        result = pickle.dumps(fn(rank, world_size, *args))
        end_process_group(completed=True)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        end_process_group(completed=False)  # a no-op once the group is gone


def run_ranks(fn, world_size: int, args: tuple = (), timeout: float = 120.0) -> list:
    ctx = _context()
    queue = ctx.Queue()
    port = _free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, environ),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(results) + len(errors) < world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                raise TimeoutError(f"ranks did not finish within {timeout}s "
                                   f"(finished: {sorted(results)})")
            try:
                rank, status, value = queue.get(timeout=min(remaining, 1.0))
            except Exception:  # queue.Empty: check for ranks that died without reporting
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in results]
                if dead and queue.empty():
                    raise RuntimeError(f"rank(s) {dead} died with exit codes "
                                       f"{[procs[r].exitcode for r in dead]}") from None
                continue
            if status == "ok":
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError("\n".join(errors))
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


def scratch_dir() -> str:
    return tempfile.mkdtemp(prefix="geofp8-test-")


def train_in_process(rank, world_size, configs) -> list[str]:
    """``geofp8 train`` of each config in turn on this rank (what a launched rank runs); the
    messages of its warnings."""
    import warnings

    from geofp8.tools.train.loop import train

    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))  # as torchrun
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for cfg in configs:
            train(cfg)
    return [str(w.message) for w in caught]


def train_skipping(ddp, model, rank: int, steps: int, bad: int, width: int,
                   after_step=None) -> None:
    """``steps`` SGD steps (lr 0.1) of ``ddp`` (wrapping ``model``) on squared outputs of
    seeded inputs ``[8, width]``; at step ``bad`` rank 1's first layer's gradient is NaN, so
    the step is skipped on every rank (no optimizer step where a gradient is not finite);
    ``after_step(step)`` after each."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        handle = model[0].weight.register_hook(lambda g: g * float("nan")) \
            if step == bad and rank == 1 else None
        x = torch.randn(8, width, generator=torch.Generator().manual_seed(step + 10 * rank))
        ddp(x).pow(2).mean().backward()
        if all(bool(p.grad.isfinite().all()) for p in model.parameters()):
            opt.step()
        opt.zero_grad()
        if handle is not None:
            handle.remove()
        if after_step is not None:
            after_step(step)

"""``--nproc N``: launch ``geofp8 train`` on N local processes with ``torchrun``."""

from __future__ import annotations

import gc
import logging
import os
import socket
import subprocess
import sys

import torch.distributed as dist

__all__ = ["end_process_group", "exit_rank", "free_port", "in_launched_process", "launch"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_launched_process() -> bool:
    """True inside a process started by torchrun (or any launcher that sets RANK)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(nproc: int, train_argv: list[str], timeout: float | None = None) -> int:
    """Run ``python -m torch.distributed.run --nproc_per_node N -m geofp8.tools.cli train ...``
    on this machine and return its exit status (``torchrun`` stops every rank when one
    fails; ``timeout`` bounds the whole launch)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--nnodes=1", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           "-m", "geofp8.tools.cli", "train", *train_argv]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    try:
        return subprocess.run(cmd, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return 124


def end_process_group(completed: bool) -> None:
    """Tear the default process group down: a barrier first when this rank ``completed``
    (no rank destroys its group while a peer still uses it; skipped on failure, where a
    peer may never arrive), then a garbage collection, then ``destroy_process_group``.

    The collection frees reference cycles (modules, hooks, futures) that may still hold
    gloo work while the interpreter is whole: a worker thread that first touches Python
    during interpreter shutdown aborts the process ("terminate called without an active
    exception") after a run that had finished."""
    if not dist.is_initialized():
        return
    try:
        if completed:
            dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()


def exit_rank(status: int = 0):
    """End a launched rank's process now, after its process group is gone: flush the
    streams and the logging handlers, then ``os._exit`` — no interpreter shutdown. During
    that shutdown a gloo worker thread that still has to release a Python-owned tensor
    takes the GIL and aborts the process (``terminate called without an active
    exception``, exit -6) after a run that had finished; seen rarely, at the end of
    trainer runs and of a Lightning run."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(status)

"""``--nproc N``: launch ``geofp8 train`` on N local processes with ``torchrun``, and report
what went wrong in them as one message.

A rank of such a launch that fails does not print its error: it writes it to the launch's
folder (:func:`geofp8.tools.errors.record_failure`, called by the ``geofp8`` command), and
torchrun runs quietly under this module's ``__main__`` (no log lines, no traceback of its
own). :func:`launch` then reads the folder: a usage error found by a rank (a corpus too short
for the model, say) is raised as :class:`~geofp8.tools.errors.UsageError`, one line and exit
status 2 like any other; any other error is printed once, the lowest failing rank's
traceback, with the ranks that had the same one.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

from ..errors import FAILURES_ENV, UsageError

__all__ = ["end_process_group", "exit_rank", "free_port", "in_launched_process", "launch",
           "report_failures"]

STOP_GRACE_S = 30.0  # after SIGTERM, before SIGKILL


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_launched_process() -> bool:
    """True inside a process started by torchrun (or any launcher that sets RANK)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(nproc: int, train_argv: list[str], timeout: float | None = None) -> int:
    """Run ``torchrun --nproc_per_node N -m geofp8.tools.cli train ...`` on this machine and
    return its exit status (``torchrun`` stops every rank when one fails; ``timeout`` bounds
    the whole launch: 124). A usage error in the ranks raises
    :class:`~geofp8.tools.errors.UsageError`; another failure is printed once
    (:func:`report_failures`)."""
    with tempfile.TemporaryDirectory(prefix="geofp8-ranks-") as failures:
        cmd = [sys.executable, "-m", __name__, f"--nproc_per_node={nproc}", "--nnodes=1",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}",
               "-m", "geofp8.tools.cli", "train", *train_argv]
        env = dict(os.environ, **{FAILURES_ENV: failures})
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        status = _wait(subprocess.Popen(cmd, env=env), timeout)
        if status != 0:
            report_failures(Path(failures))
    return status


def _wait(process: subprocess.Popen, timeout: float | None) -> int:
    """Exit status of ``process``; at the ``timeout`` it is asked to stop (torchrun passes
    SIGTERM on to the ranks), killed after :data:`STOP_GRACE_S`, and 124 returned."""
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        return 124


def report_failures(folder: Path) -> None:
    """What the failed ranks of a launch wrote into ``folder``: their usage errors raised as
    one :class:`UsageError` (distinct messages joined), else each distinct error's
    traceback printed once to stderr, from the lowest rank that had it."""
    records = sorted((json.loads(p.read_text()) for p in folder.glob("rank*.json")),
                     key=lambda r: r["rank"])
    usage = list(dict.fromkeys(r["message"] for r in records if r["usage"]))
    if usage:
        raise UsageError("; ".join(usage))
    by_error: dict[str, list[dict]] = {}
    for r in records:
        by_error.setdefault(r["traceback"].rstrip().splitlines()[-1], []).append(r)
    for same in by_error.values():
        ranks = [r["rank"] for r in same]
        also = f" (ranks {', '.join(map(str, ranks))}: the same error)" if len(ranks) > 1 else ""
        print(f"rank {ranks[0]} failed{also}:\n{same[0]['traceback']}", end="",
              file=sys.stderr)


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


def _torchrun(argv: list[str]) -> int:
    """``torchrun argv`` without its log lines or its own traceback when a rank fails (the
    ranks' errors are in ``$GEOFP8_RANK_FAILURES``, reported by :func:`launch`); a rank that
    died without writing one (a signal, an abort) is named here. Exit status: the first
    failed rank's (1 for a signal)."""
    os.environ["LOGLEVEL"] = "CRITICAL"  # read by torch.distributed.elastic's loggers at import
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    del os.environ["LOGLEVEL"]  # not the ranks'
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        if not any(Path(os.environ[FAILURES_ENV]).glob("rank*.json")):
            for rank, failure in sorted(e.failures.items()):
                how = (f"signal {failure.signal_name()}" if failure.exitcode < 0
                       else f"exit status {failure.exitcode}")
                print(f"rank {rank} ended with {how} and no error message", file=sys.stderr)
        return max(1, e.get_first_failure()[1].exitcode)
    except SignalException as e:  # stopped by the launcher's timeout
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(_torchrun(sys.argv[1:]))

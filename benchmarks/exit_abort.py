"""Stress reproduction of the abort at interpreter exit (issue 23): a plain user script that
initialises gloo, trains a few steps with GeoFP8 (DDP or FSDP2), calls
``destroy_process_group`` and returns — many times, several jobs at once, as a loaded CI
machine runs them. Counts the ranks that exit with anything but 0 (SIGABRT shows as -6:
"terminate called without an active exception").

    python benchmarks/exit_abort.py --runs 40 --jobs 3 --layout ddp

Each job is ``--nproc`` plain processes (no torchrun, so every rank's own exit status is
seen) on its own free local port. Prints one JSON line: runs, ranks, exit statuses counted
(``"hung"``: killed after :data:`JOB_TIMEOUT_S`), the stderr tail of the first failure, wall
seconds.

Measured before the fix (2 shared CPU cores, load average 1.5-5 from other work):

* ``--runs 60 --jobs 4 --layout ddp``: 120 ranks, 101 exited 0, 19 hung, none aborted;
* ``--runs 12 --jobs 4 --layout ddp``: 24 ranks, 22 exited 0, 2 hung;
* ``--runs 12 --jobs 4 --layout fsdp``: 24 ranks, all exited 0 (FSDP's reduce-scatter
  stops before the all-gather, in the calling thread: no Python callback on a gloo thread;
  HSDP's replica all-reduce does run ``done`` on one, not stressed here).

A hung rank's stacks (faulthandler, below) show the mechanism: the main thread has returned
from the user's function and is freeing its locals (the DDP model holds the last reference to
the gloo process group, whose destructor joins gloo's worker threads with the GIL held),
while a gloo worker thread is still inside GeoFP8's all-gather completion callback
(``Communicator._gather``'s ``done``, in ``Future.set_result``). ``set_result`` releases the
GIL while it runs the chained callbacks; the last of them completes the future DDP waits for,
so the main thread goes on, and the worker then waits for the GIL forever. If the process
group outlives the interpreter instead, the same worker needs the GIL during finalisation,
which ends a C++ thread by forced unwinding: ``terminate called without an active
exception``. The cause is any Python ``Future.then`` callback on a gloo thread whose future
completes what the main thread waits for (GeoFP8's DDP path had several). The fix
(:class:`geofp8.comm.collective.Communicator`, "Completion"): every result is completed on
the caller's thread, so no Python runs on gloo's. After it, ``--runs 40 --jobs 4 --layout
ddp`` (load average up to 12): 80 ranks, 80 exited 0, none hung, 475 s. Rerun later with
the same fix (load average 9-13 from two other sessions' tests):

* ``--runs 40 --jobs 3 --layout ddp``: 80 ranks, 78 exited 0, **2 hung**, none aborted, 346 s.
  The hung rank's Python stacks: the main thread at the line that called ``user_script``
  (it had returned and was freeing its locals, as before the fix), the other thread with no
  Python frame, so the hang is rarer but not gone; ``--native-stacks DIR`` (gdb) was added to
  see where such a thread waits;
* ``--runs 40 --jobs 4 --layout ddp --native-stacks DIR``: 80 ranks, 80 exited 0, 573 s (no
  hang, so no native stacks yet);
* ``--runs 40 --jobs 3 --layout fsdp --native-stacks DIR``: 80 ranks, 80 exited 0, 449 s.

A hung rank's native stacks (``--native-stacks``, quiet machine, ``--runs 20 --jobs 3
--layout ddp``: 40 ranks, 39 exited 0, 1 hung) found the remaining cause: gloo's
``ProcessGroupGloo::runLoop`` thread destroying an ``AsyncAllgatherWork`` whose tensor needed
the GIL to free its Python object (Python had let go of it first), while the main thread,
holding the GIL, joined that thread in ``~ProcessGroupGloo``. Fix:
:class:`geofp8.comm.group.DeviceGroup`
keeps the last few collectives' ``Work`` alive, so the last reference is Python's. After it:
``--runs 20 --jobs 3 --layout ddp``: 40 of 40 exited 0 (90 s); ``--runs 30 --jobs 3 --layout
ddp`` with tests running beside it: 60 of 60 (142 s).

The stacks of a hang before the first fix::

    Thread 0x00007f09fde126c0 (most recent call first):
      File ".../torch/futures/__init__.py", line 251 in set_result
      File ".../geofp8/comm/collective.py", line 113 in done
    Thread 0x00007f0a24c55b80 (most recent call first):
      File ".../benchmarks/exit_abort.py", line 110 in main
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

JOB_TIMEOUT_S = 120  # a job's ranks still running after this are killed and counted as hung


def user_script(layout: str, steps: int) -> None:
    """What a user writes: init, GeoFP8 on DDP or FSDP2, train, destroy, return."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from geofp8 import GeoFP8Config, GeoFP8State, fsdp, geofp8_hook

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    config = GeoFP8Config(k=4, min_dim=16, refresh_every=2, layers="all")
    if layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
        model.register_comm_hook(GeoFP8State(model.module, config), geofp8_hook)
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
        fsdp.enable(model, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        model(torch.randn(8, 64)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


_issued: set[int] = set()
_lock = threading.Lock()


def _free_port() -> int:
    """A free local port that no other job of this run was given (jobs start concurrently)."""
    with _lock:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _issued:
                _issued.add(port)
                return port


def native_stacks(pid: int, directory: str) -> None:
    """Every thread's native stack of the hung process ``pid`` (gdb), into
    ``directory/hung-<pid>.txt``: a thread with no Python frame shows where it waits."""
    os.makedirs(directory, exist_ok=True)
    try:  # attaching and reading torch's symbols takes minutes on a loaded machine
        out = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"],
                             capture_output=True, text=True, timeout=600)
        text = out.stdout + out.stderr
    except subprocess.TimeoutExpired as exc:
        text = f"gdb gave no stacks within {exc.timeout:.0f} s\n"
    with open(os.path.join(directory, f"hung-{pid}.txt"), "w") as f:
        f.write(text)


def run_job(nproc: int, layout: str, steps: int,
            stacks: str | None = None) -> list[tuple[int | str, str]]:
    """One job of ``nproc`` ranks: each rank's (exit status, or ``"hung"`` after
    :data:`JOB_TIMEOUT_S`, and stderr tail); ``stacks``: a folder for hung ranks' native
    stacks."""
    port = str(_free_port())
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                   WORLD_SIZE=str(nproc), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--worker", "--layout", layout, "--steps", str(steps)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + JOB_TIMEOUT_S
    results = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((p.returncode, err[-1500:]))
        except subprocess.TimeoutExpired:
            if stacks is not None:
                native_stacks(p.pid, stacks)
            p.kill()
            results.append(("hung", p.communicate()[1][-1500:]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40, help="jobs in all")
    parser.add_argument("--jobs", type=int, default=3, help="jobs at once")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per job")
    parser.add_argument("--layout", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--native-stacks", metavar="DIR",
                        help="write each hung rank's native stacks (gdb) into DIR")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # a hung rank prints every thread's Python stack before it is killed
        faulthandler.dump_traceback_later(JOB_TIMEOUT_S / 2, exit=False)
        user_script(args.layout, args.steps)
        return
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda _: run_job(args.nproc, args.layout, args.steps,
                                                  args.native_stacks), range(args.runs)))
    ranks = [r for job in results for r in job]
    failures = [f"{code}: {tail}" for code, tail in ranks if code != 0]
    print(json.dumps({"layout": args.layout, "runs": args.runs, "jobs_at_once": args.jobs,
                      "ranks": len(ranks),
                      "exit_statuses": dict(collections.Counter(c for c, _ in ranks)),
                      "first_failure": failures[0] if failures else None,
                      "wall_s": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()

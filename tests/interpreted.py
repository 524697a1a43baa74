"""A child Python run under Triton's interpreter (``TRITON_INTERPRET=1`` must be set before
the kernels are decorated, so the interpreter tests run their checks in a child process).

The children are CPU-bound for tens of seconds each and share nothing with the rest of the
suite, so a test declares its child once (``CHILD = Child([...])``) and marks itself
``@pytest.mark.child(CHILD)``: when collection ends, ``conftest.py`` queues the children of
the selected tests on one background lane (one child at a time, beside the tests: the
second core of a 2-core runner), and the test takes its child's lines when it runs. A child
the lane has not started yet when its test runs is run by the test itself, in the
foreground, as before. ``conftest.py`` runs the tests that take a child last, so the lane
runs their children beside the rest of the suite; it takes them from the last test's back
to the first while the tests, once there, reach theirs from the front: the two meet once,
so a test rarely waits on a child the lane runs."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading

CHILD_TIMEOUT_S = 600


class Child:
    """``python args…`` (``interpret``: under the interpreter, else with it off), ``path``
    put before this process's ``sys.path``, run at most once."""

    def __init__(self, args: list[str], cwd=None, path: tuple = (), interpret: bool = True):
        self.args, self.cwd, self.path, self.interpret = list(args), cwd, tuple(path), interpret
        self._claim = threading.Lock()  # held by whoever runs it
        self._done = threading.Event()
        self._outcome = None  # (returncode, stdout, stderr), or the exception it raised
        self._process = None

    def run(self) -> None:
        """Run it here unless it was claimed already (by the lane or a test)."""
        if not self._claim.acquire(blocking=False):
            return
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join([*map(str, self.path), *sys.path])
        if self.interpret:
            env["TRITON_INTERPRET"] = "1"
        try:
            with _GUARD:
                if _STOPPED:
                    raise RuntimeError("the test session has ended")
                self._process = subprocess.Popen(
                    [sys.executable, *self.args], env=env, cwd=self.cwd, text=True,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                out, err = self._process.communicate(timeout=CHILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.communicate()
                raise
            self._outcome = (self._process.returncode, out, err)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test that waits
            self._outcome = exc
        finally:
            self._done.set()

    def lines(self) -> list[str]:
        """Its stdout's lines, once it has exited 0 (run here if nobody has started it)."""
        self.run()
        self._done.wait()
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        returncode, out, err = self._outcome
        assert returncode == 0, err[-3000:]
        return out.strip().splitlines()


_GUARD = threading.Lock()  # a child is started, or the session ends, not both at once
_STOPPED: list[bool] = []
_LANE: queue.LifoQueue = queue.LifoQueue()  # the last queued first; None ends it at once
_QUEUED: list[Child] = []


def _lane() -> None:
    while (child := _LANE.get()) is not None:
        child.run()


def start(children) -> None:
    """Queue ``children`` (each once, in the tests' order) on the background lane, which
    runs the last queued first."""
    fresh = [c for c in dict.fromkeys(children) if c not in _QUEUED]
    idle = fresh and not _QUEUED
    for child in fresh:
        _QUEUED.append(child)
        _LANE.put(child)
    if idle:  # started once all are queued: it starts from the last
        threading.Thread(target=_lane, name="interpreter children", daemon=True).start()


def stop() -> None:
    """End the lane: no child starts from now on, a running one is killed."""
    with _GUARD:
        _STOPPED.append(True)
        for child in _QUEUED:
            if child._process is not None and child._process.poll() is None:
                child._process.kill()
    _LANE.put(None)


def run_child(args: list[str], cwd=None, path: tuple = (), interpret: bool = True) -> list[str]:
    """``python args…`` run now (:class:`Child`); asserts it exits 0 and returns its
    stdout's lines."""
    return Child(args, cwd, path, interpret).lines()

"""A child Python run under Triton's interpreter (``TRITON_INTERPRET=1`` must be set before
the kernels are decorated, so the interpreter tests run their checks in a child process)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_child(args: list[str], cwd=None, path: tuple = (), interpret: bool = True) -> list[str]:
    """``python args…`` (``interpret``: under the interpreter, else with it off), ``path``
    put before this process's ``sys.path``; asserts it exits 0 and returns its stdout's
    lines."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, path), *sys.path])
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()

"""What ``import geofp8`` (and so every ``geofp8`` command's start) costs beyond torch: no
``torch._dynamo`` (about 0.9 s of a 3 s start, imported by ``torch.compiler.disable`` at
class definition; ``torch._disable_dynamo`` imports it at the first call instead)."""

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def test_importing_the_cli_does_not_import_dynamo():
    code = ("import sys; import geofp8.tools.cli; "
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:3])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(SRC)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"

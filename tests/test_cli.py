"""The `geofp8` command answers a user's mistake as argparse does (`geofp8 <command>: error:
...`, exit status 2, no traceback) and keeps the traceback of anything else."""

import os
import subprocess
import sys

import pytest

from geofp8.tools import cli


@pytest.mark.parametrize("argv, message", [
    (["train", "--batch-size", "0"], "geofp8 train: error: TrainConfig: steps, seq_len and "
     "batch_size must be >= 1"),
    (["train", "--model", "no/such/model"], "geofp8 train: error: --model 'no/such/model' is "
     "neither a preset"),
    (["train", "--data", "no-such-file.txt"], "geofp8 train: error: --data: no such file: "
     "no-such-file.txt"),
    (["fidelity", "--model", "missing.gguf"], "geofp8 fidelity: error: --model missing.gguf: "
     "GGUF file not found"),
    (["compare", "--methods", "fp32,fp4"], "geofp8 compare: error: unknown method(s) fp4; "
     "choose from fp32"),
    (["demo", "--methods", "fp4"], "geofp8 demo: error: unknown method(s) fp4"),
])
def test_user_mistakes_exit_2_with_the_message(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main(argv + (["--out", str(tmp_path)] if argv[0] != "fidelity" else []))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and "Traceback" not in err


def test_other_errors_keep_their_traceback(monkeypatch):
    from geofp8.tools import train

    def bug(args):
        raise ValueError("a bug, not a usage error")

    monkeypatch.setattr(train, "run", bug)
    with pytest.raises(ValueError, match="a bug"):
        cli.main(["train"])


def test_the_installed_command_prints_one_line_and_exits_2():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.run([sys.executable, "-m", "geofp8.tools.cli", "train", "--batch-size", "0"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2
    assert p.stderr == "geofp8 train: error: TrainConfig: steps, seq_len and batch_size " \
                       "must be >= 1\n"

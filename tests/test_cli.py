"""The `geofp8` command answers a user's mistake as argparse does (`geofp8 <command>: error:
...`, exit status 2, one line, no traceback) before any work starts, keeps the traceback of
anything else, and reports what goes wrong inside the ranks of a local launch once."""

import json
import os
import subprocess
import sys

import pytest

from geofp8.tools import analysis, bench, cli, cluster
from geofp8.tools.errors import FAILURES_ENV, UsageError, record_failure
from geofp8.tools.train import VALUE_TYPES, TrainConfig, loop
from geofp8.tools.train.launch import report_failures

# (argv, what stderr says after "geofp8 <command>: error: "). The files named are made by
# the `workdir` fixture: a-directory/, empty-model/ (no config.json), short.txt (3 tokens).
MISTAKES = [
    # fidelity
    (["fidelity", "--data", "no-such-file.txt"], "argument --data: no such file: "
     "no-such-file.txt"),
    (["fidelity", "--data", "a-directory"], "argument --data: a-directory is a directory"),
    (["fidelity", "--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
    (["fidelity", "--formats", "e3m4"], "argument --formats: unknown 'e3m4'; choose from e4m3"),
    (["fidelity", "--scalings", "tensor,col"], "argument --scalings: unknown 'col'"),
    (["fidelity", "--transforms", "foo"], "argument --transforms: unknown 'foo'; choose from "
     "euclidean"),
    (["fidelity", "--ranks", "0"], "argument --ranks: must be >= 1, got 0"),
    (["fidelity", "--ranks", "3"], "--batch-size 8 must be a positive multiple of --ranks 3"),
    (["fidelity", "--ranks-k", "8,x"], "argument --ranks-k: 'x' is not an integer"),
    (["fidelity", "--dampings", "-1"], "argument --dampings: must be >= 0, got -1"),
    (["fidelity", "--model", "missing.gguf"], "--model missing.gguf: GGUF file not found"),
    (["fidelity", "--model", "empty-model"], "--model empty-model: the directory has no "
     "config.json"),
    # train
    (["train", "--nproc", "-1"], "argument --nproc: must be >= 1, got -1"),
    (["train", "--nproc", "0"], "argument --nproc: must be >= 1, got 0"),
    (["train", "--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
    (["train", "--steps", "x"], "argument --steps: 'x' is not an integer"),
    (["train", "--lr", "0"], "argument --lr: must be > 0, got 0"),
    (["train", "--val-fraction", "1"], "argument --val-fraction: must be in [0, 1), got 1"),
    (["train", "--lr", "1e-3", "--lr-min", "1e-2"], "TrainConfig: need 0 < lr_min <= lr"),
    (["train", "--method", "foo"], "argument --method: invalid choice: 'foo'"),
    (["train", "--data", "a-directory"], "argument --data: a-directory is a directory"),
    (["train", "--data", "no-such-file.txt"], "argument --data: no such file"),
    (["train", "--model", "no/such/model"], "--model 'no/such/model' is neither a preset"),
    (["train", "--model", "empty-model"], "--model empty-model: the directory has no "
     "config.json"),
    (["train", "--k", "0", "--method", "geofp8"], "argument --k: must be >= 1, got 0"),
    (["train", "--method", "budget"], "TrainConfig: --method budget needs --budget B"),
    (["train", "--method", "nvfp4-ef", "--format", "e5m2"], "TrainConfig: --format e5m2: "
     "method 'nvfp4-ef' fixes its own format"),
    (["train", "--parallel", "fsdp"], "TrainConfig: --parallel fsdp/hsdp needs --optimizer "
     "adamw"),
    (["train", "--parallel", "fsdp", "--method", "budget", "--budget", "1", "--optimizer",
      "adamw"], "TrainConfig: --method budget chooses formats per layer within a byte budget, "
     "which is DDP-only"),
    (["train", "--parallel", "fsdp", "--method", "powersgd", "--optimizer", "adamw"],
     "TrainConfig: --parallel fsdp runs the fp32 and GeoFP8 methods, not 'powersgd'"),
    (["train", "--parallel", "hsdp", "--optimizer", "adamw", "--shard-size", "3", "--nproc",
      "4"], "--shard-size 3 must divide the 4 ranks into at least 2 replicas"),
    (["train", "--hierarchy", "node", "--node-size", "3", "--nproc", "2"], "--node-size 3 "
     "must divide the 2 ranks"),
    pytest.param(["train", "--data", "short.txt", "--nproc", "2", "--steps", "2"],
                 "the corpus (3 tokens) is too short for one training block of 129 tokens "
                 "(--seq-len 128)", marks=[pytest.mark.distributed, pytest.mark.slow],
                 id="train-corpus-too-short-found-by-the-ranks"),
    # compare
    (["compare", "--methods", "fp32,fp4"], "argument --methods: unknown 'fp4'; choose from "
     "fp32"),
    (["compare", "--seeds", "0,a"], "argument --seeds: 'a' is not an integer"),
    (["compare", "--nproc", "0"], "argument --nproc: must be >= 1, got 0"),
    (["compare", "--run-timeout", "0"], "argument --run-timeout: must be > 0, got 0"),
    (["compare", "--nproc", "3", "--parallel", "hsdp", "--shard-size", "2", "--optimizer",
      "adamw"], "--shard-size 2 must divide the 3 ranks into at least 2 replicas"),
    # demo
    (["demo", "--nproc", "0"], "argument --nproc: must be >= 1, got 0"),
    (["demo", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["demo", "--methods", "fp4"], "argument --methods: unknown 'fp4'"),
    # bench
    (["bench", "--parts", "3", "--ddp-methods", "foo"], "argument --ddp-methods: unknown "
     "'foo'"),
    (["bench", "--parts", "9"], "argument --parts: unknown '9'; choose from 1, 2, 3, 4, 5"),
    (["bench", "--threads", "0"], "argument --threads: must be >= 1, got 0"),
    (["bench", "--ddp-steps", "0"], "argument --ddp-steps: must be >= 1, got 0"),
    (["bench", "--ddp-model", "huge"], "argument --ddp-model: invalid choice: 'huge'"),
    (["bench", "--sizes", "0"], "argument --sizes: must be > 0, got 0"),
    # cluster
    (["cluster", "--nproc", "1"], "argument --nproc: must be >= 2, got 1"),
    (["cluster", "--nproc", "9"], "--nproc must be in 2..8, got 9"),
    (["cluster", "--ranks-per-node", "3"], "--ranks-per-node 3 must divide the 4 ranks"),
    (["cluster", "--rates", "fast"], "argument --rates: cannot read the rate 'fast'"),
    (["cluster", "--rates", "1", "1g"], "--rates: a rate is repeated in 1 1g"),
]


def _started(*args, **kwargs):
    raise AssertionError("work started before the mistake was found")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A folder with the files the mistakes name; no training loop or measurement may
    start: a mistake is found before."""
    (tmp_path / "a-directory").mkdir()
    (tmp_path / "empty-model").mkdir()
    (tmp_path / "short.txt").write_text("Too short.\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))  # for a launch from there
    for owner, name in [(loop, "train"), (analysis, "run_fidelity"), (bench, "run_bench"),
                        (cluster, "run_comparison")]:
        monkeypatch.setattr(owner, name, _started)
    return tmp_path


@pytest.mark.parametrize("argv, message", MISTAKES,
                         ids=lambda v: "-".join(v)[:60] if isinstance(v, list) else "")
def test_user_mistakes_exit_2_with_one_line(argv, message, workdir, capsys, monkeypatch):
    if "short.txt" not in argv:  # found before any process starts (that one: by the ranks)
        monkeypatch.setattr(subprocess, "Popen", _started)
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith(f"geofp8 {argv[0]}: error: {message}"), err
    assert err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err


def test_every_numeric_train_flag_has_a_checked_type():
    """A new numeric TrainConfig field gets a VALUE_TYPES entry, else argparse would take
    any text for it."""
    from dataclasses import fields

    for f in fields(TrainConfig):
        default = getattr(TrainConfig(), f.name)
        if f.name in ("budget", "stop_after") or (isinstance(default, (int, float))
                                                   and not isinstance(default, bool)):
            assert f.name in VALUE_TYPES, f.name


def test_version(capsys):
    from geofp8 import __version__

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"geofp8 {__version__}\n"


def test_no_help_text_states_its_default_twice():
    parser = cli.build_parser()
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            text = formatter._expand_help(action) if action.help else ""
            assert text.count("(default") + text.count("; default") <= 1, (name, text)


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
    assert p.stderr == "geofp8 train: error: argument --batch-size: must be >= 1, got 0\n"


# -- the ranks of a local launch -------------------------------------------------------------

def test_a_rank_records_its_error_only_inside_a_launch(tmp_path, monkeypatch):
    monkeypatch.delenv(FAILURES_ENV, raising=False)
    assert not record_failure(UsageError("x"))  # not launched: the caller prints it
    monkeypatch.setenv(FAILURES_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    try:
        raise KeyError("a bug")
    except KeyError as e:
        assert record_failure(e)
    record = json.loads((tmp_path / "rank3.json").read_text())
    assert record["rank"] == 3 and not record["usage"] and "KeyError: 'a bug'" in \
        record["traceback"] and "Traceback" in record["traceback"]


def _record(folder, rank, error):
    try:
        raise error
    except Exception as e:
        os.environ["RANK"] = str(rank)
        assert record_failure(e)


def test_the_launcher_reports_each_distinct_error_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(FAILURES_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    for rank in (2, 0, 1):
        _record(tmp_path, rank, RuntimeError("the same bug"))
    _record(tmp_path, 3, KeyError("another"))
    report_failures(tmp_path)
    err = capsys.readouterr().err
    assert err.count("Traceback") == 2
    assert "rank 0 failed (ranks 0, 1, 2: the same error):\nTraceback" in err
    assert "rank 3 failed:\nTraceback" in err and err.rstrip().endswith("KeyError: 'another'")
    _record(tmp_path, 1, UsageError("too short"))  # a usage error is reported alone
    with pytest.raises(UsageError, match="^too short$"):
        report_failures(tmp_path)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_failure_in_every_rank_prints_one_traceback(tmp_path):
    """A bug (here: a model directory transformers cannot read) in a 2-rank launch: one
    traceback from the launcher, none per rank, none from torchrun; exit status 1."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.run([sys.executable, "-m", "geofp8.tools.cli", "train", "--model",
                        str(tmp_path / "model"), "--nproc", "2", "--out", str(tmp_path / "r")],
                       capture_output=True, text=True, env=env, timeout=180)
    assert p.returncode == 1, p.stderr
    assert p.stderr.startswith("rank ") and p.stderr.count("Traceback") == 1, p.stderr
    assert "Unrecognized model" in p.stderr.splitlines()[-1]
    assert "[rank" not in p.stderr and "ChildFailedError" not in p.stderr

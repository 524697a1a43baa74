"""The ``geofp8`` command. Each subcommand lives in its own module, which provides
``add_arguments(parser)`` and ``run(args) -> int``; this file only dispatches.

A mistake in what the user asked for (a flag's value, a model or file that does not exist)
is refused by argparse where a flag's type can tell (:mod:`geofp8.tools.flags`), else raised
as :class:`~geofp8.tools.errors.UsageError` wherever it is found and printed here as argparse
prints its own: ``geofp8 <command>: error: <message>``, exit status 2, no traceback. Every
other exception keeps its traceback: a bug or an environment problem. In a rank of
``geofp8 train --nproc N`` both are handed to the launcher instead, which reports them once
for all ranks (:mod:`geofp8.tools.train.launch`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .. import __version__
from .errors import RunFailed, UsageError, record_failure

# name -> (module, one-line help). Modules are imported lazily so `geofp8 --help` is fast.
COMMANDS: dict[str, tuple[str, str]] = {
    "fidelity": ("geofp8.tools.analysis", "one-step FP8 round-trip fidelity of every Linear "
                 "layer's gradient, per transform, format and scaling"),
    "train": ("geofp8.tools.train", "data-parallel Llama pretraining with a chosen gradient "
              "communication (fp32, bf16, fp8, fp8-ef, hadamard, geofp8, geofp8-auto, ...)"),
    "compare": ("geofp8.tools.train.compare", "train with several methods and seeds on the "
                "same data and write a report (report.md, loss.png, fidelity.png, results.json)"),
    "demo": ("geofp8.tools.demo", "the quick start: compare fp32, fp8, fp8-ef, geofp8 and "
             "geofp8-auto on a CPU-sized Llama with 2 ranks (under 7 minutes on 2 cores; timed "
             "first)"),
    "cluster": ("geofp8.tools.cluster", "time to loss on an emulated cluster: one network "
                "namespace per rank, links shaped to 1/10 Gbit/s (root, ip and tc), per method "
                "and rate, with the alpha-beta model's error and the overlap"),
    "bench": ("geofp8.tools.bench", "codec throughput, geometry overhead, whole DDP steps next to "
              "PyTorch's hooks, and the scaling model, measured as ratios in one run"),
}


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose error is one line: the usage it prints first (dozens of
    lines for ``geofp8 train``) hides the message; ``--help`` shows it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="geofp8", description="GeoFP8: geometry-aware FP8 gradient communication for "
        "PyTorch data-parallel training — fidelity analysis, reference training, benchmarks.",
        epilog="Start with `geofp8 demo` (a few minutes on a laptop); `geofp8 COMMAND --help` "
        "lists a command's flags.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module, _parser=p)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args._argv = argv  # the command as typed, for reports that quote it
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except Exception as e:
        status = 2 if isinstance(e, UsageError) else 1
        if record_failure(e):  # a launched rank: the launcher reports it, once for all ranks
            from .train.launch import exit_rank

            exit_rank(status)
        if isinstance(e, (UsageError, RunFailed)):
            args._parser.exit(status, f"{args._parser.prog}: error: {e}\n")
        raise


if __name__ == "__main__":
    sys.exit(main())

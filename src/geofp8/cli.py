"""The ``geofp8`` command. Each subcommand lives in its own module, which provides
``add_arguments(parser)`` and ``run(args) -> int``; this file only dispatches."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Modules are imported lazily so `geofp8 --help` is fast.
COMMANDS: dict[str, tuple[str, str]] = {
    "fidelity": ("geofp8.analysis", "one-step FP8 round-trip fidelity of every Linear layer's "
                 "gradient, per transform, format and scaling"),
    "demo": ("geofp8.demo", "a quick look: the fidelity summary on the default model and corpus"),
    "bench": ("geofp8.bench", "codec throughput, geometry overhead and the scaling model, "
              "measured as ratios in one run"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="geofp8", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

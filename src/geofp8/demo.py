"""``geofp8 demo``: the fidelity summary of the default model on the default corpus.

Until the training demo exists this is :mod:`geofp8.analysis` with its defaults, printed
as the summary tables only.
"""

from __future__ import annotations

import argparse

from .analysis import FidelityConfig, format_report, run_fidelity


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = FidelityConfig()
    parser.add_argument("--model", default=d.model,
                        help="preset, Hugging Face directory or .gguf file (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=d.seq_len)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)


def run(args: argparse.Namespace) -> int:
    config = FidelityConfig(model=args.model, seq_len=args.seq_len, batch_size=args.batch_size)
    print(format_report(run_fidelity(config), table="summary"))
    return 0

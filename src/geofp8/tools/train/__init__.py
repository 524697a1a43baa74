"""``geofp8 train``: data-parallel pretraining of a Llama with any ``--method``'s gradient
communication (see :mod:`geofp8.tools.train.loop`; methods in :data:`METHODS`).

Launch with ``torchrun --nproc_per_node N -m geofp8.tools.cli train ...`` (several nodes: the
usual torchrun flags), or let ``--nproc N`` start torchrun on this machine.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from ...comm import KERNELS
from ...feedback import STORAGES
from ..flags import at_least, fraction, text_file
from .config import METHODS, TrainConfig, make_comm_hook

__all__ = ["METHODS", "TrainConfig", "add_arguments", "check_inputs", "check_world",
           "config_from_args", "make_comm_hook", "run", "to_argv"]

HELP = {
    "model": "preset (llama-tiny, llama-small: CPU; llama-300m, llama-600m: paper scale) "
             "or a local Hugging Face model directory or .gguf file",
    "data": "local UTF-8 text files (default: the corpus that ships with Python)",
    "dataset": "a Hugging Face `datasets` name or a saved dataset directory (needs `datasets`)",
    "dataset_split": "split of --dataset",
    "text_column": "text column of --dataset",
    "dataset_max_chars": "read --dataset up to this many characters",
    "vocab_size": "BPE vocabulary trained on the corpus (presets)",
    "seq_len": "tokens per sequence",
    "batch_size": "sequences per rank and step",
    "val_fraction": "share of the blocks held out for validation (the last ones)",
    "steps": "optimizer steps (the schedule's length)",
    "stop_after": "stop after this many steps but keep the --steps schedule (to resume)",
    "optimizer": "muon: Muon on hidden 2-D weights + AdamW on the rest (the paper); adamw",
    "lr": "peak learning rate (paper: 5e-4)",
    "lr_min": "learning rate at the end of the cosine (paper: 5e-5)",
    "warmup": "linear warm-up steps",
    "weight_decay": "decoupled weight decay of matrices",
    "grad_clip": "clip the communicated gradient's global norm (0: off)",
    "method": "gradient communication: " + ", ".join(f"{k} ({v.description})"
                                                     for k, v in METHODS.items()),
    "format": "FP8 format of the fp8/hadamard/geofp8 methods: e4m3 or e5m2",
    "refresh_every": "GeoFP8 factor refresh period K (paper: 50)",
    "profile_steps": "steps of the geofp8 profile before its layers are fixed",
    "k": "GeoFP8 low-rank factor k (paper: 32)",
    "budget": "methods budget and budget-ef2: bytes per element per round trip (e4m3 1.0, "
              "nvfp4 0.5625); formats chosen per layer within it",
    "parallel": "ddp (DDP + comm hook), fsdp (fully_shard + FP8 reduce-scatter) or hsdp "
                "(replicate x shard mesh: FP8 reduce-scatter + FP8 replica all-reduce)",
    "shard_size": "hsdp: ranks per shard group (0: half the ranks)",
    "residual": "error-feedback storage: fp32 (4 B/param), bf16 (2), fp8 (1 + 4/row), "
                "nvfp4 (0.5625); default: GeoFP8Config's",
    "hierarchy": "ddp: auto (node when >= 2 nodes of >= 2 ranks), flat, or node (FP32 inside "
                 "a node, the exact low-precision collective between nodes)",
    "node_size": "ranks per node (0: torchrun's LOCAL_WORLD_SIZE); with --hierarchy node, "
                 "emulates nodes on one machine",
    "kernels": "how the exact collective's stages run (bit-identical): batched (a fixed number "
               "of whole-bucket kernels: accelerators), chunked (shard by shard in cache-sized "
               "pieces: CPUs) or auto (chunked on CPU)",
    "eval_every": "validation loss every E steps and at the end (0: never)",
    "eval_batches": "validation batches per rank",
    "shadow_every": "every M steps also all-reduce the local gradients in FP32 and log the "
                    "communicated gradient's per-layer RelL2 and cosine (0: off)",
    "log_every": "write every n-th step to log.jsonl (validation steps always)",
    "checkpoint_every": "checkpoint every C steps and at the end (0: never)",
    "out": "run directory: log.jsonl, run.json, checkpoint/",
    "resume": "continue from <out>/checkpoint if there is one",
    "seed": "model initialisation and data order",
    "threads": "torch threads per rank (0: cores / local ranks)",
    "timeout_s": "collective timeout in seconds",
    "quiet": "no progress bar",
}


def _default(f):
    return f.default_factory() if f.default is MISSING else f.default


# The value each numeric flag accepts (argparse refuses the rest before any work).
_COUNT, _SOME = at_least(1), at_least(0)
_POSITIVE, _NONNEGATIVE = at_least(0, float, above=True), at_least(0, float)
VALUE_TYPES = {
    **dict.fromkeys(("vocab_size", "seq_len", "batch_size", "steps", "stop_after",
                     "refresh_every", "profile_steps", "k", "eval_batches", "log_every",
                     "dataset_max_chars"), _COUNT),
    **dict.fromkeys(("warmup", "shard_size", "node_size", "eval_every", "shadow_every",
                     "checkpoint_every", "seed", "threads"), _SOME),
    **dict.fromkeys(("lr", "lr_min", "budget", "timeout_s"), _POSITIVE),
    **dict.fromkeys(("weight_decay", "grad_clip"), _NONNEGATIVE),
    "val_fraction": fraction,
}
CHOICES = {"method": list(METHODS), "optimizer": ["muon", "adamw"], "format": ["e4m3", "e5m2"],
           "parallel": ["ddp", "fsdp", "hsdp"], "residual": list(STORAGES),
           "hierarchy": ["auto", "flat", "node"], "kernels": list(KERNELS)}


def add_train_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per :class:`TrainConfig` field (``--seq-len`` for ``seq_len``)."""
    for f in fields(TrainConfig):
        if f.name in skip:
            continue
        flag, default = "--" + f.name.replace("_", "-"), _default(f)
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", help=HELP[f.name])
        elif isinstance(default, list):
            parser.add_argument(flag, nargs="*", default=default, metavar="PATH",
                                type=text_file, help=HELP[f.name])
        else:
            parser.add_argument(flag, type=VALUE_TYPES.get(f.name, str), default=default,
                                choices=CHOICES.get(f.name),
                                help=f"{HELP[f.name]} (default: %(default)s)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_train_arguments(parser)
    parser.add_argument("--nproc", type=_COUNT, default=None,
                        help="launch torchrun with this many local processes (default: none, "
                        "this process trains alone or as the rank torchrun started)")


def config_from_args(args: argparse.Namespace, **overrides) -> TrainConfig:
    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    return TrainConfig(**{**values, **overrides})


def check_inputs(cfg: TrainConfig) -> None:
    """What can be found wrong before any rank starts: a ``--model`` that is neither a
    preset nor a model directory or ``.gguf`` file, ``--data`` that names no file, a package
    the run needs and does not find (:class:`~geofp8.tools.errors.UsageError`)."""
    from ..errors import UsageError
    from ..models import check_model_spec
    from ..needs import require

    check_model_spec(cfg.model)
    require("training a Hugging Face Llama", "transformers", "tokenizers")
    if cfg.dataset:
        require("--dataset", "datasets")
    for path in cfg.data:
        try:
            text_file(path)
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"--data: {e}") from None


def check_world(cfg: TrainConfig, world: int) -> None:
    """What a launch on ``world`` ranks can be refused for before it starts: a
    ``--shard-size`` or ``--node-size`` that does not split them, a ``--resume`` from a
    checkpoint of another number of ranks (:class:`~geofp8.tools.errors.UsageError`)."""
    from ..errors import UsageError
    from . import checkpoint
    from .parallel import shard_size

    if cfg.parallel != "ddp":
        shard_size(cfg, world)
    if cfg.node_size and world % cfg.node_size:
        raise UsageError(f"--node-size {cfg.node_size} must divide the {world} ranks")
    if cfg.resume and (step := checkpoint.latest_step(cfg.out)) is not None:
        checkpoint.check_world(cfg.out, step, world)


def to_argv(cfg: TrainConfig) -> list[str]:
    """The ``geofp8 train`` flags that reproduce ``cfg`` (defaults left out)."""
    argv = []
    for f in fields(TrainConfig):
        value, flag = getattr(cfg, f.name), "--" + f.name.replace("_", "-")
        if value == _default(f) or value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, repr(value) if isinstance(value, float) else str(value)]
    return argv


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from .launch import exit_rank, in_launched_process, launch

    cfg = config_from_args(args)
    check_inputs(cfg)
    if args.nproc and not in_launched_process():
        check_world(cfg, args.nproc)
        return launch(args.nproc, to_argv(cfg))
    from .loop import train

    last = train(cfg)
    if last is not None and not cfg.quiet:
        val = f", validation loss {last['val_loss']:.4f}" if "val_loss" in last else ""
        print(f"step {last['step'] + 1}: loss {last['loss']:.4f}{val} -> {cfg.out}/log.jsonl")
    if in_launched_process() and not dist.is_initialized():  # our own group, torn down
        exit_rank(0)
    return 0

"""Peak memory of a training step, and every byte GeoFP8 adds to it, per model parameter.

One measured step (forward, backward, ``optimizer.step()``, ``zero_grad()``) of a Llama
preset from :mod:`geofp8.tools.models` (AdamW), after two warm-up steps, on rank 0 of a real
gloo group, under plain FP32 DDP / FSDP2 and under each GeoFP8 method:

* **peak** (the measured total): the peak over the step of the bytes of every live tensor
  storage: those alive when the step starts (a census of the Python-visible tensors,
  DDP's buckets added: they live in C++) plus those that the step's ops create, followed
  by a dispatch mode after every op until their storage is freed. Autograd's saved
  activations are ops' outputs too, so they are counted; memory inside an op (gloo's
  buffers) is not;
* **GeoFP8 extra**: the method's peak less FP32 DDP's (FSDP2's) peak, both so measured;
* **the parts** of that extra, found independently: what the state holds between steps
  (a walk of the state object: the committed residuals of each set, the factors, the
  statistics, the selection, the rest: layouts, cached lengths, device metadata) and what
  GeoFP8's own code had created and still held at the method's peak moment: the step's new
  residuals (staged) and the codec's and the collective's buffers in flight. At the peak, the
  framework's part may be smaller than at FP32's own peak (activations already freed), so
  GeoFP8's bytes at the peak may exceed the extra;
* **framework**: the rest of the peak, found apart: the census less GeoFP8's state, DDP's
  buckets, and the storages alive at the peak that other code created;
* **process peak**: the process's peak resident set (``ru_maxrss``) by the end of the step:
  the allocator's view (it holds the interpreter and libraries too, and freed pages may stay
  resident), shown against FP32's. The ranks are spawned afresh here, as a launcher's are
  (``measure(..., fresh=False)``, as the tests call it, forks them from a preloaded server:
  the same bytes, a smaller resident set).

Figures are bytes per model parameter (FP32 weights are 4); ``extra / fp32`` is the extra over
the model's (FSDP: the rank's shard's) FP32 parameter bytes, the issue's goal being <= 0.6.

    python benchmarks/memory.py                                   # DDP, llama-small, 2 ranks
    python benchmarks/memory.py --fsdp --ranks 2 4                # FSDP2 per-rank extra
    python benchmarks/memory.py --fsdp --ranks 2 4 --sender-feedback on off
    python benchmarks/memory.py --methods fp8-ef --residual bf16 nvfp4
    python benchmarks/memory.py --model smollm-135m     # 100M-class, built from its config
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import os
import resource
import sys
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import geofp8
from host_syncs import LLAMA, on_ranks  # this folder is on sys.path when run as a script

PACKAGE = os.path.dirname(geofp8.__file__) + os.sep
WARMUP = 2  # step 0 checks the ranks' configurations; step 1 is the first ordinary step
VOCAB, SEQ, BATCH = 2048, 64, 4  # the token ids drawn (below every model's vocabulary)
SENDER = {"default": None, "on": True, "off": False}  # --sender-feedback
# a 100M-class Hugging Face model, by its architecture (SmolLM-135M's: 134.5 M parameters)
HF_MODELS = {"smollm-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                 num_attention_heads=9, num_key_value_heads=3,
                                 vocab_size=49152, tie_word_embeddings=True,
                                 attn_implementation="sdpa")}


class LiveStorages(TorchDispatchMode):
    """Bytes of the storages that ops create, alive after each op; those created under the
    ``geofp8`` package are told apart (by the Python frames of the call), with the function
    of the package that created them (its innermost frame there)."""

    def __init__(self) -> None:
        super().__init__()
        # data pointer -> (storage, creating function of ours or None)
        self.live: dict[int, tuple[weakref.ref, str | None]] = {}
        self.peak, self.ours_at_peak, self.others_at_peak = 0, {}, 0
        self.where_at_peak: dict[int, str] = {}  # data pointer -> creating function

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {_pointer(t) for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        ours = None
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage, key = t.untyped_storage(), _pointer(t)
            if key is None or key in inputs or key in self.live or storage.nbytes() == 0:
                continue
            ours = package_function() if ours is None else ours
            self.live[key] = (weakref.ref(storage), ours or None)
        self._sample()
        return out

    def _sample(self) -> None:
        total, ours, where = 0, {}, {}
        for key, (ref, mine) in list(self.live.items()):
            storage = ref()
            if storage is None or storage.nbytes() == 0:
                del self.live[key]
                continue
            total += storage.nbytes()
            if mine:
                ours[key] = storage.nbytes()
                where[key] = mine
        if total > self.peak:
            self.peak, self.ours_at_peak, self.where_at_peak = total, ours, where
            self.others_at_peak = total - sum(ours.values())


def _pointer(t: torch.Tensor) -> int | None:
    """The data pointer of ``t``'s storage (``None``: a storage FSDP has freed)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def called_from_package() -> bool:
    """Whether the op that a ``__torch_dispatch__`` (the caller) handles was called, at any
    depth, from GeoFP8's code."""
    return package_function(3) != ""


def package_function(depth: int = 2) -> str:
    """``module.function`` of GeoFP8's innermost frame in the call of the op that a
    ``__torch_dispatch__`` (the caller) handles; ``""``: not called from GeoFP8."""
    frame = sys._getframe(depth)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(PACKAGE):
            module = name[len(PACKAGE):-3].replace(os.sep, ".")
            return f"{module}.{frame.f_code.co_name}"
        frame = frame.f_back
    return ""


def storages_of(root, skip: set[int] = frozenset()) -> dict[int, int]:
    """``{data pointer: bytes}`` of the storages reachable from ``root`` through the attributes
    of GeoFP8's objects, dicts, lists and tuples, except through the objects whose ``id`` is
    in ``skip``."""
    seen, storages, stack = set(), {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or id(obj) in skip:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta" and _pointer(obj) is not None:
                storages[_pointer(obj)] = obj.untyped_storage().nbytes()
        elif type(obj) is dict:
            stack.extend(obj.values())
        elif type(obj) in (list, tuple, set, frozenset):
            stack.extend(obj)
        elif type(obj).__module__.startswith("geofp8") and hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())  # GeoFP8's own objects (not the model, FSDP's)
    return storages


def census() -> dict[int, int]:
    """Every Python-visible tensor's storage (parameters, gradients, optimizer state,
    GeoFP8's state): ``{data pointer: bytes}``."""
    gc.collect()
    found = {}
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated aliases
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in tensors:
        if obj.device.type != "meta":
            try:
                if hasattr(obj, "to_local"):  # a DTensor: its local shard is the storage
                    obj = obj.to_local()
                found[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):
                continue
    return found


@dataclass
class Parts:
    """What GeoFP8 holds, in bytes (see the module notes)."""

    residuals: dict[str, int] = field(default_factory=dict)  # committed, per set
    factors: int = 0
    statistics: int = 0
    selection: int = 0
    other_state: int = 0  # layouts, cached lengths, device metadata
    staged: int = 0  # the step's new residuals alive at the peak
    in_flight: int = 0  # codec and collective buffers alive at the peak
    framework: int = 0  # everything else at the peak: model, optimizer, activations, DDP
    creators: dict[str, int] = field(default_factory=dict)  # staged + in flight, by function

    @property
    def geofp8(self) -> int:
        return (sum(self.residuals.values()) + self.factors + self.statistics + self.selection
                + self.other_state + self.staged + self.in_flight)


def held_parts(state, engine) -> tuple[Parts, set[int]]:
    """The state's bytes by part, and every storage it holds (data pointers)."""
    parts, counted = Parts(), set()

    def take(root, skip=frozenset()) -> int:
        found = {k: n for k, n in storages_of(root, skip).items() if k not in counted}
        counted.update(found)
        return sum(found.values())

    pipeline = engine.pipeline
    for name, feedback in engine.feedbacks.items():
        parts.residuals[name] = take(feedback.residuals)
    source = pipeline.source
    if source is not None:
        factors = {id(t): t for t in source.transforms.values()}
        parts.factors = take(list(factors.values()))
        parts.statistics = take(source)
    parts.selection = take(pipeline.selection)
    parts.other_state = take(state)
    return parts, counted


def staged_pointers(engine) -> set[int]:
    """Storages of every residual the engine holds (committed or staged)."""
    held = [[f.residuals, getattr(f, "_staged", {})] for f in engine.feedbacks.values()]
    return {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(held)
            if isinstance(t, torch.Tensor)}


def creators_of(mode: LiveStorages, ours: dict[int, int]) -> dict[str, int]:
    """Bytes of ``ours`` (storages alive at the peak, GeoFP8's state left out) by the
    function of GeoFP8 that created them, largest first."""
    out: dict[str, int] = {}
    for key, n in ours.items():
        name = mode.where_at_peak[key]
        out[name] = out.get(name, 0) + n
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _build(rank: int, world: int, method: str, fsdp: bool, residual: str | None, model_name,
           sender: bool | None = None):
    from geofp8.methods import METHODS
    from geofp8.tools.models import build_preset

    if model_name in HF_MODELS:  # built from its config: no download
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**HF_MODELS[model_name])).float()
    else:
        model = build_preset(model_name, VOCAB, seed=0)
    params = sum(p.numel() for p in model.parameters())
    spec = METHODS[method]
    settings = {"refresh_every": 1000}
    if residual is not None:
        settings["residual"] = residual
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        from geofp8 import fsdp as geofp8_fsdp

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        state = None
        if spec.kind == "geofp8":
            state = geofp8_fsdp.enable(model, spec.config(**spec.takes(**settings)),
                                       sender_feedback=sender)
        return model, model, state, params
    state, hook, _ = spec.build(model, **spec.takes(**settings))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    return model, ddp, state, params


def _worker(rank, world, port, method, queue, fsdp, residual, model_name, sender) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    model, wrapped, state, params = _build(rank, world, method, fsdp, residual, model_name,
                                           sender)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)

    def step(mode=None):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        if mode is None:
            wrapped(input_ids=ids, labels=ids).loss.backward()
        else:
            with mode:
                wrapped(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(WARMUP):
        step()
    engine = getattr(state, "engine", None)
    base = census()
    buckets = 0 if fsdp else sum(  # DDP's buckets live in C++
        b.buffer().numel() * b.buffer().element_size()
        for b in wrapped.reducer._get_zeros_like_grad_buckets())
    parts, held = held_parts(state, engine) if engine is not None else (Parts(), set())
    mode = LiveStorages()
    step(mode)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if engine is not None:
        residual_now = staged_pointers(engine)
        ours = {k: n for k, n in mode.ours_at_peak.items() if k not in held}
        parts.staged = sum(n for k, n in ours.items() if k in residual_now)
        parts.in_flight = sum(ours.values()) - parts.staged
        parts.creators = creators_of(mode, ours)
    parts.framework = (sum(n for k, n in base.items() if k not in held) + buckets
                       + mode.others_at_peak)
    queue.put((rank, params, sum(base.values()) + buckets + mode.peak, rss, parts))
    dist.barrier()
    dist.destroy_process_group()


def measure(method: str, world: int, fsdp: bool = False, residual: str | None = None,
            model: str = "llama-small", sender: bool | None = None, fresh: bool = True
            ) -> tuple[int, int, int, Parts]:
    """``(parameters, peak bytes, process peak resident bytes, the parts)`` of rank 0;
    ``sender``: FSDP's ``sender_feedback`` (``None``: its default); ``fresh``: ranks
    spawned afresh (``host_syncs.on_ranks``), else forked from a preloaded server."""
    return on_ranks(_worker, world, method, fsdp, residual, model, sender, fresh=fresh,
                    preload=LLAMA)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--methods", nargs="+", default=["fp8-ef", "nvfp4-ef", "geofp8"])
    parser.add_argument("--residual", nargs="+", default=[None],
                        help="residual storages (fp32 bf16 fp8 nvfp4; default: the method's)")
    parser.add_argument("--ranks", nargs="+", type=int, default=[2])
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 instead of DDP")
    parser.add_argument("--where", action="store_true", help="after each row, GeoFP8's "
                        "bytes alive at the peak (staged and in flight) by the function "
                        "that created them")
    parser.add_argument("--sender-feedback", nargs="+", default=["default"],
                        choices=list(SENDER), help="FSDP: the reduce-scatter's sender "
                        "residual (geofp8.fsdp.enable's sender_feedback)")
    args = parser.parse_args()
    print(f"{'fsdp2' if args.fsdp else 'ddp'}, {args.model}, rank 0 of N: bytes per model "
          "parameter; extra / fp32: the extra over the rank's FP32 parameter bytes")
    print("| N | method | residual | sender EF | peak | extra | extra / fp32 | GeoFP8 at peak: "
          "residuals | staged | factors | statistics | selection | other state | in flight | "
          "framework at peak | parts / peak | process peak (fp32's) |")
    print("|" + "---|" * 17)
    for world in args.ranks:
        params, reference, rss_fp32, _ = measure("fp32", world, args.fsdp, None, args.model)
        fp32_bytes = 4 * params / (world if args.fsdp else 1)
        for method in args.methods:
            for residual, sender in itertools.product(args.residual, args.sender_feedback):
                _, peak, rss, p = measure(method, world, args.fsdp, residual, args.model,
                                          SENDER[sender])
                extra, n = peak - reference, params
                print(f"| {world} | {method} | {residual or 'default'} | {sender} | "
                      f"{peak / n:.2f} | "
                      f"{extra / n:.2f} | {extra / fp32_bytes:.2f} | "
                      f"{sum(p.residuals.values()) / n:.2f} | {p.staged / n:.2f} | "
                      f"{p.factors / n:.3f} | {p.statistics / n:.3f} | "
                      f"{p.selection / n:.3f} | {p.other_state / n:.3f} | "
                      f"{p.in_flight / n:.2f} | {p.framework / n:.2f} | "
                      f"{(p.geofp8 + p.framework) / peak:.3f} | "
                      f"{rss / 2**20:.0f} MB ({rss_fp32 / 2**20:.0f} MB) |", flush=True)
                if args.where and p.creators:
                    print("  at the peak: " + ", ".join(f"{name} {size / n:.2f}" for name, size
                                                       in p.creators.items()))


if __name__ == "__main__":
    main()

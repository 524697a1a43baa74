"""Measure what a DDP communication hook really delivers, against an FP32 all-reduce.

Wrap any hook with :func:`shadow_hook`. On steps where ``state.capture`` is set, it keeps a
copy of every local gradient before the wrapped hook communicates it; after the backward,
:func:`shadow_fidelity` all-reduces those copies in FP32 (divide-then-sum, as DDP does, so
FP32 communication measures zero error) and compares the reference ``Ḡ = Σ_r G_r / N`` with
the communicated gradient ``Ĝ`` in ``param.grad``: per parameter
``rel_l2 = ‖Ĝ − Ḡ‖ / ‖Ḡ‖`` and ``cos = ⟨Ĝ, Ḡ⟩ / (‖Ĝ‖‖Ḡ‖)``. The reference costs one extra
FP32 all-reduce, on capture steps only, issued from the caller's thread after backward.
"""

import math

import torch
import torch.distributed as dist
from torch import nn


class ShadowState:
    """State of :func:`shadow_hook`: the wrapped hook and its state, and the captured copies."""

    def __init__(self, inner_state, inner_hook) -> None:
        self.inner_state, self.inner_hook = inner_state, inner_hook
        self.capture = False
        self.local: dict[int, torch.Tensor] = {}


def shadow_hook(state: ShadowState, bucket: dist.GradBucket):
    # left unannotated: DDP checks a hook's annotations only when present
    """Run ``state.inner_hook``; on capture steps first keep a copy of the local gradients."""
    if state.capture:
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            state.local[id(p)] = g.detach().clone()
    return state.inner_hook(state.inner_state, bucket)


def shadow_fidelity(model: nn.Module, state: ShadowState,
                    group: dist.ProcessGroup | None = None):
    """``({parameter: {"rel_l2", "cos"}}, rel_l2 over all, cos over all)`` of the last
    captured step. Collective over ``group``; call it on every rank after the backward."""
    world = dist.get_world_size(group)
    named = [(n, p) for n, p in model.named_parameters() if id(p) in state.local]
    exact = torch.cat([state.local[id(p)].reshape(-1).float() for _, p in named]).div_(world)
    dist.all_reduce(exact, group=group)
    state.local.clear()
    out, err2, ref2, dot, got2, pos = {}, 0.0, 0.0, 0.0, 0.0, 0
    for name, p in named:
        ref = exact[pos : pos + p.numel()]
        pos += p.numel()
        got = p.grad.detach().reshape(-1).float()
        e2, r2 = float((got - ref).pow(2).sum()), float(ref.pow(2).sum())
        d, g2 = float(got @ ref), float(got.pow(2).sum())
        out[name] = {"rel_l2": math.sqrt(e2 / r2) if r2 > 0 else 0.0,
                     "cos": d / math.sqrt(g2 * r2) if g2 * r2 > 0 else 1.0}
        err2, ref2, dot, got2 = err2 + e2, ref2 + r2, dot + d, got2 + g2
    total_rel = math.sqrt(err2 / ref2) if ref2 > 0 else 0.0
    total_cos = dot / math.sqrt(got2 * ref2) if got2 * ref2 > 0 else 1.0
    return out, total_rel, total_cos

"""Measure what a DDP communication hook really delivers, against an FP32 all-reduce.

:func:`shadow_hook` wraps any hook. On steps where ``state.enabled`` is set it first
all-reduces an FP32 copy of the bucket (the reference: ``Ḡ = Σ_r G_r / N``), then runs the
wrapped hook and records, per parameter, ``‖Ĝ − Ḡ‖²``, ``‖Ḡ‖²``, ``⟨Ĝ, Ḡ⟩`` and ``‖Ĝ‖²`` of
the hook's result ``Ĝ``. :meth:`ShadowState.report` turns them into RelL2 and cosine.
The reference costs one extra FP32 all-reduce per bucket on enabled steps only.
"""

import torch
import torch.distributed as dist


class ShadowState:
    """State of :func:`shadow_hook`: the wrapped hook, its state, and the running sums."""

    def __init__(self, inner_state, inner_hook, names: dict[int, str],
                 process_group: dist.ProcessGroup | None = None) -> None:
        self.inner_state, self.inner_hook = inner_state, inner_hook
        self.names, self.group = names, process_group
        self.world_size = dist.get_world_size(process_group)
        self.enabled = False
        self.sums: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self.sums = {}

    def report(self) -> dict[str, dict[str, float]]:
        """``{parameter: {"rel_l2", "cos"}}`` over the enabled steps since :meth:`reset`."""
        out = {}
        for name, (err2, ref2, dot, hat2) in ((n, s.tolist()) for n, s in self.sums.items()):
            if ref2 > 0:
                out[name] = {"rel_l2": (err2 / ref2) ** 0.5,
                             "cos": dot / max((ref2 * hat2) ** 0.5, 1e-300)}
        return out


def shadow_hook(state: ShadowState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Run ``state.inner_hook``; on enabled steps also compare it with an FP32 all-reduce."""
    if not state.enabled:
        return state.inner_hook(state.inner_state, bucket)
    reference = bucket.buffer().detach().float().clone()
    dist.all_reduce(reference, group=state.group)  # blocking: shadow steps are not timed
    reference /= state.world_size
    base = bucket.buffer().data_ptr()
    spans = [(state.names.get(id(p), f"param{i}"),
              (g.data_ptr() - base) // g.element_size(), g.numel())
             for i, (p, g) in enumerate(zip(bucket.parameters(), bucket.gradients()))]

    def compare(fut: torch.futures.Future) -> torch.Tensor:
        value = fut.value()
        result = value[0] if isinstance(value, list) else value
        flat = result.detach().reshape(-1).double()
        for name, off, n in spans:
            hat, ref = flat[off : off + n], reference[off : off + n].double()
            sums = torch.stack([(hat - ref).pow(2).sum(), ref.pow(2).sum(), (hat * ref).sum(),
                                hat.pow(2).sum()])
            state.sums[name] = state.sums.get(name, torch.zeros(4, dtype=torch.float64)) + sums
        return result

    return state.inner_hook(state.inner_state, bucket).then(compare)

"""Which Linear layers may take the geometry branch (the *candidates*), by weight name."""

from __future__ import annotations

import re

from torch import nn

from .geometry.sources import Layer

__all__ = ["find_candidates"]


def find_candidates(model: nn.Module, names: dict[int, str], scope, min_dim: int
                    ) -> dict[str, Layer]:
    """The Linear layers that may take the geometry branch, by weight name.

    ``scope``: ``"blocks"`` (the Linear layers inside repeated blocks, i.e. in or
    under an ``nn.ModuleList``: ``layers.3.mlp.up`` or ``layers.3`` itself; the transformer
    blocks, not the LM head; all Linear layers when the model has no repeated blocks),
    ``"linear"`` (every Linear layer) or module names. Frozen, tied and narrow
    (``min(d_in, d_out) < min_dim``) weights are never candidates.
    """
    modules = dict(model.named_modules())
    if isinstance(scope, (list, tuple)):
        unknown = [n for n in scope if not isinstance(modules.get(n), nn.Linear)]
        if unknown:
            raise ValueError(f"GeoFP8Config names no nn.Linear module: {unknown}")
    lists = [re.escape(n) for n, m in modules.items() if isinstance(m, nn.ModuleList) and n]
    in_block = re.compile(rf"^(?:{'|'.join(lists)})\.\d+(?:\.|$)") if lists else None
    layers = {}
    for name, mod in modules.items():
        if not isinstance(mod, nn.Linear) or not mod.weight.requires_grad:
            continue
        if min(mod.in_features, mod.out_features) < min_dim:
            continue
        pname = f"{name}.weight" if name else "weight"
        if names.get(id(mod.weight)) != pname:  # tied to another parameter
            continue
        if isinstance(scope, (list, tuple)) and name not in scope:
            continue
        if scope == "blocks" and in_block is not None and not in_block.match(name):
            continue
        layers[pname] = Layer(name, pname, mod.in_features, mod.out_features)
    return layers

"""Bit-identity of two checkouts through the public API (for refactors).

``PYTHONPATH=<checkout>/src python benchmarks/bit_identity.py OUT.json`` trains a tiny HF Llama
(hidden 64, 2 blocks) for 8 steps on 2 gloo ranks under each configuration below and writes the
MD5 of the final parameters and the bytes sent per step (DDP: every METHODS row of kind
``geofp8`` and the configurations below; FSDP2: three); run it once per checkout, then
``python benchmarks/bit_identity.py --compare OLD.json NEW.json``. Both trees get the same
configuration (a tree with ``GeoFP8Config.candidates`` gets ``k`` for ``rank`` and
``candidates="linear"``, the older default).
"""

import argparse
import datetime
import hashlib
import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIGS = {  # name -> (state kind, GeoFP8Config fields)
    "FP8State + EF": ("fp8", {}),
    "HadamardFP8State": ("hadamard", {}),
    "euclidean, layers=none": ("geo", dict(layers="none")),
    "refresh, layers=all": ("geo", dict(layers="all", refresh_every=2)),
    "refresh, profile": ("geo", dict(layers="profile", profile_steps=2, refresh_every=2)),
    "refresh, auto": ("geo", dict(layers="auto", refresh_every=2)),
    "fresh, layers=all": ("geo", dict(factor_source="fresh", layers="all")),
    "local, layers=all": ("geo", dict(factor_source="local", layers="all", refresh_every=2)),
    "kfac, layers=all": ("geo", dict(transform="kfac", layers="all", refresh_every=2)),
    "diag, layers=all": ("geo", dict(transform="diag", layers="all", refresh_every=2)),
    # FSDP2 (every parameter's dim 0 even: the Llama below) through geofp8.fsdp.enable
    "fsdp euclidean + EF": ("fsdp", dict(transform="euclidean", layers="none")),
    "fsdp refresh, layers=all": ("fsdp", dict(layers="all", refresh_every=2)),
    "fsdp nvfp4 fresh, layers=all": ("fsdp", dict(format="nvfp4", factor_source="fresh",
                                                  layers="all")),
}
# and every METHODS row of this library's kind, built as the trainer builds it (the overrides
# a method takes: K = 2 and a 2-step profile, so refreshes and selections happen in 8 steps;
# the byte budget's methods, which have no default, 4 bytes per element: above their floor)
OVERRIDES = dict(k=8, refresh_every=2, profile_steps=2, budget=4.0)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
        tie_word_embeddings=False, attn_implementation="eager", use_cache=False))


def _state(kind: str, fields: dict, model):
    import geofp8
    from geofp8.methods import METHODS

    if kind == "method":
        method = METHODS[fields["name"]]
        chosen = {k: v for k, v in OVERRIDES.items()
                  if k in method.overrides and method.kind == "geofp8"}
        state, hook, _ = method.build(model, **chosen)
        return state, hook
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        import geofp8.fsdp

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return geofp8.fsdp.enable(model, geofp8.GeoFP8Config(k=8, **fields)), None
    if kind == "fp8":
        return geofp8.FP8State(model, geofp8.FP8Config(error_feedback=True)), geofp8.fp8_hook
    if kind == "hadamard":
        return (geofp8.HadamardFP8State(model, geofp8.FP8Config(error_feedback=True)),
                geofp8.hadamard_fp8_hook)
    newer = hasattr(geofp8.GeoFP8Config(), "candidates")
    fields = dict(fields, **({"k": 8, "candidates": "linear"} if newer else {"rank": 8}))
    return geofp8.GeoFP8State(model, geofp8.GeoFP8Config(**fields)), geofp8.geofp8_hook


def _worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    from geofp8.methods import METHODS

    results = {}
    configs = dict(CONFIGS, **{f"method {n}": ("method", {"name": n})
                               for n, m in METHODS.items() if m.kind == "geofp8"})
    for name, (kind, fields) in configs.items():
        model = _model()
        state, hook = _state(kind, fields, model)
        ddp = model if hook is None else DDP(model)
        if hook is not None:
            ddp.register_comm_hook(state, hook)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(rank)
        sent = []
        for _ in range(8):
            x = torch.randint(0, 256, (4, 32), generator=gen)
            ddp(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
            if hasattr(state, "_finish_step"):  # checkouts that settled a step lazily
                state._finish_step()
            sent.append(int(state.stats().get("bytes_sent", 0)))
        flat = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                          .reshape(-1) for p in model.parameters()])
        results[name] = {"params": hashlib.md5(flat.numpy().tobytes()).hexdigest(),
                         "bytes": sent}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def compare(old_path: str, new_path: str) -> None:
    with open(old_path) as f, open(new_path) as g:
        old, new = json.load(f), json.load(g)
    print("| configuration | parameters | bytes per step (old vs new) |\n|---|---|---|")
    for name in (n for n in new if n not in old):
        print(f"| {name} | new only | |")
    for name in old:
        params = "identical" if old[name]["params"] == new[name]["params"] else "DIFFERENT"
        same = old[name]["bytes"] == new[name]["bytes"]
        sent = "identical" if same else f"{old[name]['bytes']} vs {new[name]['bytes']}"
        print(f"| {name} | {params} | {sent} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="write this checkout's figures here (JSON)")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    args = parser.parse_args()
    if args.compare:
        compare(*args.compare)
        return
    if not args.out:
        parser.error("give OUT.json, or --compare OLD.json NEW.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(2, port, args.out), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()

"""Wire bytes of an ordinary step and of a factor-refresh step on a 135M-class Llama.

``python benchmarks/refresh_bytes.py [--layers 30] [--ranks 2] [--statistics auto]``

A randomly initialised Llama with the widths of a 135M model (hidden 576, MLP 1536, 9 heads,
3 KV heads, vocabulary 49152, tied embeddings), ``--layers`` blocks, trained a few steps on 2
gloo ranks with ``GeoFP8Config(layers="all", refresh_every=2)``: the bytes this rank sent
(payload + factor traffic, as ``stats()`` counts them) on an ordinary step and on a refresh
step, per gradient element and relative to each other; and, with ``--fidelity``, the RelL2 of
the communicated gradient against an FP32 all-reduce (``geofp8.tools.shadow``) on the step
after the refresh, per layer type. Uses only the public API, so the same script measures an
older checkout for comparison.
"""

import argparse
import datetime
import gc
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def _worker(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        from transformers import LlamaConfig, LlamaForCausalLM

        from geofp8 import GeoFP8Config, GeoFP8State, geofp8_hook

        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers,
                             num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                             tie_word_embeddings=True, max_position_embeddings=256)
        model = LlamaForCausalLM(config)
        settings = dict(layers="all", refresh_every=2)
        if args.statistics:
            settings["statistics"] = args.statistics
        state = GeoFP8State(model, GeoFP8Config(**settings))
        ddp = DDP(model)
        shadow = None
        if args.fidelity:
            from geofp8.tools.shadow import ShadowState, shadow_fidelity, shadow_hook
            shadow = ShadowState(state, geofp8_hook)
            ddp.register_comm_hook(shadow, shadow_hook)
        else:
            ddp.register_comm_hook(state, geofp8_hook)
        fidelity = {}
        g = torch.Generator().manual_seed(rank)
        rows = []
        for step in range(4):
            x = torch.randint(0, 49152, (1, args.seq_len), generator=g)
            if shadow is not None:
                shadow.capture = step == 3
            ddp(input_ids=x, labels=x).loss.backward()
            if shadow is not None and step == 3:
                shadow.capture = False
                per_param = shadow_fidelity(model, shadow)[0]
                for name, m in per_param.items():
                    if name.endswith("proj.weight"):
                        kind = name.rsplit(".", 2)[-2].removesuffix("_proj")
                        fidelity.setdefault(kind, []).append(m["rel_l2"])
            model.zero_grad(set_to_none=True)
            if hasattr(state, "_finish_step"):  # checkouts that settled a step lazily
                state._finish_step()
            st = state.stats()
            rows.append((st["step"], st["bytes_sent"], st["factor_bytes_sent"],
                         st["bytes_per_element"]))
        if rank == 0:
            queue.put((rows, {k: sum(v) / len(v) for k, v in fidelity.items()}))
        dist.barrier()
    finally:  # public API only (this script also measures older checkouts): no geofp8.tools
        gc.collect()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--statistics", default=None, help="exact | sketch | auto (default)")
    parser.add_argument("--fidelity", action="store_true",
                        help="also the communicated RelL2 after the refresh, per layer type")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, args.ranks, port, args, queue))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows, fidelity = queue.get(timeout=3600)
    for p in procs:
        p.join()
    print("| step | refresh | bytes sent | of which factor | bytes/element |")
    print("|---:|:---:|---:|---:|---:|")
    for step, sent, factor, per_element in rows:
        refresh = (step - 1) % 2 == 0 and step > 1
        print(f"| {step - 1} | {'yes' if refresh else ''} | {sent:,} | {factor:,} "
              f"| {per_element:.3f} |")
    ordinary = [r[1] for r in rows if not ((r[0] - 1) % 2 == 0 and r[0] > 1)]
    refreshed = [r[1] for r in rows if (r[0] - 1) % 2 == 0 and r[0] > 1]
    if ordinary and refreshed:
        print(f"\nrefresh step / ordinary step: {max(refreshed) / min(ordinary):.3f}")
    if fidelity:
        print("\ncommunicated RelL2 on the step after the refresh (mean per layer type): " +
              ", ".join(f"{k} {v:.4f}" for k, v in sorted(fidelity.items())))


if __name__ == "__main__":
    main()

"""A DDP bucket whose layers keep their maps takes the flat bucket path: ``G T`` written over
each mapped gradient in its slot, ``Ũ = G T + R`` and the new residual over the bucket at
once (the residual of a mapped layer in its map's coordinates, as tensor by tensor). The
parameters are those of the tensor-by-tensor path, bit for bit, a skipped step included."""

import torch
from torch import nn

from distributed import run_ranks, train_skipping

STEPS, BAD = 9, 7  # refreshes at steps 3 and 6 (routes change); rank 1's NaN at step 7


def _worker(rank, world, flat: bool):
    from geofp8.geometry.transforms import IDENTITY
    from geofp8.methods import METHODS

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(6)])
    spec = METHODS["geofp8"]
    state, hook, _ = spec.build(model, **spec.takes(refresh_every=3, profile_steps=1))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=3 * 32 * 32 * 4 / (1 << 20))
    ddp.register_comm_hook(state, hook)
    pipeline = state.engine.pipeline
    took = []  # per bucket: (step, whether the flat path took a layer on a map)
    choose = pipeline._bucket_residual

    def bucket_residual(names, shapes):
        routes, bucket = choose(names, shapes) if flat else (None, None)
        took.append((pipeline.ledger.step, routes is not None and any(r is not IDENTITY
                                                                 for r in routes)))
        return routes, bucket

    pipeline._bucket_residual = bucket_residual
    follow = pipeline._encode_recorded

    def encode_recorded(record, flat_bucket, seed):  # the flat path as resolved before
        took.append((pipeline.ledger.step, bool(record.slots)))
        return follow(record, flat_bucket, seed)

    pipeline._encode_recorded = encode_recorded
    train_skipping(ddp, model, rank, STEPS, BAD, 32)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"params": params.view(torch.int32).tolist(), "took": took,
            "mapped": len(pipeline.geometry_layers()),
            "skipped": state.stats()["skipped_steps"]}


def test_a_bucket_on_its_maps_takes_the_flat_path_with_the_same_bits():
    flat = run_ranks(_worker, 2, args=(True,), timeout=300)
    reference = run_ranks(_worker, 2, args=(False,), timeout=300)
    for out, ref in zip(flat, reference):
        assert out["mapped"] == ref["mapped"] > 0 and out["skipped"] == ref["skipped"] == 1
        on_maps = {step for step, mapped in out["took"] if mapped}
        # after each refresh (a route change: re-based tensor by tensor), the ordinary steps
        assert on_maps == {4, 5, 7, 8}, out["took"]
        assert not any(mapped for _, mapped in ref["took"])
        assert out["params"] == ref["params"]  # bit for bit, the skipped step's reset too
    assert flat[0]["params"] == flat[1]["params"]

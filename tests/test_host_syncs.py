"""No host sync on the hot path: on an ordinary DDP step the comm hook reads nothing back
from the device on the autograd thread (the step's one agreement read runs when the last
bucket settles). Op counts are deterministic, so this is a test and not a benchmark; the
per-bucket figures are printed by ``benchmarks/host_syncs.py``."""

import collections

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from distributed import run_ranks

SYNC = "aten._local_scalar_dense.default"  # .item(), bool(t), .tolist()


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


class _NewVectors(_Count):
    """Counts (in ``ops["new"]``) the FP32 tensors of more than ``numel`` elements that ops
    create (an output in none of their inputs' storages: not a view, not in place, not an
    ``out=``)."""

    def __init__(self, numel):
        super().__init__()
        self.numel = numel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr()
                  for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.ops["new"] += sum(
            1 for t in pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32
            and t.numel() > self.numel and t.untyped_storage().data_ptr() not in inputs)
        return out


def _counted_steps(rank, method, refresh_every, steps, kernels="auto", counter=_Count,
                   bucket_cap_mb=0.02):
    """``(ops per step, buckets)``: the aten ops of every step's ``backward()`` (a Counter
    each, from a ``counter()`` dispatch mode) on this rank, DDP over 8 Linear(64, 64) in
    buckets of ~``bucket_cap_mb``."""
    from geofp8.methods import METHODS

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(8)])
    spec = METHODS[method]
    state, hook, _ = spec.build(model, **spec.takes(refresh_every=refresh_every, k=8,
                                                     kernels=kernels))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    ddp.register_comm_hook(state, hook)
    counts = []
    for step in range(steps):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step + 10 * rank))
        loss = ddp(x).pow(2).mean()
        mode = counter()
        with mode:
            loss.backward()
        counts.append(mode.ops)
        ddp.zero_grad()
    return counts, len(ddp.reducer._get_zeros_like_grad_buckets())


def _worker(rank, world, method):
    counts, buckets = _counted_steps(rank, method, refresh_every=2, steps=5)
    return [c[SYNC] for c in counts], buckets


# Fresh factors build this step's map on every step, on the device too (a non-finite sketch
# is chosen away by torch.where, its warning read with the step's one read). geofp8 profiles
# its layers on these steps: the clipped-fraction scores stay on the device until the choice.
@pytest.mark.parametrize("method", ["fp8-ef", "geofp8", "geofp8-all", "nvfp4-ef", "kfac",
                                    "geofp8-fresh-all", "nvfp4-fresh4-ef"])
def test_an_ordinary_step_reads_nothing_back_on_the_autograd_thread(method):
    for syncs, buckets in run_ranks(_worker, 2, args=(method,)):
        assert buckets > 1
        # step 0 checks the ranks' configurations, steps 2 and 4 refresh the factors;
        # step 3 is ordinary with the maps in use
        assert (syncs[1], syncs[3]) == (0, 0), syncs


class _HostReads:
    """Counts the Python-level reads of a tensor's values (``item``, ``tolist``, ``bool``,
    ``int``, ``float``) on every thread: the step's collectives complete on the backend's
    threads, where a dispatch mode (thread-local) sees nothing."""

    READS = ("item", "tolist", "__bool__", "__int__", "__float__")

    def __init__(self):
        self.count = 0

    def __enter__(self):
        self.saved = {name: getattr(torch.Tensor, name) for name in self.READS}
        for name, read in self.saved.items():
            setattr(torch.Tensor, name, self._counted(read))
        return self

    def _counted(self, read):
        def counted(t, *args, **kwargs):
            self.count += 1
            return read(t, *args, **kwargs)
        return counted

    def __exit__(self, *exc):
        for name, read in self.saved.items():
            setattr(torch.Tensor, name, read)


def _whole_step_worker(rank, world, method):
    from geofp8.methods import METHODS

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(8)])
    spec = METHODS[method]
    state, hook, _ = spec.build(model, **spec.takes(refresh_every=3, profile_steps=1))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.02)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    reads = []
    for step in range(WHOLE_STEPS):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step + 10 * rank))
        with _HostReads() as counted:
            ddp(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        reads.append(counted.count)
    return reads, state.stats()["skipped_steps"], len(state.engine.pipeline.geometry_layers())


# The step's finite agreement and the error-feedback commit stay on the device (a skipped
# step's residuals are chosen away by torch.where; its count is read by stats()): an
# ordinary step reads nothing back at all, forward, backward and optimizer step included, so
# the host can queue the next step while the device works: with geometry too, on the path
# users run: the factors refresh every 3 steps, geofp8's profile scores step 0 and chooses at
# step 1, geofp8-auto measures at step 3 and chooses at step 4 (those steps read by design),
# and at step 5 the chosen layers go through their maps; geofp8-local builds each rank's own
# map on every step, on the device. Ordinary steps per method, and layers on a map at the end:
WHOLE_STEPS = 6
ORDINARY = {"fp8-ef": ([1, 2, 3, 4, 5], 0), "nvfp4-ef": ([1, 2, 3, 4, 5], 0),
            "geofp8": ([2, 4, 5], 2), "geofp8-auto": ([1, 2, 5], None),
            "geofp8-local": ([1, 2, 3, 4, 5], 8)}


@pytest.mark.parametrize("method", list(ORDINARY))
def test_an_ordinary_whole_step_reads_nothing_back(method):
    ordinary, mapped = ORDINARY[method]
    for reads, skipped, on_map in run_ranks(_whole_step_worker, 2, args=(method,)):
        assert reads[0] > 0  # step 0 checks the ranks' configurations: reads are counted
        assert [reads[s] for s in ordinary] == [0] * len(ordinary), reads
        assert skipped == 0
        assert mapped is None or on_map == mapped  # auto: whatever its measurement chose


def _ops_worker(rank, world, methods):
    """Per method: ``(aten ops per bucket, host syncs)`` of the ordinary steps 1 and 2, with
    the accelerators' whole-bucket kernels (a CPU's default goes shard by shard: there a
    kernel is no launch, and cache-sized pieces are faster)."""
    out = {}
    for method in methods:
        counts, buckets = _counted_steps(rank, method, refresh_every=1000, steps=3,
                                         kernels="batched")
        ordinary = counts[1] + counts[2]  # step 0 checks the ranks' configurations
        out[method] = (sum(ordinary.values()) / (2 * buckets), ordinary[SYNC])
    return out


# One split and one cat more or less (a shard of odd length, an empty shard) may come with a
# different N; anything that grows per rank adds ops per bucket with every rank.
GROWTH_ALLOWED = 2  # aten ops per bucket from 2 to 4 ranks


def test_ops_per_bucket_do_not_grow_with_the_ranks():
    methods = ("fp8-ef", "nvfp4-ef")
    two, four = (run_ranks(_ops_worker, n, args=(methods,))[0] for n in (2, 4))
    for method in methods:
        (ops2, syncs2), (ops4, syncs4) = two[method], four[method]
        assert (syncs2, syncs4) == (0, 0), (method, syncs2, syncs4)
        assert ops4 <= ops2 + GROWTH_ALLOWED, f"{method}: {ops2} ops/bucket at 2 ranks, {ops4} at 4"


def _new_vectors_worker(rank, world, method):
    # 8 weights of 4096 elements, buckets of ~50 KB: 2 buckets of 4 weights
    counts, buckets = _counted_steps(rank, method, refresh_every=1000, steps=3,
                                     counter=lambda: _NewVectors(4 * 64 * 64 - 1),
                                     bucket_cap_mb=0.05)
    return counts[2]["new"], buckets


# An FP32 DDP bucket is the hook's working memory: Ũ is written over the gradients, then the
# sender's rounding error over Ũ in the encoding pass (the residual is staged from it), the
# owner's decoded copies of its shard from the N senders (N × 1/N of the bucket, summed in
# one reduction, as the batched kernels do) are decoded into it, and so is the sum. Nothing
# bucket-sized is left per bucket, with EF or without (the residuals, BF16, one flat vector per
# bucket, are written in place). The CPU's other stages work shard by
# shard.
@pytest.mark.parametrize("method", ["fp8", "nvfp4", "fp8-ef", "nvfp4-ef"])
def test_the_hook_allocates_no_bucket_sized_vector(method):
    for new, buckets in run_ranks(_new_vectors_worker, 2, args=(method,)):
        assert buckets == 2
        assert new == 0, (method, new, buckets)

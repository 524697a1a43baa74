"""The real DDP hook's kernel launches per bucket do not grow with the tensors in it.

``benchmarks/hook_launches.py`` counts them on gloo ranks under Triton's interpreter (the
fused FP8 stages taken as on CUDA); the interpreter must be on before the kernels are
decorated, so the count runs in a child process. Counts are deterministic."""

import json
import os
import subprocess
import sys

BENCHMARKS = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks")
FUSED_STAGES = 6  # Triton kernels of one bucket's four stages (comm.plan.FusedPlan)


def _measure(method, cases, fields=slice(0, 4)):
    code = ("import json, sys, hook_launches as h\n"
            f"print(json.dumps([h.measure({method!r}, t, b)[{fields.start}:{fields.stop}] "
            f"for t, b in {cases!r}]))")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([os.path.abspath(BENCHMARKS), *sys.path])}
    done = subprocess.run([sys.executable, "-c", code], cwd=BENCHMARKS, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_fp8_ef_hook_launches_per_bucket_do_not_grow_with_its_tensors():
    (b2, tri2, ops2, _), (b8, tri8, ops8, _), (b4, tri4, ops4, _) = _measure(
        "fp8-ef", [(2, 1), (8, 1), (8, 4)])
    assert (b2, b8, b4) == (1, 1, 4)
    assert tri2 == tri8 == FUSED_STAGES and tri4 == 4 * FUSED_STAGES  # the fused stages ran
    assert ops8 == ops2, (ops2, ops8)  # 2 or 8 tensors in the bucket: the same launches
    # torch launches per bucket beyond the step's settling: the EF add (where, add) and the
    # residual write (one copy) with its scalar; nothing per tensor, no div_ nor finite pass
    per_bucket = (ops4 - ops8) / 3
    assert per_bucket <= 4, (ops8, ops4)


# torch launches per layer on a low-rank map, beyond the flat bucket's: the forward map
# (G·c, G U, ·d, addmm) and the inverse, written over the sum (the same four: the maps' two
# skinny GEMMs each way), the BF16 residual's read in the map's coordinates (to FP32,
# new_zeros, where), its add and its write (copy)
MAPPED_LAYER = 13


def test_geometry_hook_launches_grow_only_by_each_mapped_layers_maps():
    """geofp8 at an ordinary step with every layer on its refreshed map: the fused stages
    and the step's settling (the statistics' finite check and window add included) do not
    grow with the layers; each layer adds its maps' GEMMs and a fixed handful of ops."""
    (b2, tri2, ops2, _, names2, on2), (b8, tri8, ops8, _, names8, on8) = _measure(
        "geofp8", [(2, 1), (8, 1)], slice(0, 6))
    assert (b2, b8, on2, on8) == (1, 1, 2, 8)  # every layer on a map
    assert tri2 == tri8 == FUSED_STAGES
    def gemms(names):  # G U and the addmm with Uᵀ (written over the sum: addmm.out)
        return sum(c for n, c in names.items() if n.startswith(("aten.mm.", "aten.addmm.")))
    assert gemms(names8) - gemms(names2) == 4 * 6, (names2, names8)  # 2 each way per layer
    assert ops8 - ops2 == MAPPED_LAYER * 6, (ops2, ops8)


def test_geometry_hook_launches_without_a_map_are_the_flat_buckets():
    """geofp8-auto at an ordinary step with no layer on a map: its candidates join the flat
    bucket path, so the launches do not grow with the tensors at all."""
    (b2, tri2, ops2, _, _, on2), (b8, tri8, ops8, _, _, on8) = _measure(
        "geofp8-auto", [(2, 1), (8, 1)], slice(0, 6))
    assert (b2, b8, on2, on8) == (1, 1, 0, 0)
    assert tri2 == tri8 == FUSED_STAGES
    assert ops8 == ops2, (ops2, ops8)

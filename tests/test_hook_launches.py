"""The real DDP hook's kernel launches: six per bucket and one per step, whatever the
tensors in a bucket.

``benchmarks/hook_launches.py`` counts them on gloo ranks under Triton's interpreter (the
fused FP8 stages taken as on CUDA); the interpreter must be on before the kernels are
decorated, so the count runs in a child process. Counts are deterministic."""

import json
import os
import subprocess
import sys

BENCHMARKS = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks")
FUSED_STAGES = 6  # Triton kernels of one bucket's four stages (comm.plan.FusedPlan)
SETTLE = 1  # the step's verdict from its buckets' flags (geofp8.verdict.StepVerdict)


def _measure(method, cases):
    code = ("import json, sys, hook_launches as h\n"
            f"print(json.dumps([h.measure({method!r}, t, b)[:4] for t, b in {cases!r}]))")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([os.path.abspath(BENCHMARKS), *sys.path])}
    done = subprocess.run([sys.executable, "-c", code], cwd=BENCHMARKS, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_fp8_ef_hook_launches_six_kernels_per_bucket_and_one_per_step():
    (b2, tri2, ops2, _), (b8, tri8, ops8, _), (b4, tri4, ops4, _) = _measure(
        "fp8-ef", [(2, 1), (8, 1), (8, 4)])
    assert (b2, b8, b4) == (1, 1, 4)
    # the fused stages, the error feedback folded into them (no where, add_ nor copy_), and
    # the step's verdict and skipped-step counter in one kernel: nothing per tensor, no
    # torch op at all
    assert (tri2, ops2) == (tri8, ops8) == (FUSED_STAGES + SETTLE, 0), (tri2, ops2, tri8, ops8)
    assert (tri4, ops4) == (4 * FUSED_STAGES + SETTLE, 0), (tri4, ops4)

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


def _measure(method, cases):
    code = ("import json, sys, hook_launches as h\n"
            f"print(json.dumps([h.measure({method!r}, t, b)[:4] for t, b in {cases!r}]))")
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

#!/usr/bin/env bash
# The GPU round: every GPU figure issue 40 asks for, in one command, on one NVIDIA GPU.
#
#     bash benchmarks/gpu_round.sh OUT_DIR        (or: make gpu-round OUT=OUT_DIR)
#
# No network, no install: it runs the python3 that is there ($PYTHON to override) on this
# checkout (PYTHONPATH=src), each step under its own timeout, and writes into OUT_DIR:
#   env.txt           nvidia-smi, python / torch / CUDA / triton versions
#   gpu_check.txt     python -m geofp8.tools.gpu_check, every section, rows printed as made
#   cuda_bucket.txt   benchmarks/cuda_bucket.py: one 25 MiB bucket's stages timed with CUDA
#                     events, fused and torch paths, E4M3 and NVFP4, N = 2 and 8
#   overlap.txt       benchmarks/overlap_trace.py: streams, codec kernels under backward's
#                     GEMMs, and its VERDICT line
#   overlap_trace.json.gz   the profiler's Chrome trace of one DDP step (chrome://tracing)
#   summary.txt       the table printed at the end (each step's exit status and seconds,
#                     gpu_check's failed and slow rows, the bucket timings, the verdict)
#
# Time (sized on the CPU, for Triton 3.6 on an H100 host; the session's device budget is
# 15 minutes with the machine's start): 17 Triton kernels (gpu_check's "every Triton kernel
# launched" row counts them) in 47 specializations (dtypes, constexprs, integer
# divisibility) counted in gpu_check's fused sections under the interpreter, 60-80 with the
# other sections, at about 1 s of compile each: 1-1.5 minutes; the 31 methods' 1-rank NCCL
# runs about 3 s each, 1.5 minutes; the rest of gpu_check under a minute; cuda_bucket 8
# rows (its kernels already in Triton's cache) and overlap_trace (NCCL start, 4 steps)
# under a minute each. About 4-5 minutes in all; the timeouts below cap it at 8
# (20 + 270 + 90 + 90 s).
set -u
OUT=${1:?usage: bash benchmarks/gpu_round.sh OUT_DIR}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2  # absolute: the steps run from the root
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
declare -a STEPS=()

step() {  # step NAME SECONDS LOG COMMAND...: run it under its timeout, log, remember rc, s
    local name=$1 limit=$2 log=$3 start rc
    shift 3
    start=$(date +%s)
    echo "== $name (timeout ${limit}s): $*" | tee -a "$OUT/$log"
    timeout --kill-after=10 "$limit" "$@" >>"$OUT/$log" 2>&1
    rc=$?
    STEPS+=("$(printf '%-12s rc=%-4s %4ss' "$name" "$rc" "$(( $(date +%s) - start ))")")
    tail -n +2 "$OUT/$log" | tail -n 3
}

step env 20 env.txt bash -c "nvidia-smi; $PYTHON -c 'import sys, torch; \
print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"no CUDA device\"); \
import triton; print(\"triton\", triton.__version__)'"
step gpu_check 270 gpu_check.txt "$PYTHON" -m geofp8.tools.gpu_check
step cuda_bucket 90 cuda_bucket.txt "$PYTHON" benchmarks/cuda_bucket.py --sizes 25 \
    --ranks 2 8 --methods fp8-ef nvfp4-ef --paths fused torch
step overlap 90 overlap.txt "$PYTHON" benchmarks/overlap_trace.py --trace "$OUT/overlap_trace.json"
[ -f "$OUT/overlap_trace.json" ] && gzip -f "$OUT/overlap_trace.json"

{
    echo "GPU round summary ($(date -u +%FT%TZ))"
    grep -m1 -E "^torch" "$OUT/env.txt"
    echo
    echo "step         exit status, seconds (124/137: timed out)"
    printf '%s\n' "${STEPS[@]}"
    echo
    row='^\[[a-z-]+\] .*  '  # gpu_check's rows as printed: [section] name  verdict  detail
    echo "gpu_check rows: $(grep -cE "${row}ok  " "$OUT/gpu_check.txt") ok, \
$(grep -cE "${row}FAIL  " "$OUT/gpu_check.txt") FAIL, \
$(grep -cE "${row}SLOW  " "$OUT/gpu_check.txt") SLOW (a goal missed)"
    grep -E "${row}(FAIL|SLOW)  |^\[bucket\]|q\+EF\+d|passed, .* failed" "$OUT/gpu_check.txt"
    echo
    grep -E '^\|' "$OUT/cuda_bucket.txt"
    echo
    grep -E '^VERDICT' "$OUT/overlap.txt" || echo "overlap: no verdict (see overlap.txt)"
} | tee "$OUT/summary.txt"

#!/usr/bin/env bash
# Two device calls (~5 min each, H100 or H200) that decide the det-skinny experiment (bench/experiments/README.md):
# skinny_gemm's batch-invariant mode in place of fixed_gemm under --deterministic (OPENINFER_EXP_DET_SKINNY=1).
# Here, first (no device time), on a tree with the patches applied (branch exp/det-skinny, or `git am` on main):
#   bash bench/build_wheel.sh
# Then, carrying .whl: device run `bash bench/experiments/det-skinny/evaluate.sh tests`, and if they pass,
# `bash bench/experiments/det-skinny/evaluate.sh ab` (no argument: both in one call, where the A/B may run out of the
# call's 10 minutes and be skipped).
# Order: the kernel's own tests (the small ones name the broken piece), fixed_gemm's tests without the switch, the
# engine's deterministic tests with it, then the A/B: the same bench_engine command with the switch 0 and 1.
set -uo pipefail
export PYTHONUNBUFFERED=1
source bench/device_setup.sh || exit 1
export OPENINFER_TEST_CACHE=/tmp/ckpt
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
T0=$(date +%s); mkdir -p $OUT/j
left() { [ $(( $(date +%s) - T0 )) -lt $1 ] || { echo "skipped: $2"; return 1; }; }
el() { echo "[$(( $(date +%s) - T0 )) s] $1"; }
PT="python3 -m pytest -q -p no:cacheprovider"
STAGE=${1:-all}
if [ "$STAGE" != ab ]; then
# 1. the kernel: the pieces first, stop at the first failure; then the shapes
timeout 60 $PT -x tests/test_gpu_det_skinny.py -k "chunk_rows or column_position or split_rule" 2>&1 | tee $OUT/pieces.log | tail -3
left 150 shapes && timeout 150 $PT tests/test_gpu_det_skinny.py -k "not chunk_rows and not column_position and not split_rule" \
  2>&1 | tee $OUT/det_skinny.log | tail -4
el "kernel tests"
# 2. without the switch: the plain skinny_gemm (its grid gained the chunk dimension) and fixed_gemm (unchanged);
#    then the engine's deterministic tests with the switch
left 210 plain && timeout 100 $PT tests/test_gpu_skinny_gemm.py 2>&1 | tee $OUT/skinny_plain.log | tail -2
left 300 fixed && timeout 50 $PT tests/test_gpu_kernels.py -k fixed_gemm 2>&1 | tee $OUT/fixed.log | tail -2
# (test_gpu_consistency.py runs the default kernels, not --deterministic: it does not reach the mode)
# the switch really routes Gemm::run(fixed) here (else the engine tests below would pass on fixed_gemm)
OPENINFER_EXP_DET_SKINNY=1 timeout 30 $PT tests/test_gpu_det_skinny.py -k routes_here 2>&1 | tail -1
left 340 engine && OPENINFER_EXP_DET_SKINNY=1 timeout 220 $PT tests/test_deterministic.py tests/test_gpu_graphs.py \
  tests/test_gpu_drafter.py tests/test_gpu_verify_graphs.py -k deterministic \
  2>&1 | tee $OUT/engine_tests.log | tail -4
el "engine tests"
fi
[ "$STAGE" = tests ] && exit 0
[ "$STAGE" = ab ] && T0=$(( $(date +%s) - 300 ))  # alone: the A/B's limits below hold from 300 s on
# 3. the GEMMs alone: cuBLASLt, fixed_gemm's pick, the invariant mode, a 4B step's projections x 36 in one graph
left 460 chain && timeout 60 python3 bench/bench_kernels.py --gemm-chain 4b --rows 1,8,32,64,256,1024 --configs=-2,-1,-4 \
  --out $OUT/j/gemm_chain.json 2>&1 | grep -E "^4b"
# 4. the A/B: deterministic's cost over the default, with fixed_gemm (switch 0) and with the invariant mode (1)
for s in 0 1; do
  left 500 "engine switch $s" && OPENINFER_EXP_DET_SKINNY=$s timeout 80 python3 bench/bench_engine.py --preset qwen3-4b \
    --batches 1,8,32,64 --prefill-len 1024 --steps 24 --options "deterministic=false;deterministic=true" \
    --out $OUT/j/engine_s$s.json 2>&1 | grep -E "^qwen3" | sed "s/^/switch=$s /"
done
el "A/B"
python3 - <<'PY'
import json, glob, os
rows = {}
for s in (0, 1):
    f = os.path.join(os.environ["OUT"], "j", f"engine_s{s}.json")
    if not os.path.exists(f):
        continue
    for r in json.load(open(f))["rows"]:
        rows[(s, r["options"], r["what"], r.get("batch", r.get("tokens")))] = r["gpu_ms_median"]
print("deterministic cost over the default (GPU ms median): switch 0 = fixed_gemm, 1 = skinny_gemm_invariant")
for (s, opt, what, n), ms in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][2], str(kv[0][3]))):
    if opt != "deterministic=true":
        continue
    base = rows.get((s, "deterministic=false", what, n))
    if base:
        print(f"switch={s} {what:8} {n!s:>5} default {base:8.3f} det {ms:8.3f}  +{100 * (ms / base - 1):6.1f}%")
PY
tar czf $OUT/json.tgz -C $OUT j && rm -rf $OUT/j

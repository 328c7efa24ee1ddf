#!/usr/bin/env bash
# One device call on main after prefill-wgmma and det-skinny merged (2026-12-07), most needed first: their tests and the
# engine's deterministic tests on the merged tree, cold == hit consistency and the HF comparison (prefill attention changed),
# the 4B engine (decode 1/8/32/64, prefill 1,024 / 8,192) default and --deterministic in one process, and the
# controlled-acceptance serve run under --deterministic (exact recordings, the bit-for-bit lossless check). Carry .whl.
set -uo pipefail
export PYTHONUNBUFFERED=1
source bench/device_setup.sh || exit 1
export OPENINFER_TEST_CACHE=/tmp/ckpt PYTHONPATH=$PYTHONPATH:$PWD/bench
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; cat .whl/COMMIT
T0=$(date +%s) END=${END:-380}
rest() { echo $(( END - $(date +%s) + T0 )); }
el() { echo "[$(( $(date +%s) - T0 )) s] $1"; }
PT="python3 -m pytest -q -p no:cacheprovider -rfE"
t() { local cap=$1; shift; local r=$(( $(rest) - 5 )); [ $r -gt 20 ] || { echo "skipped: $*"; return; }; timeout $(( cap < r ? cap : r )) "$@"; }
t 60 $PT -x tests/test_gpu_prefill_wgmma.py 2>&1 | tee $OUT/wgmma.log | tail -2
t 80 $PT tests/test_deterministic.py tests/test_gpu_graphs.py tests/test_gpu_drafter.py tests/test_gpu_verify_graphs.py -k deterministic 2>&1 | tee $OUT/det_engine.log | tail -2
el tests
CK=/tmp/ckpt/openinfer-ckpt/qwen3-4b
[ -f $CK/config.json ] || python3 -m openinfer.tools.random_checkpoint --preset qwen3-4b --out $CK > /dev/null 2>&1
t 90 env OPENINFER_TEST_DEVICE=cuda OPENINFER_TEST_MODEL=$CK OPENINFER_TEST_REPORT=$OUT $PT tests/test_gpu_consistency.py 2>&1 | tee $OUT/consistency.log | tail -2
el consistency
t 120 $PT tests/test_gpu_det_skinny.py tests/test_gpu_kernels.py -k "det_skinny or fixed_gemm or paged_attention or invariant" 2>&1 | tee $OUT/kernels.log | tail -2
el kernels
t 120 env OPENINFER_TEST_DEVICE=cuda OPENINFER_TEST_MODEL=$CK OPENINFER_TEST_REPORT=$OUT $PT tests/test_gpu_model.py -k "4b" 2>&1 | tee $OUT/model.log | tail -2
el model
t 80 python3 bench/bench_engine.py --preset qwen3-4b --batches 1,8,32,64 --prefill-len 1024,8192 --steps 24 \
  --options "deterministic=false;deterministic=true" --out $OUT/engine_4b_det.json 2>&1 | grep -E "^qwen3"
el engine
t 120 python3 bench/spec_bench.py serve --preset qwen3-4b --concurrency 1,4 --taus 1,5,8 --num-drafts 7 --deterministic \
  --out $OUT/spec_serve_4b_det.json 2>&1 | sed -n '/^TPOT and output/,$p'
el done

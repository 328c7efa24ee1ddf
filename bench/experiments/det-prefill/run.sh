#!/usr/bin/env bash
# One device call (~5 min) that decides det-prefill: `git am` the patch on main, `bash bench/build_wheel.sh` here,
# then carry .whl and run this from the patched tree. Bit identity first (stop at a failure), then the timing.
set -uo pipefail
export PYTHONUNBUFFERED=1
source bench/device_setup.sh || exit 1
export OPENINFER_TEST_CACHE=/tmp/ckpt
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; cat .whl/COMMIT
PT="python3 -m pytest -q -p no:cacheprovider -rfE"
timeout 90 $PT -x tests/test_gpu_det_skinny.py -k multi_chunk 2>&1 | tee $OUT/multi_chunk.log | tail -3
grep -qE "[0-9]+ passed" $OUT/multi_chunk.log && ! grep -qE "[0-9]+ (failed|error)" $OUT/multi_chunk.log || { echo "stop: bits differ"; exit 0; }
timeout 150 $PT tests/test_gpu_det_skinny.py -k "not multi_chunk" 2>&1 | tee $OUT/det_skinny.log | tail -3
timeout 80 $PT tests/test_deterministic.py tests/test_gpu_graphs.py tests/test_gpu_drafter.py tests/test_gpu_verify_graphs.py \
  -k deterministic 2>&1 | tee $OUT/engine_tests.log | tail -3
timeout 90 python3 bench/bench_kernels.py --gemm-chain 4b,8b --rows 128,256,1024,2500 --configs=-2,-1 --invariant-chunks 0,1,2,4 \
  --out $OUT/gemm_chain.json 2>&1 | grep -E "^(4b|8b)"
timeout 90 python3 bench/bench_engine.py --preset qwen3-4b --batches 1,8,64 --prefill-len 256,1024 --steps 24 \
  --options "deterministic=false;deterministic=true" --out $OUT/engine_det.json 2>&1 | grep -E "^qwen3"

#!/usr/bin/env bash
# One device call (~6 min on an H100/H200) that decides the prefill wgmma experiment (bench/experiments/README.md).
# Here, first (no device time): git checkout exp/prefill-wgmma (or `git am` this folder's patches on main), then
# `bash bench/build_wheel.sh`. Device: `bash bench/experiments/prefill-wgmma/run.sh`, carrying .whl.
# Order: the layout tests (their messages name the broken piece; nothing else runs if one fails), the rest of the
# kernel's tests, the kernel A/B (us per layer and TFLOP/s, both kernels in one process), the engine's prefill step
# with the switch off and on, and the old attention tests with the switch on (the engine's routing).
set -uo pipefail
export PYTHONUNBUFFERED=1
source bench/device_setup.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p $OUT/j
T="-q -p no:cacheprovider tests/test_gpu_prefill_wgmma.py"
# 1. layout tests (exact answers), under a timeout: a barrier bug hangs
timeout 120 python3 -m pytest -x $T -k layout 2>&1 | tee $OUT/layout.log | tail -25
grep -q " passed" $OUT/layout.log && ! grep -qE "failed|error" $OUT/layout.log || { echo "layout tests failed: stop"; exit 0; }
# 2. real shapes and awkward ones against the reference and the mma.sync kernel
timeout 400 python3 -m pytest $T -k "not layout" 2>&1 | tee $OUT/tests.log | tail -15
# 3. the kernel A/B: 0 the mma.sync kernel, 1 the wgmma kernel (4B heads, then 32B's group of 8)
timeout 150 python3 bench/bench_kernels.py --prefill-attention 1024,8192,1024@31744 --model 4b --wgmma 0,1 \
  --reps 20 --out $OUT/j/prefill_attention_4b.json
timeout 60 python3 bench/bench_kernels.py --prefill-attention 1024,8192 --model 32b --wgmma 0,1 --reps 10 \
  --out $OUT/j/prefill_attention_32b.json
# 4. the engine's prefill step (random 4B weights), switch off and on
for on in 0 1; do
  OPENINFER_EXP_PREFILL_WGMMA=$on timeout 60 python3 bench/bench_engine.py --preset qwen3-4b --batches= \
    --prefill-len 1024,8192 --out $OUT/j/engine_prefill_wgmma$on.json 2>&1 | grep -E "^qwen3|prefill" | sed "s/^/wgmma=$on /"
done
# 5. the existing attention tests with the switch on (prompt-chunk cases then run the wgmma kernel)
OPENINFER_EXP_PREFILL_WGMMA=1 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py \
  -k "paged_attention and 4b" 2>&1 | tee $OUT/old_tests_switch_on.log | tail -3

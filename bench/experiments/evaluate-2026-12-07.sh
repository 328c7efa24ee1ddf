#!/usr/bin/env bash
# Ran once on 2026-12-07 (bench/results/experiments_h100_2026-12-07/); the patches it applies were then merged or dropped.
# One device call (~8 min) that decides the five experiments written on 2026-12-07 (bench/experiments/README.md).
# Here, first (no device time):
#   git checkout -b exp/eval main
#   for d in skinny-gemm verify-graphs markov-one-launch prefill-kernels gemm-autotune-cold; do git am -3 bench/experiments/$d/*.patch; done
#   bash bench/build_wheel.sh                                    # the combined tree, with _bench
#   SITE=$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))')
#   PATH=~/.pyenv/versions/3.12.1/bin:$PATH bash bench/alt_tree.sh main -Ccmake.define.CUBLASLT_INCLUDE_DIR=$SITE/nvidia/cu13/include
#   git show main:bench/spec_bench.py > .alt/spec_bench.py
# Then: device run `bash bench/experiments/evaluate-2026-12-07.sh`, carrying .whl .alt .peers. Every A/B is side
# by side in this one call: main in .alt/, the experiments by their switches (the OPENINFER_EXP_* variables).
set -uo pipefail
export PYTHONUNBUFFERED=1
source bench/device_setup.sh || exit 1
export OPENINFER_TEST_CACHE=/tmp/ckpt PYTHONPATH=$PYTHONPATH:$PWD/bench
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
T0=$(date +%s); mkdir -p $OUT/j
left() { [ $(( $(date +%s) - T0 )) -lt $1 ] || { echo "skipped: $2"; return 1; }; }
el() { echo "[$(( $(date +%s) - T0 )) s] $1"; }
ALT="env PYTHONPATH=$PWD/.alt/src:/tmp/site"
# 1. skinny GEMM: the one-hot layout tests first (they name the broken piece), then the rest
timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_skinny_gemm.py -k layout 2>&1 | tee $OUT/skinny_layout.log | tail -3
left 200 skinny && timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_skinny_gemm.py -k "not layout" 2>&1 | tee $OUT/skinny.log | tail -4
el "skinny tests"
left 230 chain && timeout 60 python3 bench/bench_kernels.py --gemm-chain 4b --rows 4,8,16,32,64 --configs=-2,-3 --out $OUT/j/gemm_chain.json 2>&1 | grep -E "^4b" | tail -20
# 2. the engine: skinny GEMM on/off, the autotune on a cold / warm L2
for cfg in "0 1" "0 0" "1 1"; do set -- $cfg
  left 290 "engine $cfg" && OPENINFER_EXP_SKINNY=$1 OPENINFER_EXP_TUNE_COLD=$2 timeout 50 python3 bench/bench_engine.py --preset qwen3-4b --batches 4,8,32,64 \
    --prefill-len 64 --steps 24 --out $OUT/j/engine_s$1_c$2.json 2>&1 | grep -E "^qwen3" | sed "s/^/skinny=$1 cold=$2 /"
done
el "engine A/B"
# 3. tests of the prefill kernels, the Markov pass and the verify graphs
left 300 tests && timeout 80 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py tests/test_gpu_drafter.py \
  -k "rmsnorm or qk_norm_rope or (paged_attention and 4b) or markov or drafts_follow" 2>&1 | tee $OUT/tests.log | tail -5
left 330 vgraph && timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_verify_graphs.py -k "not 4b" 2>&1 | tee $OUT/vgraph.log | tail -6
el "tests"
# 4. speculative rounds: main against the experiments (graphed, with the eager row beside it), skinny GEMM on
D4=/tmp/ckpt/dspark-qwen3-4b
for tree in alt skinny; do
  left 380 "spec $tree" || continue
  [ -f $D4/config.json ] || python3 -m openinfer.tools.random_checkpoint --preset dspark-qwen3-4b --out $D4 > /dev/null 2>&1
  if [ $tree = alt ]; then P=$ALT SB=.alt/spec_bench.py; else P="env OPENINFER_EXP_SKINNY=1" SB=bench/spec_bench.py; fi
  timeout 45 $P python3 $SB rounds --preset qwen3-4b --batches 1,4 --spans 8 --rounds 10 --draft-model-path $D4 --no-plain-engine \
     --out $OUT/j/spec_$tree.json > /dev/null 2>&1 || echo "spec $tree failed"
done
el "spec"
# 5. prefill: main against the new RMSNorm / RoPE kernels (64-row attention items as main) and with 128-row items longest first
PF="--preset qwen3-4b --batches= --prefill-len 1024,8192"
left 420 "pf alt" && $ALT timeout 35 python3 bench/bench_engine.py $PF --out $OUT/j/pf_alt.json > /dev/null 2>&1
for cfg in "64 0" "128 1"; do set -- $cfg
  left 430 "pf $cfg" && OPENINFER_EXP_ATTN_ROWS=$1 OPENINFER_EXP_ATTN_LPT=$2 timeout 35 python3 bench/bench_engine.py $PF --out $OUT/j/pf_r$1_l$2.json > /dev/null 2>&1
done
el "prefill"
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/j/*.json")):
    n = os.path.basename(f)
    if n.startswith("gemm"): continue
    for r in json.load(open(f))["rows"]:
        print(n, r["what"], r.get("batch", r.get("tokens")), "wall %.3f gpu %.3f" % (r["wall_ms_median"], r["gpu_ms_median"]),
              "draft %.3f" % r["draft_ms_median"] if "draft_ms_median" in r else "", "init %.2f" % r["engine_init_s"] if "engine_init_s" in r else "")
PY
tar czf $OUT/json.tgz -C $OUT j && rm -rf $OUT/j

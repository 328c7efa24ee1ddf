#!/usr/bin/env bash
# One device call (~4-8 min) after the 2026-12-07 merges (export T0 when GPU tests run first in the same call): the Markov one-launch A/B (.alt/ = a28033b, the merge
# before it, built with bench/alt_tree.sh a28033b; its spec_bench.py copied to .alt/), then issue #24's round
# costs (4B with DSpark-7 and DFlash-16 drafters, 8B with DSpark-7; batch 1/4/8/32, beside the plain engine's
# graphed decode step), TPOT at controlled acceptance, the projection, and issue #25's engine figures (4B decode
# 1/8/32/64 and a 1,024-token prefill). Carry .whl .alt .peers.
set -uo pipefail
export PYTHONUNBUFFERED=1
source bench/device_setup.sh || exit 1
export OPENINFER_TEST_CACHE=/tmp/ckpt PYTHONPATH=$PYTHONPATH:$PWD/bench
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cat .whl/COMMIT .alt/REV
T0=${T0:-$(date +%s)}; mkdir -p $OUT  # T0: the call's start, when something ran before this script
END=${END:-560}  # seconds after T0 by which everything has ended
rest() { echo $(( END - $(date +%s) + T0 )); }
left() { [ $(( $(date +%s) - T0 )) -lt $1 ] || { echo "skipped: $2"; return 1; }; }
el() { echo "[$(( $(date +%s) - T0 )) s] $1"; }
ck() { local d=/tmp/ckpt/$1; [ -f $d/config.json ] || python3 -m openinfer.tools.random_checkpoint --preset $1 --out $d > /dev/null 2>&1; echo $d; }
D4=$(ck dspark-qwen3-4b)
# 1. the Markov pass: one launch (this tree) against the per-slot gather + GEMM (.alt), both graphed
for tree in alt this; do
  P=""; SB=bench/spec_bench.py
  [ $tree = alt ] && { P="env PYTHONPATH=$PWD/.alt/src:/tmp/site:$PWD/tests:$PWD/bench"; SB=.alt/spec_bench.py; }
  left $(( END - 60 )) "markov $tree" && timeout 60 $P python3 $SB rounds --preset qwen3-4b --batches 1,4,8,16 --spans 8 --rounds 20 --draft-model-path $D4 \
    --no-plain-engine --out $OUT/markov_$tree.json 2>&1 | tail -n 14 | grep -E "verify\+draft" | sed "s/^/$tree /"
done
el "markov A/B"
# 2. issue #25: the engine's decode and prefill steps
left $(( END - 60 )) engine && timeout 60 python3 bench/bench_engine.py --preset qwen3-4b --batches 1,8,32,64 --prefill-len 256,1024 \
  --out $OUT/engine_4b.json 2>&1 | grep -E "^qwen3"
el "engine"
# 3. issue #24: round costs beside the plain engine's graphed decode step, the projection, 8B
left $(( END - 90 )) rounds4b && F4=$(ck dflash-qwen3-4b) && timeout $(( $(rest) - 10 )) python3 bench/spec_bench.py rounds --preset qwen3-4b --context 1024 \
  --batches 1,4,8,32 --spans 8 --draft-model-path $D4,$F4 --out $OUT/spec_rounds_4b.json 2>>$OUT/spec.log | sed -n '/^round costs/,$p'
left $(( END - 5 )) project && python3 bench/spec_bench.py project --rounds-json $OUT/spec_rounds_4b.json --out $OUT/spec_project_4b.json |
  grep -E "PROJECTION|goal| gpu +1 "
left $(( END - 80 )) rounds8b && D8=$(ck dspark-qwen3-8b) && timeout $(rest) python3 bench/spec_bench.py rounds --preset qwen3-8b --context 1024 \
  --batches 1,4,8,32 --spans 8 --draft-model-path $D8 --out $OUT/spec_rounds_8b.json 2>>$OUT/spec.log | tail -n 12
el "rounds"
# 4. issue #24: TPOT at controlled acceptance (the replay drafter), concurrency 1/4/8
left $(( END - 140 )) serve && timeout $(rest) python3 bench/spec_bench.py serve --preset qwen3-4b --concurrency 1,4,8 \
  --taus 1,3,5,8 --num-drafts 7 --out $OUT/spec_serve_4b.json 2>>$OUT/spec.log | sed -n '/^TPOT and output/,$p'
el "serve"

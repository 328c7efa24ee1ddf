#!/usr/bin/env bash
# One device call (~6 min on an H100/H200) that decides the persistent-t experiment (bench/experiments/README.md): the
# persistent kernel's T-token variant (OPENINFER_EXP_PERSISTENT_T=1) for one sequence of 2..8 tokens, i.e. verify
# rounds at batch 1 and short prompt tails.
# Here, first (no device time): on branch exp/persistent-t, `BUILD_DIR=/tmp/bld-persist bash bench/build_wheel.sh`.
# Device: `bash bench/experiments/persistent-t/run.sh`, carrying .whl.
# Order: the tests, smallest first, stopping at the first failure (the fit rules, the switch, a one-layer model, a
# two-layer 0.6B-like model, the 4B, then speculative rounds; every case against the kernel path and the decode
# kernel token by token); then the A/B with the switch 0 and 1 in this call: spec_bench rounds (4B, batch 1, span 8,
# a random DSpark drafter: the plain engine's decode step and verify step, the drafter engine's verify+draft round,
# graphed and eager) and bench_engine (decode batch 1 at 1k context, prompts of 2, 5 and 8 tokens); last, if time
# is left, the verify-graph tests of the 4B drafter with the switch on.
# Merge bar: verify at batch 1, T = 8 (the plain engine's verify row) <= 1.15 x its decode row, and no decode
# (T = 1) regression between the two runs (the decode kernel's SASS is main's; noise only).
set -uo pipefail
export PYTHONUNBUFFERED=1
source bench/device_setup.sh || exit 1
export OPENINFER_TEST_CACHE=/tmp/ckpt PYTHONPATH=$PYTHONPATH:$PWD/bench
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
T0=$(date +%s); mkdir -p $OUT/j
left() { [ $(( $(date +%s) - T0 )) -lt $1 ] || { echo "skipped: $2"; return 1; }; }
el() { echo "[$(( $(date +%s) - T0 )) s] $1"; }
ok() { grep -qE "[0-9]+ passed" $1 && ! grep -qE "[0-9]+ (failed|error)" $1; }
PT="python3 -m pytest -q -x -rfE -s -p no:cacheprovider"
F=tests/test_gpu_persistent_t.py
DSPARK=$OPENINFER_TEST_CACHE/openinfer-ckpt/dspark-qwen3-4b
# the random drafter checkpoint (~2.6 GB), written once, in the background while the first tests run
DPID=
if [ ! -f $DSPARK/config.json ]; then
  python3 -m openinfer.tools.random_checkpoint --preset dspark-qwen3-4b --out $DSPARK > $OUT/dspark.log 2>&1 &
  DPID=$!
fi
# 1. the tests (a barrier or flag bug hangs: the timeouts end it)
timeout 90 $PT $F -k "fits or switch or one_layer" 2>&1 | tee $OUT/t1.log | grep -E "^1 layer|passed|failed|rror" | tail -8
ok $OUT/t1.log || { echo "stop: the first tests failed ($OUT/t1.log)"; exit 0; }
el "fit rules, switch, one layer"
timeout 100 $PT $F -k "small_model or not_consecutive" 2>&1 | tee $OUT/t2.log | grep -E "^small|passed|failed|rror" | tail -18
ok $OUT/t2.log || { echo "stop: the 0.6B-like model failed ($OUT/t2.log)"; exit 0; }
el "0.6B-like"
timeout 120 $PT $F -k "test_4b" 2>&1 | tee $OUT/t3.log | grep -E "^4B|passed|failed|rror" | tail -18
ok $OUT/t3.log || { echo "stop: the 4B failed ($OUT/t3.log)"; exit 0; }
el "4B"
[ -n "$DPID" ] && { wait $DPID || { echo "the drafter checkpoint failed"; tail -3 $OUT/dspark.log; exit 0; }; }
timeout 120 $PT $F -k "verify" 2>&1 | tee $OUT/t4.log | grep -E "rounds:|passed|failed|rror" | tail -6
ok $OUT/t4.log || { echo "stop: speculative rounds failed ($OUT/t4.log)"; exit 0; }
el "speculative rounds"
# 2. the A/B: the same commands with the switch off (main's kernels) and on
# (start guards + timeouts keep the call under ~570 s even when a stage runs long; typically ~6 min in all)
for s in 0 1; do
  left $(( 350 + 110 * s )) "rounds switch $s" && OPENINFER_EXP_PERSISTENT_T=$s timeout 110 python3 bench/spec_bench.py rounds \
    --preset qwen3-4b --batches 1 --spans 8 --context 1024 --draft-model-path $DSPARK --rounds 20 \
    --out $OUT/j/rounds_t$s.json 2>&1 | grep -E "^target" | sed "s/^/switch=$s /"
done
el "rounds"
for s in 0 1; do
  left $(( 470 + 45 * s )) "engine switch $s" && OPENINFER_EXP_PERSISTENT_T=$s timeout 55 python3 bench/bench_engine.py --preset qwen3-4b \
    --batches 1 --ctx 1024 --steps 24 --prefill-len 2,5,8 --out $OUT/j/engine_t$s.json 2>&1 | grep -E "^qwen3" \
    | sed "s/^/switch=$s /"
done
el "engine"
python3 - <<'PY'
import json, os
j = os.path.join(os.environ["OUT"], "j")
def rows(name):
    f = os.path.join(j, name)
    return json.load(open(f))["rows"] if os.path.exists(f) else []
print("GPU ms medians (switch 0: main's kernels, 1: the T-token kernel); bar: verify T=8 <= 1.15 x decode")
for s in (0, 1):
    r = {(x["engine"], x["what"]): x for x in rows(f"rounds_t{s}.json")}
    dec, ver = r.get(("target", "decode")), r.get(("target", "verify"))
    vd = next((x for (e, w), x in r.items() if e != "target" and w == "verify+draft"), None)
    vde = next((x for (e, w), x in r.items() if e != "target" and w == "verify+draft eager"), None)
    if dec and ver:
        x = ver["gpu_ms_median"] / dec["gpu_ms_median"]
        print(f"switch={s} decode {dec['gpu_ms_median']:.3f}  verify(8) {ver['gpu_ms_median']:.3f}  x {x:.3f} "
              f"({'meets' if x <= 1.15 else 'misses'} 1.15)" +
              (f"  round graph {vd['gpu_ms_median']:.3f} (draft {vd['draft_ms_median']:.3f})" if vd else "") +
              (f"  round eager {vde['gpu_ms_median']:.3f}" if vde else ""))
    for x in rows(f"engine_t{s}.json"):
        n = x.get("batch", x.get("tokens"))
        print(f"switch={s} engine {x['what']:8} {n!s:>5} gpu {x['gpu_ms_median']:.3f} wall {x['wall_ms_median']:.3f}")
PY
# 3. the existing verify-graph tests of the 4B drafter with the switch on (bucket 1 is the T-token kernel)
left 480 "verify-graph tests" && OPENINFER_EXP_PERSISTENT_T=1 timeout 90 $PT tests/test_gpu_verify_graphs.py \
  -k "dspark-qwen3-4b" 2>&1 | tail -3
tar czf $OUT/json.tgz -C $OUT j && rm -rf $OUT/j
el "done"

#!/usr/bin/env bash
# One device call over several trees: this checkout (its wheel in .whl/) and experiment trees packed by
# `bash bench/experiments/pack_tree.sh NAME REV` into .exp/NAME.tgz (sources, tests, bench, their wheel).
# Carry .whl .peers .exp. Each phase is bounded so that the call ends by END seconds after its start.
#
#   bash bench/experiments/trees.sh tests:170 persist # phases in order; NAME:S ends the phase S seconds after its start
#
# Phases: tests (this tree's GPU tests that the 2026-12-07 merges reach, HF comparison of the 4B included),
# persist (the persistent-t tree's tests and its A/B; the fa3 and det phases that decided prefill-wgmma and
# det-skinny are in git history, 2026-12-07), spec (issue
# #24's round costs, TPOT at controlled acceptance, the projection: measure-2026-12-07.sh without its A/B),
# timeline (4B kernel timelines through CUPTI: decode at batch 8, an 8-token chunk, --deterministic batch 1), ab (the
# engine and speculative rounds of this tree, .exp/base.tgz and every other .exp tree; the fused-norm and short-items
# phases that ran on 2026-12-07 are in git history), model (the 4B against HF), tt (TTESTS inside the TT trees), longverify (verify at long contexts), specdet (spec_bench serve --deterministic), sh (the commands in SH, in this tree, OUT
# set to the phase's folder).
set -uo pipefail
export PYTHONUNBUFFERED=1
ROOT=$PWD OUTROOT=$OUT T0=$(date +%s) END=${END:-585}
source bench/device_setup.sh || exit 1
export OPENINFER_TEST_CACHE=/tmp/ckpt
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
rest() { echo $(( PEND - $(date +%s) )); }  # seconds left to the phase
tmo() { local r=$(( $(rest) - 3 )) t=$1; [ $t -lt $r ] || t=$r; echo $(( t > 1 ? t : 1 )); }  # a step's timeout inside the phase
el() { echo "[$(( $(date +%s) - T0 )) s] $1"; }
others() { ls $ROOT/.exp | grep -v '^base' | sed 's/.tgz//'; }  # every packed tree but base
tree() {  # unpacks .exp/$1.tgz once (with this checkout's tokenizer.json, which pack_tree.sh leaves out), prints its folder
  local d=/tmp/t-$1 tok=src/openinfer/data/qwen3-tokenizer/tokenizer.json
  [ -d $d ] || { mkdir -p $d && tar xzf $ROOT/.exp/$1.tgz -C $d && { [ -f $d/$tok ] || cp $ROOT/$tok $d/$tok; }; }; echo $d; }
in_tree() {  # (in a subshell) into tree $1 ("this": this checkout) with its wheel installed and bench/ importable
  cd "$([ $1 = this ] && echo $ROOT || tree $1)" && source bench/device_setup.sh && export PYTHONPATH=$PYTHONPATH:$PWD/bench; }
for spec in "$@"; do
  phase=${spec%%:*}; PEND=$(( T0 + END )); [ "$spec" != "$phase" ] && PEND=$(( $(date +%s) + ${spec#*:} < PEND ? $(date +%s) + ${spec#*:} : PEND ))
  el "== $phase ($(rest) s for it)"
  [ $(rest) -gt 30 ] || { echo "skipped: $phase"; continue; }
  mkdir -p $OUTROOT/$phase; export OUT=$OUTROOT/$phase
  case $phase in
    tests) CK=/tmp/ckpt/openinfer-ckpt/qwen3-4b
      [ -f $CK/config.json ] || python3 -m openinfer.tools.random_checkpoint --preset qwen3-4b --out $CK > /dev/null
      OPENINFER_TEST_DEVICE=cuda OPENINFER_TEST_MODEL=$CK OPENINFER_TEST_REPORT=$OUT OPENINFER_TEST_TIMES=$OUT/times.tsv timeout $(( $(rest) - 5 )) \
        python3 -m pytest -q -rfEs -p no:cacheprovider ${TESTS:-tests/test_gpu_verify_graphs.py tests/test_gpu_graphs.py \
        tests/test_gpu_drafter.py tests/test_gpu_step_contract.py tests/test_gpu_model.py tests/test_server.py \
        tests/test_gpu_consistency.py} -k "not 0.6b and not 8b" 2>&1 | tee $OUT/tests.log | tail -25 ;;
    persist) (cd $(tree persist) && source bench/device_setup.sh && F="python3 -m pytest -q -x -rfE -s -p no:cacheprovider tests/test_gpu_persistent_t.py"
      # persistent-t/run.sh's tests, smallest first, with a quick A/B (decode b1 vs an 8-token step) before the 4B's
      ok() { grep -qE "[0-9]+ passed" $1 && ! grep -qE "[0-9]+ (failed|error)" $1; }
      timeout $(tmo 60) $F -k "fits or switch or one_layer" 2>&1 | tee $OUT/t1.log | grep -E "^1 layer|passed|failed|rror" | tail -8
      ok $OUT/t1.log || { echo "stop: the first tests failed"; exit 0; }
      timeout $(tmo 80) $F -k "small_model or not_consecutive" 2>&1 | tee $OUT/t2.log | grep -E "^small|passed|failed|rror" | tail -12
      for s in 0 1; do OPENINFER_EXP_PERSISTENT_T=$s timeout $(tmo 50) python3 bench/bench_engine.py --preset qwen3-4b --batches 1 \
        --ctx 1024 --steps 24 --prefill-len 8 --out $OUT/engine_t$s.json 2>&1 | grep -E "^qwen3" | sed "s/^/switch=$s /"; done
      ok $OUT/t2.log && timeout $(tmo 300) $F -k "test_4b" 2>&1 | tee $OUT/t3.log | grep -E "^4B|passed|failed|rror" | tail -12) ;;
    spec) T0=$T0 END=$END bash bench/experiments/measure-2026-12-07.sh 2>&1 | grep -v "^alt \|markov" ;;
    timeline) PS="timeout 60 python3 bench/profile_step.py --preset qwen3-4b --ctx 1024 --steps 4"
      # where the kernel path's time goes past its GEMMs: decode at batch 8 (graphed), an 8-token chunk of one
      # sequence (a verify's shape, eager) and batch 1 under --deterministic (the kernel path, graphed)
      # (TL: other "name:args" lines, e.g. "b32:--batch 32 --graph" "det1L:--batch 1 --graph --options deterministic=true,max_model_len=40960")
      TLS=("b8:--batch 8 --graph" "t8:--batch 1 --chunk 8" "det1:--batch 1 --graph --options deterministic=true")
      [ -n "${TL:-}" ] && eval "TLS=($TL)"
      for c in "${TLS[@]}"; do
        $PS ${c#*:} --trace $OUT/${c%%:*}.json > $OUT/${c%%:*}.log 2>&1; echo "-- ${c%%:*}"
        python3 bench/timeline_summary.py $OUT/${c%%:*}.json | head -28; done ;;
    model) CK=/tmp/ckpt/openinfer-ckpt/qwen3-4b
      [ -f $CK/config.json ] || python3 -m openinfer.tools.random_checkpoint --preset qwen3-4b --out $CK > /dev/null
      OPENINFER_TEST_DEVICE=cuda OPENINFER_TEST_MODEL=$CK OPENINFER_TEST_REPORT=$OUT timeout $(tmo 200) \
        python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_gpu_model.py -k 4b 2>&1 | tee $OUT/model.log | tail -4 ;;
    ab) # GPU ms of this tree against .exp/base (the tree before) and the other .exp trees: decode, an 8-token step, prefill, both modes; rounds
      for t in $([ -f $ROOT/.exp/base.tgz ] && echo base) this $(others); do
        (in_tree $t
         timeout $(tmo 100) python3 bench/bench_engine.py --preset qwen3-4b --batches ${AB_BATCHES:-1,8,32,64} --prefill-len ${AB_PREFILL:-8,1024} --steps 24 \
           --options "deterministic=false;deterministic=true" --out $OUT/engine_$t.json 2>&1 | grep -E "^qwen3" | sed "s/^/$t /"
         D4=/tmp/ckpt/dspark-qwen3-4b; [ -f $D4/config.json ] || python3 -m openinfer.tools.random_checkpoint --preset dspark-qwen3-4b --out $D4 > /dev/null 2>&1
         timeout $(tmo 100) python3 bench/spec_bench.py rounds --preset qwen3-4b --context 1024 --batches ${AB_ROUNDS:-1,4,8} --spans 8 \
           --draft-model-path $D4 --out $OUT/rounds_$t.json 2>>$OUT/spec.log | sed -n '/^round costs/,$p' | sed "s/^/$t /")
      done ;;
    tt) # GPU tests inside packed trees: TT="name ..." (default every .exp tree but base), TTESTS the files and options
      # (TTESTS_name for one tree); a tree's first failure stops it
      for t in ${TT:-$(others)}; do tests=$(eval echo "\${TTESTS_$t:-\${TTESTS:?TTESTS: the test files}}")
        (in_tree $t && eval timeout $(tmo 400) python3 -m pytest -q -x -rfE -p no:cacheprovider $tests 2>&1 | tee $OUT/$t.log | tail -6 | sed "s/^/$t /"); done ;;
    longverify) # the plain engine's verify over 8 tokens at long contexts, this tree and every .exp tree but base (LV_CTX)
      for ctx in ${LV_CTX:-2048 8192 16384}; do for t in this $(others); do
        (in_tree $t
         timeout $(tmo 60) python3 bench/spec_bench.py rounds --preset qwen3-4b --context $ctx --batches ${LV_BATCHES:-1,4} --spans 8 \
           --rounds 12 --out $OUT/verify_${t}_$ctx.json 2>>$OUT/spec.log | grep -E "target +(decode|verify)" | sed "s/^/$t ctx=$ctx /")
      done; done ;;
    specdet) timeout $(tmo 200) python3 bench/spec_bench.py serve --preset qwen3-4b --concurrency 1,4,8 --taus 1,5,8 \
        --num-drafts 7 --deterministic --out $OUT/spec_serve_4b_det.json 2>&1 | sed -n '/^TPOT and output/,$p' ;;
    sh) (in_tree this && timeout $(tmo 590) bash -c "${SH:?SH: the commands}" 2>&1 | tee $OUT/sh.log | tail -${SH_TAIL:-40}) ;;  # any commands, this tree
    *) echo "unknown phase $phase" ;;
  esac
  OUT=$OUTROOT; (cd $OUTROOT && tar czf $phase.tgz $phase && rm -rf $phase)
done
el "done"

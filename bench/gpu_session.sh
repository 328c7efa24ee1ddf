#!/usr/bin/env bash
# One device call that builds nothing (carry the cp312 wheel in .whl/, see docs/development.md) and
# runs the chosen stages, logs and JSON to $OUT (at most 8 files come back: keep STAGES short).
#
#   STAGES="kernels graphs model server bench" bash bench/gpu_session.sh
#
# Stages: kernels (tests/test_gpu_kernels.py, ~6 min), drafter (tests/test_gpu_drafter.py), contract (tests/test_gpu_step_contract.py), kquick (its GEMV/attention subset, ~1 min),
# ncu (per-kernel times of one 4B batch-1 decode step), graphs (graph == eager, 32B random load),
# model (whole model vs HF; writes the 0.6B and 4B checkpoints), server (OpenAI client suite on the
# CUDA engine, 4B), bench (bench_engine 4B/8B/32B + the torch.compile peer in the same call, ~5 min),
# kbench (bench_kernels), gemmchain (a step's GEMMs, or one projection 36 times, in one graph: cuBLASLt against each fixed_gemm family,
# GC_MODELS at GC_ROWS rows: where each family wins, for the launcher's choice), sweep (serving sweep, POINT_SECONDS, default 8), overlap (concurrency 1 and 64
# with --overlap-steps true and false, side by side), ab (QPS 32 and concurrency 64, 40 s each, for the
# tree in .alt/ (bench/alt_tree.sh) and this one, side by side), footprint, attn (decode attention key
# warps on/off: the attention tests, the graph tests, the kernel A/B), sampling (the sampling tests, then
# decode steps greedy and at the releases' default sampling, for .alt/ if present and this tree), options
# (bench_engine A/B of EngineConfig OPTIONS over PRESETS and BATCHES), engine_ab (bench_engine 4B 1/8/64 and 8B 1
# for .alt/ and this tree, twice alternated), greedy_ab (greedy tokens of a fixed prompt set, both trees),
# hosttier (bench/host_tier_bench.py ttft, multiturn and decode; HT_ARGS are extra arguments), hostab (the
# restore TTFT table at HT_LENGTHS and the 16k breakdown for the tree in .alt/ and this one), prefill_ab
# (bench_engine prefill of PREFILL_LENS tokens, .alt/ and this tree alternated twice), spec
# (bench/spec_bench.py: 4B round costs with random DSpark-7 and DFlash-16 drafters, TPOT at controlled
# acceptance tau 1..8 at concurrency 1/4/8, the projection at DSpark-4B's published tau; 8B round costs;
# SPEC_ARGS are extra arguments to the rounds runs; 4 JSON files), soak (bench/soak.py: SOAK_MINUTES, default 8, of
# mixed traffic at SOAK_RATE req/s on the 4B, then soak.json, soak.svg and the server's log; 8 minutes leave
# a call little room for other stages), path (bench/path_bench.py: where a lone request's microseconds go
# around its step on the 4B, per phase from the server's trace, beside the client's TTFT; path.json and the
# server's log, ~2 min), ttftpath (path_bench's warm and --cold prompt-id kinds at TP_LENGTHS, default 256 1024, then
# ttft_breakdown.py's cold / GPU hit / host restore at TP_BREAKDOWN inside the engine; ~2 min), overload (bench/overload.py: the 4B's saturation at 1024 in / 128 out, measured
# closed-loop at concurrency 64 for 20 s, then OVERLOAD_FACTOR (2) times it for 60 s: every request done
# or a 503 within 100 ms, TTFT bounded; overload.json, ~2 min), gpusuite (every GPU test in one pytest
# process, `-m gpu` over tests/ with the server suite on the 4B: issue #26 item 9; over 10 min on an H100 on
# 2026-12-07, so more than a call; each test's time goes to gpusuite_times.tsv as it ends),
# capsweep (QPS 32 and concurrency 64, 40 s each, a fresh server per point, at each --max-prefill-tokens-while-decoding
# in CAPS, default 1024 2048 4096: issue #25 item 4), determinism (issue #26 item 2: the deterministic tests, 4B and 8B, then its cost: bench_engine 4B 1/8/64 and a
# 1024-token prefill with deterministic off and on; determinism_cost.json).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source "$(dirname "$0")/device_setup.sh" || exit 1
export OPENINFER_TEST_CACHE=${OPENINFER_TEST_CACHE:-/tmp/ckpt} OPENINFER_TEST_REPORT=$OUT
export PYTHONPATH=$PYTHONPATH:$PWD/bench
CKPT4B=$OPENINFER_TEST_CACHE/openinfer-ckpt/qwen3-4b
need_4b() { [ -f "$CKPT4B/config.json" ] || python3 -m openinfer.tools.random_checkpoint --preset qwen3-4b --out "$CKPT4B"; }
# a random drafter checkpoint (dspark-qwen3-4b, dflash-qwen3-8b, ...) in the cache, written once
need_drafter() { [ -f "$OPENINFER_TEST_CACHE/openinfer-ckpt/$1/config.json" ] ||
  python3 -m openinfer.tools.random_checkpoint --preset "$1" --out "$OPENINFER_TEST_CACHE/openinfer-ckpt/$1" >&2
  echo "$OPENINFER_TEST_CACHE/openinfer-ckpt/$1"; }
for stage in ${STAGES:-kernels graphs model server bench}; do
  echo "== $stage"
  case $stage in
    kernels) python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gpu_kernels.py 2>&1 | tee "$OUT/kernels.log" | tail -8 ;;
    drafter) python3 -m pytest -q -rfE -s -p no:cacheprovider tests/test_gpu_drafter.py 2>&1 | tee "$OUT/drafter.log" |
               grep -E "drafts equal|identical|passed|failed|Error" ;;
    contract) python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gpu_step_contract.py 2>&1 | tee "$OUT/contract.log" | tail -8 ;;
    kquick) python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py \
              -k "gemv or (paged_attention and not 32k and 4b) or fills_gpu or (split_attention_equals and 1024)" 2>&1 | tail -3 ;;
    ncu) ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
           python3 bench/profile_step.py --preset qwen3-4b --batch 1 --ctx 1024 > "$OUT/ncu_b1.csv" 2>/dev/null
         python3 bench/ncu_summary.py "$OUT/ncu_b1.csv" | head -12 ;;
    graphs) python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gpu_graphs.py tests/test_gpu_random32b.py 2>&1 | tee "$OUT/graphs.log" | tail -8 ;;
    model) python3 -m pytest -q -rxX -s -p no:cacheprovider tests/test_gpu_model.py 2>&1 | tee "$OUT/model.log" |
             grep -E "rel err|identical to HF|passed|failed|XFAIL" ;;
    server) need_4b && OPENINFER_TEST_DEVICE=cuda OPENINFER_TEST_MODEL=$CKPT4B \
              python3 -m pytest -q -rfE -p no:cacheprovider tests/test_server.py tests/test_server_tools.py 2>&1 |
              tee "$OUT/server.log" | tail -8 ;;
    engine_ab) for tree in alt this alt this; do  # .alt/ from bench/alt_tree.sh REV (with its bench_engine.py), carried
                 PP=$PYTHONPATH; B=bench/bench_engine.py
                 [ $tree = alt ] && { PP=$PWD/.alt/src:/tmp/site:$PWD/tests:$PWD/bench; B=.alt/bench_engine.py; }
                 PYTHONPATH=$PP python3 $B --preset qwen3-4b --batches 1,8,64 --out "$OUT/ab_4b_$tree.json" | grep decode
                 PYTHONPATH=$PP python3 $B --preset qwen3-8b --batches 1 --out "$OUT/ab_8b_$tree.json" | grep decode
               done ;;
    greedy_ab) python3 bench/greedy_outputs.py --out "$OUT/greedy_this.json"
               PYTHONPATH=$PWD/.alt/src:/tmp/site python3 bench/greedy_outputs.py --out "$OUT/greedy_alt.json"
               python3 -c "import json,sys; a,b=(json.load(open(sys.argv[i])) for i in (1,2)); print('greedy identical:', a['batched']==b['batched'] and a['alone']==b['alone'])" "$OUT/greedy_this.json" "$OUT/greedy_alt.json" ;;
    hosttier) for m in ttft multiturn decode; do
                python3 bench/host_tier_bench.py $m --model-path "$(python3 -c 'import sys; sys.path.insert(0, "bench"); from bench_engine import model_dir; print(model_dir("qwen3-4b"))')" \
                  --out "$OUT/host_tier_$m.json" --log-dir /tmp/htlogs ${HT_ARGS:-} 2>>"$OUT/host_tier.log" | tail -12
              done ;;
    hostab) need_4b && for tree in alt this; do  # .alt/ from bench/alt_tree.sh REV, carried: restore TTFT A/B
              PP=$PYTHONPATH; [ $tree = alt ] && PP=$PWD/.alt/src:/tmp/site:$PWD/tests:$PWD/bench
              PYTHONPATH=$PP python3 bench/host_tier_bench.py ttft --model-path "$CKPT4B" --host-gib 8 \
                --lengths ${HT_LENGTHS:-1024,4096,16384} --out "$OUT/ttft_$tree.json" --log-dir /tmp/htlogs 2>>"$OUT/host_tier.log" | tail -5
              PYTHONPATH=$PP python3 bench/ttft_breakdown.py --lengths 16384 --reps 3 --out "$OUT/breakdown_$tree.json" | tail -2
            done ;;
    prefill_ab) for tree in alt this alt this; do  # .alt/ as for hostab: prefill steps of one prompt, both trees
                  PP=$PYTHONPATH; [ $tree = alt ] && PP=$PWD/.alt/src:/tmp/site:$PWD/tests:$PWD/bench
                  for n in ${PREFILL_LENS:-1024 8192}; do
                    PYTHONPATH=$PP python3 bench/bench_engine.py --preset qwen3-4b --batches 1 --prefill-len $n \
                      --out "$OUT/prefill_${tree}_$n.json" | grep -i prefill
                  done
                done ;;
    bench) python3 bench/bench_engine.py --preset qwen3-4b --batches 1,8,32,64 --out "$OUT/engine_4b.json" | tail -6
           python3 bench/bench_engine.py --preset qwen3-4b --batches 1,8 --sampling qwen \
             --out "$OUT/engine_4b_qwen_sampling.json" | grep "decode " 
           python3 bench/bench_engine.py --preset qwen3-8b,qwen3-32b --batches 1 --out "$OUT/engine_8b_32b.json" | tail -5
           [ -f .peers/torch_peer.py ] && timeout 300 python3 .peers/torch_peer.py 4b 1024 1,8,32,64 --compile |
             tee "$OUT/torch_peer.log" ;;
    kbench) python3 bench/bench_kernels.py --out "$OUT/kernels.json" ;;
    gemmchain) python3 bench/bench_kernels.py --gemm-chain ${GC_MODELS:-4b.qkv,4b.o,4b.gate_up,4b.down,4b} \
                 --rows ${GC_ROWS:-1,8,16,32,64,256} --configs=${GC_CONFIGS:--2,-1,0,1,2,3} --out "$OUT/gemm_chain.json" ;;
    sampling) python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py -k sampl 2>&1 | tail -2
              for tree in alt this; do  # .alt/ from bench/alt_tree.sh REV, carried, when present
                [ $tree = alt ] && { [ -d .alt/src ] || continue; }
                PP=$PYTHONPATH; [ $tree = alt ] && PP=$PWD/.alt/src:/tmp/site:$PWD/tests:$PWD/bench
                for smp in qwen top_p greedy; do
                  echo "-- $tree $smp"; PYTHONPATH=$PP python3 bench/bench_engine.py --preset qwen3-4b,qwen3-8b \
                    --batches 1,8 --prefill-len 64 --sampling $smp --out "$OUT/sampling_${tree}_$smp.json" | grep "decode "
                done
              done ;;
    sweep) need_4b && POINT_SECONDS=${POINT_SECONDS:-8} SERVER_CMD="python3 -m openinfer.cli" TAG=qwen3-4b \
             bash bench/run_serving_bench.sh "$CKPT4B" "$OUT/sweep" | tail -16 ;;
    overlap) need_4b && for ov in true false; do
               POINT_SECONDS=${POINT_SECONDS:-25} QPS_GRID=" " CONC_GRID="1 64" EXTRA_QPS=" " EXTRA_CONC=" " \
                 SERVER_ARGS="--overlap-steps $ov" SERVER_CMD="python3 -m openinfer.cli" TAG=qwen3-4b-overlap-$ov \
                 bash bench/run_serving_bench.sh "$CKPT4B" "$OUT/overlap" | tail -3
             done ;;
    ab) need_4b && [ -d .alt/src ] && for tree in alt this; do  # .alt/ from bench/alt_tree.sh REV, carried
          cmd="python3 -m openinfer.cli"; [ $tree = alt ] && cmd="env PYTHONPATH=$PWD/.alt/src:/tmp/site $cmd"
          POINT_SECONDS=${POINT_SECONDS:-40} QPS_GRID="32" CONC_GRID=" " EXTRA_QPS=" " EXTRA_CONC="64" \
            SERVER_CMD="$cmd" TAG=qwen3-4b-$tree bash bench/run_serving_bench.sh "$CKPT4B" "$OUT/ab" | tail -3
        done ;;
    capsweep) need_4b && for cap in ${CAPS:-1024 2048 4096}; do  # the prompt-token cap per step while requests decode
                POINT_SECONDS=${POINT_SECONDS:-40} QPS_GRID="32" CONC_GRID=" " EXTRA_QPS=" " EXTRA_CONC="64" \
                  SERVER_ARGS="--max-prefill-tokens-while-decoding $cap" TAG=qwen3-4b-cap$cap \
                  bash bench/run_serving_bench.sh "$CKPT4B" "$OUT/capsweep" | tail -3
              done ;;
    attn) python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py \
            -k "paged_attention or key_warps or split_attention" 2>&1 | tail -3
          python3 -m pytest -q -p no:cacheprovider tests/test_gpu_graphs.py 2>&1 | tail -2
          python3 bench/bench_kernels.py --attention 1x1024,1x8192,1x32768,2x1024,8x1024,64x1024 \
            --variants 'key_warps=0;key_warps=1' --out "$OUT/attn_kernel_ab.json" ;;
    options) python3 bench/bench_engine.py --preset ${PRESETS:-qwen3-4b,qwen3-8b} --batches ${BATCHES:-1,8} \
             --prefill-len 64 --options "$OPTIONS" --out "$OUT/options_ab.json" | grep -v prefill ;;
    determinism) python3 -m pytest -q -rfE -p no:cacheprovider tests/test_deterministic.py tests/test_gpu_consistency.py \
                   tests/test_gpu_kernels.py tests/test_gpu_graphs.py tests/test_gpu_drafter.py \
                   -k "deterministic or consistency or segmented or fixed_gemm" 2>&1 |
                   tee "$OUT/determinism.log" | tail -8
                 python3 bench/bench_engine.py --preset qwen3-4b --batches 1,8,32,64 --prefill-len 1024 \
                   --options "deterministic=false;deterministic=true" --out "$OUT/determinism_cost.json" | tail -9 ;;
    spec) D4=$(need_drafter dspark-qwen3-4b),$(need_drafter dflash-qwen3-4b)
          python3 bench/spec_bench.py rounds --preset qwen3-4b --context 1024 --draft-model-path "$D4" ${SPEC_ARGS:-} \
            --out "$OUT/spec_rounds_4b.json" 2>>"$OUT/spec.log" | sed -n '/^round costs/,$p'
          python3 bench/spec_bench.py serve --preset qwen3-4b --concurrency 1,4,8 --taus 1-8 --num-drafts 7 \
            --out "$OUT/spec_serve_4b.json" 2>>"$OUT/spec.log" | sed -n '/^TPOT and output/,$p'
          python3 bench/spec_bench.py project --rounds-json "$OUT/spec_rounds_4b.json" --out "$OUT/spec_project_4b.json" |
            grep -E "PROJECTION|goal| gpu +1 "
          python3 bench/spec_bench.py rounds --preset qwen3-8b --context 1024 \
            --draft-model-path "$(need_drafter dspark-qwen3-8b)" ${SPEC_ARGS:-} --out "$OUT/spec_rounds_8b.json" \
            2>>"$OUT/spec.log" | tail -12 ;;
    footprint) need_4b && python3 bench/footprint.py "$CKPT4B" --server-cmd "python3 -m openinfer.cli" \
                 --json "$OUT/footprint.json" | tail -3 ;;
    # SOAK_RATE 32: 80% of the measured 4B saturation at 1024 in / 128 out (~40 req/s). The soak's mix is
    # lighter per request (prompts <= 512 tokens, 3% of 4-6k, <= 128 out), so 32 sits below 80% of its
    # own saturation: load enough to keep batches full without a growing queue. max_model_len 8192 keeps
    # the long prompts at 4-6k tokens (at 40960 they would be 20-30k, about one a second: over half the
    # prefill the 4B did at saturation, 40 x 1024 tokens a second). At 80% of this mix's own saturation:
    # measure it, set SOAK_RATE.
    soak) need_4b && python3 bench/soak.py --serve-args "--model-path $CKPT4B --max-model-len 8192 --log-level warning" \
            --minutes ${SOAK_MINUTES:-8} --rate ${SOAK_RATE:-32} --out "$OUT/soak.json" | tail -7
          python3 bench/soak_plot.py "$OUT/soak.json" "$OUT/soak.svg" ;;
    ttftpath) need_4b && for n in ${TP_LENGTHS:-256 1024}; do for m in warm cold; do  # issue #25: where TTFT goes
                echo "-- $m $n"; python3 bench/path_bench.py --serve-args "--model-path $CKPT4B --device cuda --max-model-len 20000" \
                  --prompt-tokens $n --max-tokens 1 --requests 40 --warmup 5 $([ $m = cold ] && echo --cold) \
                  --out "$OUT/path_${m}_$n.json" | tail -20; done; done
              python3 bench/ttft_breakdown.py --lengths ${TP_BREAKDOWN:-256,1024,16384} --reps 3 --out "$OUT/breakdown.json" ;;
    path) need_4b && python3 bench/path_bench.py --serve-args "--model-path $CKPT4B --device cuda --max-model-len 4096" \
            --out "$OUT/path.json" | tail -26 ;;
    gpusuite) need_4b && OPENINFER_TEST_DEVICE=cuda OPENINFER_TEST_MODEL=$CKPT4B OPENINFER_TEST_TIMES=$OUT/gpusuite_times.tsv \
                python3 -m pytest -q -rfEs --durations=25 -p no:cacheprovider -m gpu tests 2>&1 | tee "$OUT/gpusuite.log" | tail -45 ;;
    overload) need_4b && python3 bench/overload.py --serve-args "--model-path $CKPT4B --log-level warning" \
            --factor ${OVERLOAD_FACTOR:-2} --seconds 60 --out "$OUT/overload.json" | tail -4 ;;
    *) echo "unknown stage $stage" ;;
  esac
done

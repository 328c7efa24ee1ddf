#!/usr/bin/env bash
# Serving sweep: run the seed's QPS grid and concurrency points at 1024 in / 128 out (seed 42), keep
# raising QPS until saturation, add a concurrency-64 point, write one JSON per point plus a combined
# sweep JSON. Each point gets a fresh openinfer-serve (started, /health awaited, stopped after): every
# point sends the same seeded prompts, and a server kept across points would serve them from its
# prefix cache instead of prefilling them.
#
#   bench/run_serving_bench.sh MODEL_DIR [OUT_DIR]
#
# Environment (defaults in brackets):
#   POINT_SECONDS [60]   seconds per point: QPS r sends r*POINT_SECONDS prompts, concurrency
#                        points keep C requests in flight this long. Main knob for GPU time.
#   SERVER_ARGS []       extra openinfer-serve arguments      SERVER_CMD [openinfer-serve]
#   PORT [8000]          HEALTH_TIMEOUT [600] s               TAG [basename of MODEL_DIR]
#   QPS_GRID ["1 2 4 8 10 12 16"]   CONC_GRID ["1 4 8"]   EXTRA_QPS ["24 32 48 64 96 128 192 256"]
#   EXTRA_CONC [64]      INPUT_LEN [1024]  OUTPUT_LEN [128]  SEED [42]
#   SAT_RATIO [0.9]      saturated when achieved req/s < SAT_RATIO * offered
#   SAT_TTFT_MS [2000]   ... or TTFT p50 above this
#   PYTHON [python3]
set -uo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: $0 MODEL_DIR [OUT_DIR]" >&2
  exit 2
fi
MODEL_DIR=$1
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT_DIR=${2:-$HERE/results}
POINT_SECONDS=${POINT_SECONDS:-60}
SERVER_ARGS=${SERVER_ARGS:-}
SERVER_CMD=${SERVER_CMD:-openinfer-serve}
PORT=${PORT:-8000}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-600}
TAG=${TAG:-$(basename "$MODEL_DIR")}
QPS_GRID=${QPS_GRID:-"1 2 4 8 10 12 16"}
CONC_GRID=${CONC_GRID:-"1 4 8"}
EXTRA_QPS=${EXTRA_QPS:-"24 32 48 64 96 128 192 256"}
EXTRA_CONC=${EXTRA_CONC:-64}
INPUT_LEN=${INPUT_LEN:-1024}
OUTPUT_LEN=${OUTPUT_LEN:-128}
SEED=${SEED:-42}
SAT_RATIO=${SAT_RATIO:-0.9}
SAT_TTFT_MS=${SAT_TTFT_MS:-2000}
PYTHON=${PYTHON:-python3}
BASE_URL="http://127.0.0.1:${PORT}"
# A point may not run forever: its own length, the drain, dataset generation, slack.
POINT_TIMEOUT=$((POINT_SECONDS * 3 + 300))

mkdir -p "$OUT_DIR"
SERVER_LOG="$OUT_DIR/${TAG}-server.log"
POINTS_FILE=$(mktemp)
SERVER_PID=""

stop_server() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "stopping server (pid $SERVER_PID)" >&2
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || kill -TERM "$SERVER_PID" 2>/dev/null
    for _ in $(seq 1 60); do
      kill -0 "$SERVER_PID" 2>/dev/null || break
      sleep 0.5
    done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || kill -KILL "$SERVER_PID" 2>/dev/null
    wait "$SERVER_PID" 2>/dev/null
  fi
  SERVER_PID=""
}
trap 'stop_server; rm -f "$POINTS_FILE"' EXIT
trap 'exit 130' INT TERM HUP PIPE

if curl -s -o /dev/null --max-time 2 "$BASE_URL/health"; then
  echo "something already answers on port $PORT; stop it or set PORT" >&2
  exit 1
fi

start_server() {
  # Own process group (setsid) so the whole server tree can be stopped by its id.
  # shellcheck disable=SC2086
  setsid $SERVER_CMD --model-path "$MODEL_DIR" --port "$PORT" $SERVER_ARGS >>"$SERVER_LOG" 2>&1 &
  SERVER_PID=$!
  echo "server pid $SERVER_PID, log $SERVER_LOG" >&2
  local t_start ready=0 deadline=$((SECONDS + HEALTH_TIMEOUT)) code
  t_start=$(date +%s.%N)
  while ((SECONDS < deadline)); do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "server exited before becoming healthy; last log lines:" >&2
      tail -n 30 "$SERVER_LOG" >&2
      exit 1
    fi
    code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$BASE_URL/health" || true)
    if [[ "$code" == "200" ]]; then ready=1; break; fi
    sleep 0.2
  done
  if ((ready == 0)); then
    echo "server not healthy after ${HEALTH_TIMEOUT}s" >&2
    tail -n 30 "$SERVER_LOG" >&2
    exit 1
  fi
  echo "server ready after $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t_start}") s" >&2
}
: >"$SERVER_LOG"

# run_point KIND VALUE FILE ARGS... ; appends "KIND VALUE FILE" to the points list.
run_point() {
  local kind=$1 value=$2 file=$3
  shift 3
  echo "=== $kind $value -> $file" >&2
  start_server
  timeout --kill-after=30 "$POINT_TIMEOUT" "$PYTHON" "$HERE/serve_bench.py" \
    --base-url "$BASE_URL" --model-path "$MODEL_DIR" --seed "$SEED" \
    --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
    --label "$TAG-$kind$value" --no-progress --result-json "$file" "$@"
  local rc=$?
  stop_server
  if ((rc != 0)); then echo "point $kind $value exited with $rc" >&2; fi
  [[ -f "$file" ]] && echo "$kind $value $file" >>"$POINTS_FILE"
  return 0
}

# saturated FILE RATE -> exit 0 when the achieved req/s < SAT_RATIO * the offered rate, or TTFT
# p50 > SAT_TTFT_MS, or nothing completed. "Offered" is keepup_request_rate, what a server that
# keeps up would achieve on this seeded Poisson sample: N / (send span + fastest E2EL); a
# 60-request sample is +-13% off the nominal rate and a short point's drain reads as saturation.
saturated() {
  [[ -f "$1" ]] || return 0
  "$PYTHON" - "$1" "$2" "$SAT_RATIO" "$SAT_TTFT_MS" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1])); rate = float(sys.argv[2])
offered = r.get("keepup_request_rate", rate)
offered = rate if offered == "inf" else float(offered)
sat = (r["request_throughput"] < float(sys.argv[3]) * offered
       or r["median_ttft_ms"] > float(sys.argv[4]) or r["completed"] == 0)
print(f"  offered {rate:g} req/s (keep-up {offered:.2f}), achieved {r['request_throughput']:.2f}"
      f" req/s, TTFT p50 {r['median_ttft_ms']:.0f} ms, failed {r['failed']} -> "
      f"{'saturated' if sat else 'ok'}", file=sys.stderr)
sys.exit(0 if sat else 1)
EOF
}

qps_point() {
  local r=$1 n
  n=$("$PYTHON" -c "import math; print(max(1, math.ceil($r * $POINT_SECONDS)))")
  run_point qps "$r" "$OUT_DIR/${TAG}-qps${r}.json" --request-rate "$r" --num-prompts "$n"
}

conc_point() {
  # Enough distinct prompts that a closed loop rarely repeats one (a repeat could hit the
  # prefix cache): 4 per slot-second, at least 256, at most 8192.
  local c=$1 n
  n=$((c * POINT_SECONDS * 4))
  ((n < 256)) && n=256
  ((n > 8192)) && n=8192
  run_point conc "$c" "$OUT_DIR/${TAG}-conc${c}.json" --request-rate inf \
    --max-concurrency "$c" --duration "$POINT_SECONDS" --num-prompts "$n"
}

sat_rate=""
for r in $QPS_GRID; do
  qps_point "$r"
  if [[ -z "$sat_rate" ]] && saturated "$OUT_DIR/${TAG}-qps${r}.json" "$r"; then sat_rate=$r; fi
done
for c in $CONC_GRID; do conc_point "$c"; done
if [[ -z "$sat_rate" ]]; then
  for r in $EXTRA_QPS; do
    qps_point "$r"
    if saturated "$OUT_DIR/${TAG}-qps${r}.json" "$r"; then sat_rate=$r; break; fi
  done
fi
for c in $EXTRA_CONC; do conc_point "$c"; done

SWEEP="$OUT_DIR/${TAG}-sweep.json"
"$PYTHON" - "$POINTS_FILE" "$SWEEP" "$TAG" "$MODEL_DIR" "${sat_rate:-none}" "$POINT_SECONDS" \
  "$SERVER_ARGS" "$0 $*" <<'EOF'
import json, sys
sys.path.insert(0, __import__("os").path.dirname(sys.argv[0]) or ".")
points_file, out, tag, model_dir, sat, secs, server_args, cmd = sys.argv[1:9]
keys = ["completed", "failed", "duration", "realized_request_rate", "keepup_request_rate", "server_gpu_busy_fraction",
        "server_prefix_cache_hit_tokens",
        "request_throughput",
        "output_throughput",
        "total_token_throughput", "total_input_tokens", "total_output_tokens"]
keys += [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
         for s in ("mean", "median", "p90", "p99")]
points, meta = [], {}
for line in open(points_file):
    kind, value, path = line.split(maxsplit=2)
    path = path.strip()
    r = json.load(open(path))
    meta = meta or {k: r.get(k) for k in ("date", "machine", "git")}
    points.append({"kind": kind, "value": float(value) if kind == "qps" else int(value),
                   "file": path.rsplit("/", 1)[-1], **{k: r.get(k) for k in keys}})
json.dump({"tag": tag, "model_path": model_dir, "server_args": server_args,
           "point_seconds": float(secs), "saturated_at_qps": None if sat == "none" else float(sat),
           "command": cmd, **meta, "points": points}, open(out, "w"), indent=2)
print(f"{'point':>10} {'req/s':>8} {'tok/s':>9} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} "
      f"{'p99':>7} {'fail':>5}")
for p in points:
    print(f"{p['kind'] + format(p['value'], 'g'):>10} {p['request_throughput']:8.2f} "
          f"{p['output_throughput']:9.1f} {p['median_ttft_ms']:9.1f} {p['p99_ttft_ms']:8.1f} "
          f"{p['median_tpot_ms']:9.2f} {p['p99_tpot_ms']:7.2f} {p['failed']:5d}")
print(f"wrote {out}")
EOF

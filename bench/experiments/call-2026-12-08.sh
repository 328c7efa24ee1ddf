#!/usr/bin/env bash
# The one device call of 2026-12-08 (little device time left after failed starts): main's merged attention changes
# (kw32 + dimw) through their test files with each test's time, the start-up phases, then issue #25's TTFT path.
# Everything lands in /tmp/res and comes back as $OUT/res.tgz (a call brings back 8 files at most).
set -uo pipefail
export PYTHONUNBUFFERED=1
END=${END:-570}
R=/tmp/res
mkdir -p $R
source bench/device_setup.sh || exit 1
export OPENINFER_TEST_CACHE=/tmp/ckpt OPENINFER_TEST_TIMES=$R/times.tsv
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $R/gpu.txt
left() { echo $((END - SECONDS)); }
# the attention tests (what the merge touched; the GEMM tests' kernels are unchanged since they last passed)
timeout ${TEST_S:-300} python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gpu_kernels.py tests/test_deterministic.py \
  tests/test_gpu_graphs.py -k "attention or split or segment or short or key_warps or deterministic or graph or \
  persistent or overlapped or bucket" 2>&1 | tee $R/tests.log | tail -8
CKPT4B=$OPENINFER_TEST_CACHE/openinfer-ckpt/qwen3-4b
[ -f "$CKPT4B/config.json" ] || python3 -m openinfer.tools.random_checkpoint --preset qwen3-4b --out "$CKPT4B"
# start-up: the server's own log (finalize's phases), twice, page cache warm after the first
for i in 1 2; do
  python3 - "$CKPT4B" $R/startup_$i.log <<'PY'
import subprocess, sys, time, urllib.request
t0 = time.perf_counter()
with open(sys.argv[2], "w") as log:
    p = subprocess.Popen([sys.executable, "-m", "openinfer.cli", "--model-path", sys.argv[1], "--port", "8011"],
                         stdout=log, stderr=subprocess.STDOUT)
    while p.poll() is None:
        try:
            urllib.request.urlopen("http://127.0.0.1:8011/health", timeout=1).read()
            break
        except OSError:
            time.sleep(0.02)
    dt = time.perf_counter() - t0
    p.terminate(); p.wait(30)
with open(sys.argv[2], "a") as log:
    print(f"start-up: {dt:.3f} s to /health 200", file=log)
PY
done
grep -h "finalize\|start-up\|weights" $R/startup_*.log
[ $(left) -gt 60 ] && OUT=$R STAGES=ttftpath timeout $(left) bash bench/gpu_session.sh 2>&1 | grep -v "^INFO" | tail -50
tar czf $OUT/res.tgz -C $R .

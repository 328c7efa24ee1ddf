#!/usr/bin/env bash
# What a session's device calls need, built on this machine (no device time): the build tools for Python
# 3.12, the dependency wheels in .whl/ (~19 MB with openai, which tests/test_server.py imports: with three
# trees in .exp/ the carry stays under 64 MiB; not with .alt/ as well), the peers in .peers/, main's wheel (bench/build_wheel.sh), and each NAME=PATCH given packed
# as a tree (pack_patch.sh) into $READY (default /work/exp-ready; move at most three into .exp/ per call).
#
#   bash bench/experiments/prepare.sh long=bench/experiments/short-long/0001-short-items-every-context.patch
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PYB=${PYB:-$HOME/.pyenv/versions/3.12.1/bin}
READY=${READY:-/work/exp-ready}
"$PYB/python3.12" -m pip install -q scikit-build-core pybind11 cmake ninja nvidia-cublas numpy
bash ../shared/device/wheels.sh httptools uvloop > /dev/null
mkdir -p .peers "$READY"
cp ../shared/peers/* .peers/
export CUBLAS_SITE=${CUBLAS_SITE:-$("$PYB/python3.12" -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))')}
bash bench/build_wheel.sh
for spec in "$@"; do
  name=${spec%%=*}
  [ -d "/work/wt-$name" ] && { git worktree remove --force "/work/wt-$name"; git branch -D "exp/$name" > /dev/null; }
  bash bench/experiments/pack_patch.sh "$name" "${spec#*=}"
  mv ".exp/$name.tgz" "$READY/"
done
du -sh .whl "$READY"/* 2>/dev/null

#!/usr/bin/env bash
# Packs an experiment tree for bench/experiments/trees.sh: REV's src/ tests/ bench/ (no results, no tokenizer.json) and the
# wheel built from it (WHL, a folder with openinfer-*.whl and COMMIT, from bench/build_wheel.sh in a worktree
# of REV) into .exp/NAME.tgz.   bash bench/experiments/pack_tree.sh fa3 exp/fa3-on-main /work/wt-fa3/.whl
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
NAME=$1 REV=$2 WHL=$3
grep -qx "/.exp/" .git/info/exclude 2>/dev/null || echo "/.exp/" >> "$(git rev-parse --git-common-dir)/info/exclude"
t=$(mktemp -d); mkdir -p .exp "$t/.whl"
# (the tokenizer, 2 MB packed, is the same in every tree: trees.sh copies this checkout's)
git archive "$REV" src tests bench ':!bench/results' ':!src/openinfer/data/qwen3-tokenizer/tokenizer.json' | tar x -C "$t"
cp "$WHL"/openinfer-*.whl "$WHL/COMMIT" "$t/.whl/"
tar czf ".exp/$NAME.tgz" -C "$t" . && rm -rf "$t"
ls -la ".exp/$NAME.tgz"

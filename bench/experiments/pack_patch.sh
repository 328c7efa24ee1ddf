#!/usr/bin/env bash
# Builds an experiment tree from a patch and packs it for trees.sh: a worktree of BASE (default HEAD) on branch
# exp/NAME with PATCH applied and committed, its wheel built in /tmp/bld-NAME, then pack_tree.sh NAME into
# .exp/NAME.tgz. With PATCH "-", the tree is BASE itself (main as `base`).
#
#   bash bench/experiments/pack_patch.sh long bench/experiments/short-long/0001-short-items-every-context.patch
#   bash bench/experiments/pack_patch.sh base -
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
NAME=$1 PATCH=$2 BASE=${3:-HEAD}
WT=/work/wt-$NAME
[ "$PATCH" = - ] || PATCH=$(realpath "$PATCH")
git worktree add -q -f -B "exp/$NAME" "$WT" "$BASE"
if [ "$PATCH" != - ]; then
  (cd "$WT" && git apply "$PATCH" && git add -A && git commit -qm "experiment $NAME: $(basename "$PATCH")")
fi
(cd "$WT" && BUILD_DIR=/tmp/bld-$NAME bash bench/build_wheel.sh)
bash bench/experiments/pack_tree.sh "$NAME" "exp/$NAME" "$WT/.whl"

#!/usr/bin/env bash
# A second tree for same-call A/B runs on the GPU machine: the Python sources of REV with their own
# compiled _engine (cp312 wheel, built here like .whl/), in .alt/ (carry it with the run). On the
# device, a server of that tree: SERVER_CMD="env PYTHONPATH=$PWD/.alt/src:/tmp/site python3 -m openinfer.cli"
# (after `source bench/device_setup.sh`); STAGES=ab in bench/gpu_session.sh does that.
#
#   bash bench/alt_tree.sh main [extra pip wheel -C options...]
set -euo pipefail
REV=${1:?usage: $0 REV [pip wheel options]}
shift
ROOT=$(git rev-parse --show-toplevel)
PY=${PY:-python3.12}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git -C "$ROOT" archive "$REV" | tar -x -C "$tmp"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$tmp/whl" "$tmp" "$@"
rm -rf "$ROOT/.alt"
mkdir -p "$ROOT/.alt"
cp -r "$tmp/src" "$ROOT/.alt/src"
"$PY" - "$tmp/whl" "$ROOT/.alt/src/openinfer" <<'PY'
import glob, shutil, sys, zipfile
z = zipfile.ZipFile(glob.glob(sys.argv[1] + "/openinfer-*.whl")[0])
for n in z.namelist():
    if "/_engine" in n:
        with z.open(n) as src, open(sys.argv[2] + "/" + n.split("/")[-1], "wb") as dst:
            shutil.copyfileobj(src, dst)
PY
echo "$REV ($(git -C "$ROOT" rev-parse --short "$REV")) -> $ROOT/.alt/src" >&2
git -C "$ROOT" rev-parse --short "$REV" > "$ROOT/.alt/REV"

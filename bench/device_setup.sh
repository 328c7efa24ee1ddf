# Source on the GPU machine from the repo root: installs the carried wheels (.whl/) into /tmp/site,
# puts the prebuilt _engine next to the sources, and sets PYTHONPATH. See docs/development.md.
# once per machine (a second call in parallel must not reinstall under a running one)
[ -f /tmp/site/.openinfer-deps ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site $(ls .whl/*.whl | grep -v '/openinfer-') && touch /tmp/site/.openinfer-deps; } || return 1
python3 - <<'PY' || return 1
import glob, os, zipfile
z = zipfile.ZipFile(sorted(glob.glob(".whl/openinfer-*.whl"))[-1])
for n in z.namelist():
    if "/_engine" in n or "/_bench" in n:
        dst, data = "src/openinfer/" + n.split("/")[-1], z.read(n)
        if not (os.path.exists(dst) and open(dst, "rb").read() == data):  # a running process may map it
            with open(dst + ".tmp", "wb") as f:
                f.write(data)
            os.replace(dst + ".tmp", dst)
PY
export PYTHONPATH=$PWD/src:/tmp/site:$PWD/tests
# The tree the carried wheel was built from (bench/build_wheel.sh): what benchmarks record as their commit.
[ -f .whl/COMMIT ] && export OPENINFER_TREE=$(cat .whl/COMMIT)

#!/usr/bin/env bash
# Builds the cp312 wheel the GPU machine runs (docs/development.md), with the kernel timing module, into .whl/, and writes .whl/COMMIT
# naming the tree it was built from (`git describe --dirty`): the machine's copy of the checkout does not
# carry this one's git state, so benchmarks there record this file.
#
#   bash bench/build_wheel.sh            # PYB: the Python 3.12 bin folder; BUILD_DIR: a kept build folder
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PYB=${PYB:-$HOME/.pyenv/versions/3.12.1/bin}
SITE=${CUBLAS_SITE:-$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))')}
rm -f .whl/openinfer-*.whl
PATH=$PYB:$PATH "$PYB/python3.12" -m pip wheel -q --no-deps --no-build-isolation -w .whl . \
  -Ccmake.define.CUBLASLT_INCLUDE_DIR="$SITE/nvidia/cu13/include" -Ccmake.define.OPENINFER_BENCH=ON \
  -Cbuild-dir="${BUILD_DIR:-/tmp/bld312}" "$@"
git describe --always --dirty --abbrev=12 > .whl/COMMIT
echo "$(ls .whl/openinfer-*.whl) from $(cat .whl/COMMIT)"

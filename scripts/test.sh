#!/usr/bin/env bash
# The test command: builds everything (every .cu compiles, no GPU needed),
# runs ctest (CPU tests; GPU tests run on >= 2 local GPUs, else are reported
# as skipped), checks formatting, then builds the Python package and runs
# pytest (GPU tests skip without GPUs and torch).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
export PATH="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["scripts"])'):$PATH"
echo "== format check"
git ls-files '*.cpp' '*.hpp' '*.cu' '*.cuh' | xargs clang-format --dry-run --Werror
echo "== build"
cmake --preset default
cmake --build --preset default -j"$(nproc)"
echo "== ctest"
ctest --preset default
echo "== python package"
python3 -m pip install -q --no-build-isolation --no-deps . --config-settings=build-dir=build/python
echo "== pytest"
set +e
python3 -m pytest tests/python -q -ra
rc=$?
set -e
# 5 = no tests collected: that is a failure of this script, not a pass.
exit $rc

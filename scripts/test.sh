#!/usr/bin/env bash
# The test command: builds everything (every .cu compiles, no GPU needed),
# runs ctest (CPU tests; GPU tests run on >= 2 local GPUs, else are reported
# as skipped), the CPU tests again under ASan + UBSan, installs the C++
# package and builds examples/cpp against it, checks formatting, builds the Python package and runs pytest
# (with PyPI's torch; GPU tests skip without GPUs), then proves that a clean
# `pip install .` into a fresh virtual environment works.
set -euo pipefail
cd "$(dirname "$0")/.."
# With PyPI's torch (EPX_INSTALL_TORCH, install_deps.sh): the CPU tests of the
# PyTorch tensor glue run here instead of skipping. EPX_TEST_TORCH=0 leaves it
# out (those tests then report skipped).
EPX_INSTALL_TORCH=${EPX_TEST_TORCH:-1} bash scripts/install_deps.sh
source scripts/python_env.sh
epx_use_python
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
echo "== format check"
git ls-files '*.cpp' '*.hpp' '*.cu' '*.cuh' | xargs clang-format --dry-run --Werror
echo "== python lint (undefined and unused names: pyflakes' rules through ruff)"
"$EPX_PY" -m ruff check --no-cache --select F python tests/python bench scripts
echo "== build"
# With libstdc++'s assertions (CMakeLists.txt: EPX_GLIBCXX_ASSERTIONS).
cmake --preset default -DEPX_GLIBCXX_ASSERTIONS=ON
cmake --build --preset default -j"$(nproc)"
echo "== ctest"
ctest --preset default
echo "== ctest under ASan + UBSan (the cpu-labelled tests; CMakePresets.json: asan)"
cmake --preset asan
cmake --build --preset asan -j"$(nproc)" --target epx_cpu_tests
ctest --preset asan
echo "== C++ package: cmake --install, then examples/cpp through find_package(epx)"
# Installs the tree just built (nothing compiles twice) and builds the example
# in a fresh directory against it.
bash scripts/check_install.sh build/default
echo "== python package"
# With the test-only module epx._testing (python/CMakeLists.txt: EPX_PYTHON_TESTING).
"$EPX_PY" -m pip install -q --no-build-isolation --no-deps . --config-settings=build-dir=build/python \
  --config-settings=cmake.define.EPX_PYTHON_TESTING=ON
echo "== pytest"
set +e
"$EPX_PY" -m pytest tests/python -q -ra
rc=$?
set -e
# 5 = no tests collected: that is a failure of this script, not a pass.
[ $rc -eq 0 ] || exit $rc
echo "== clean install into a fresh virtual environment"
bash scripts/check_clean_install.sh

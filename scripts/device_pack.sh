#!/usr/bin/env bash
# Builds here (no GPU needed) what the device machine runs, into .device/
# (git-ignored, under the 64 MiB carry limit; the CPU unit tests stay here).
# Then call the device tool:
#   run(kind="nvidia-h200-x4", carry=[".device"], command="bash .device/device_run.sh")
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --preset default >/dev/null
cmake --build --preset default -j"$(nproc)"
rm -rf .device && mkdir -p .device
cp build/default/tests/epx_gpu_tests build/default/bench/epx-bench \
  build/default/bench/epx-nvlink-probe build/default/tests/epx_gin_loopback_gpu_tests \
  build/default/libnccl-net-epxloop.so .device/
# The NVSHMEM module, where this build made one (the loader looks beside the binaries).
if [ -f build/default/libepx_nvshmem.so ]; then cp build/default/libepx_nvshmem.so .device/; fi
cp scripts/launch.sh scripts/device_env.sh scripts/device_run.sh scripts/device_extra.sh \
  scripts/device_net.sh scripts/device_ll.sh scripts/device_deepep.sh .device/
# EPX_BASE_DIR: a baseline build's epx-bench (and epx_gpu_tests), for
# device_net.sh's before/after comparison in the same call.
if [ -n "${EPX_BASE_DIR:-}" ]; then
  mkdir -p .device/base
  cp "$EPX_BASE_DIR"/epx-bench .device/base/
fi
# EPX_WHEEL_PYTHON: an interpreter of the device machine's Python version (3.12
# on the lent hosts): the package's wheel for device_run.sh's python step, with
# the NVSHMEM module of this build's NVSHMEM.
if [ -n "${EPX_WHEEL_PYTHON:-}" ]; then
  nvs_inc=$(sed -n 's/^EPX_NVSHMEM_INCLUDE_DIR:PATH=//p' build/default/CMakeCache.txt)
  rm -rf /tmp/epx-pack-wheel && mkdir -p .device/wheel
  "$EPX_WHEEL_PYTHON" -m pip wheel -q --no-build-isolation --no-deps . -w /tmp/epx-pack-wheel \
    --config-settings=build-dir=/tmp/epx-pack-wheel-build \
    ${nvs_inc:+--config-settings=cmake.define.EPX_NVSHMEM_ROOT=$(dirname "$nvs_inc")}
  cp /tmp/epx-pack-wheel/*.whl .device/wheel/
fi
# The binaries travel gzipped (their device code compresses about 3:1, and the
# carry limit is 64 MiB with the working tree); device_env.sh unpacks them.
bins=$(cd .device && ls epx_gpu_tests epx-bench epx-nvlink-probe epx_gin_loopback_gpu_tests \
  libnccl-net-epxloop.so libepx_nvshmem.so 2>/dev/null)
# shellcheck disable=SC2086  # bins: plain file names
tar -C .device -czf .device/bins.tgz $bins && (cd .device && rm -f $bins)
git rev-parse --short=12 HEAD > .device/COMMIT 2>/dev/null || echo unknown > .device/COMMIT
du -sh .device

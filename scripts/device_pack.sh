#!/usr/bin/env bash
# Builds here (no GPU needed) what the device machine runs, into .device/
# (git-ignored, well under the 64 MiB carry limit). Then call the device tool:
#   run(kind="nvidia-h200-x4", carry=[".device"], command="bash .device/device_run.sh")
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --preset default >/dev/null
cmake --build --preset default -j"$(nproc)"
rm -rf .device && mkdir -p .device
cp build/default/tests/epx_gpu_tests build/default/tests/epx_unit_tests build/default/bench/epx-bench \
  build/default/bench/epx-nvlink-probe build/default/tests/epx_gin_loopback_gpu_tests \
  build/default/libnccl-net-epxloop.so .device/
# The NVSHMEM module, where this build made one (the loader looks beside the binaries).
if [ -f build/default/libepx_nvshmem.so ]; then cp build/default/libepx_nvshmem.so .device/; fi
cp scripts/launch.sh scripts/device_env.sh scripts/device_run.sh scripts/device_extra.sh \
  scripts/device_net.sh .device/
# EPX_BASE_DIR: a baseline build's epx-bench (and epx_gpu_tests), for
# device_net.sh's before/after comparison in the same call.
if [ -n "${EPX_BASE_DIR:-}" ]; then
  mkdir -p .device/base
  cp "$EPX_BASE_DIR"/epx-bench .device/base/
fi
git rev-parse --short=12 HEAD > .device/COMMIT 2>/dev/null || echo unknown > .device/COMMIT
du -sh .device

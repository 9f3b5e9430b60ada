#!/usr/bin/env bash
# Installs what building and testing EPX needs on a fresh Debian/Ubuntu
# machine that already has the CUDA toolkit (nvcc 13, sm_90a). Idempotent.
#   - apt: compilers, ninja, GoogleTest, CLI11, nlohmann-json, clang-format,
#     libfabric-dev (the proxy's libfabric engine),
#     and python3-venv where the system Python is externally managed (PEP 668)
#   - pip, into the Python scripts/python_env.sh picks (python3, or the
#     project's .venv when python3 is closed to pip): CMake >= 3.28 (CUDA
#     C++20), nanobind, scikit-build-core, pytest, numpy, hypothesis
#   - NCCL >= 2.28.9 with the device API: the toolkit's copy if new enough,
#     else the pip wheel nvidia-nccl-cu13==2.28.9, which CMake finds through
#     that Python
#   - NVSHMEM 3.4.5 (pip nvidia-nvshmem-cu13), for the NVSHMEM module's kernels
#   - with EPX_INSTALL_TORCH=1 (scripts/test.sh sets it): PyPI's torch 2.11.0
#     and matplotlib, for the Python tests of the tensor glue and the plot
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
pkgs=(g++ ninja-build libgtest-dev libcli11-dev nlohmann-json3-dev clang-format git libfabric-dev)
if epx_needs_venv; then
  pkgs+=(python3-venv)
fi
need_apt=()
for pkg in "${pkgs[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${need_apt[@]}"
fi
epx_use_python
PIP=("$EPX_PY" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" "cmake>=3.28,<4" "nanobind>=2.4" scikit-build-core pytest numpy hypothesis ruff
# torch 2.11.0 pins the NCCL (2.28.9) and NVSHMEM (3.4.5) wheels that EPX
# builds against below; a newer torch pins newer ones, which pip would install
# in their place (torch 2.15 brings NCCL 2.30.7 and NVSHMEM 3.7.2, and
# imports only with those). Before the pins below, so they hold in the end.
if [ "${EPX_INSTALL_TORCH:-0}" = 1 ] && ! "$EPX_PY" -c "import torch, matplotlib" 2>/dev/null; then
  "${PIP[@]}" torch==2.11.0 matplotlib
fi
command -v nvcc >/dev/null || { [ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH; }
command -v nvcc >/dev/null || { echo "install_deps.sh: nvcc (CUDA 13) not found; install the CUDA toolkit" >&2; exit 1; }
nccl_ok=0
for h in "${EPX_NCCL_ROOT:-/nonexistent}/include/nccl.h" /usr/local/cuda/include/nccl.h /usr/include/nccl.h; do
  if [ -f "$h" ] && [ -f "$(dirname "$h")/nccl_device.h" ]; then
    v=$(awk '/define NCCL_(MAJOR|MINOR|PATCH) /{printf "%s ", $3}' "$h")
    read -r ma mi pa <<<"$v"
    if [ $((ma * 10000 + mi * 100 + pa)) -ge 22809 ]; then nccl_ok=1; break; fi
  fi
done
if [ $nccl_ok -eq 0 ]; then
  "${PIP[@]}" nvidia-nccl-cu13==2.28.9
  echo "install_deps.sh: using the pip NCCL of $EPX_PY (CMake finds it there)"
fi
# NVSHMEM 3.4.5 (pip, 60 MB): CMake finds it through that Python and builds
# the NVSHMEM module's kernels (docs/nvshmem.md). EPX_SKIP_NVSHMEM=1 skips it.
if [ "${EPX_SKIP_NVSHMEM:-0}" != 1 ]; then
  "${PIP[@]}" nvidia-nvshmem-cu13==3.4.5
fi
echo "install_deps.sh: done ($EPX_PY)"

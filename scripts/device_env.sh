# Sourced by the device-side scripts (device_run.sh, device_extra.sh): where
# results go, the variables that must stay set on the lent machines, the pip
# NCCL/NVSHMEM first in LD_LIBRARY_PATH, and the number of local GPUs.
OUT=${OUT:-/tmp/epx-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SITE=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || echo /nonexistent)
for lib in "$SITE/nvidia/nccl/lib" "$SITE/nvidia/nvshmem/lib"; do
  [ -d "$lib" ] && export LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}"
done
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
GPUS=$(nvidia-smi -L | grep -c '^GPU' || true)

# Sourced by the device-side scripts (device_run.sh, device_net.sh,
# device_extra.sh; $D: the folder of the binaries): where results go, the
# variables that must stay set on the lent machines, the pip NCCL/NVSHMEM
# first in LD_LIBRARY_PATH, the number of local GPUs, and what the network
# backends need on one host (GIN_PLUGIN, GIN_ENV, NVS_ENV: VAR=VALUE for env).
OUT=${OUT:-/tmp/epx-out}
# device_pack.sh ships the binaries gzipped.
if [ -f "${D:-.}/bins.tgz" ] && { [ ! -f "${D:-.}/epx_gpu_tests" ] || [ "${D:-.}/bins.tgz" -nt "${D:-.}/epx_gpu_tests" ]; }; then
  tar -C "${D:-.}" -xmzf "${D:-.}/bins.tgz" || exit 1  # -m: newer than the archive
fi
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SITE=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || echo /nonexistent)
for lib in "$SITE/nvidia/nccl/lib" "$SITE/nvidia/nvshmem/lib"; do
  [ -d "$lib" ] && export LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}"
done
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
GPUS=$(nvidia-smi -L | grep -c '^GPU' || true)
# nccl: NCCL's GIN path through the loopback plugin built beside the binaries.
GIN_PLUGIN=NCCL_NET_PLUGIN="${D:-.}/libnccl-net-epxloop.so"
GIN_ENV=("$GIN_PLUGIN" EPX_BACKEND=nccl)
# nvshmem: this machine's pip wheel, P2P within the host (no remote transport),
# the unique-id bootstrap over loopback (its default skips lo).
NVS_LIB=$(python3 -c "import nvidia.nvshmem, os; print(os.path.join(list(nvidia.nvshmem.__path__)[0], 'lib'))" 2>/dev/null)
NVS_ENV=(LD_LIBRARY_PATH="$NVS_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NVSHMEM_REMOTE_TRANSPORT=none
         NVSHMEM_DISABLE_NVLS=1 EPX_BACKEND=nvshmem NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${EPX_NVSHMEM_IFNAME:-lo})

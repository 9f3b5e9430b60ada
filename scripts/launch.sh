#!/usr/bin/env bash
# Runs a multi-rank program on this host: one process per GPU with torchrun's
# variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
#   scripts/launch.sh N ./program [args...]
# Exit 77 (ctest: skipped) when this host has fewer than N GPUs.
set -u
n=${1:?usage: launch.sh NUM_RANKS PROGRAM [ARGS...]}
shift
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
if [ "${gpus:-0}" -lt "$n" ]; then
  echo "launch.sh: SKIPPED: needs $n GPUs, this host has ${gpus:-0}"
  exit 77
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MASTER_ADDR=127.0.0.1
export MASTER_PORT=${MASTER_PORT:-$((20000 + RANDOM % 20000))}
export WORLD_SIZE=$n
pids=()
# A launcher that is stopped (timeout, Ctrl-C) takes its ranks with it: left
# running, they would hold the GPUs and ports for whatever runs next.
stop_ranks() {
  kill -TERM "${pids[@]}" 2>/dev/null
  sleep 2
  kill -KILL "${pids[@]}" 2>/dev/null
  exit 143
}
trap stop_ranks TERM INT HUP
for ((r = 0; r < n; r++)); do
  RANK=$r LOCAL_RANK=$r "$@" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do
  wait "$p" || rc=1
done
exit $rc

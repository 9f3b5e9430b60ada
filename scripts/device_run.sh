#!/usr/bin/env bash
# Runs on the device machine, from the repository root: the GPU test suite on
# all local GPUs (EP2, then EP4/EP8 where there are GPUs), then the
# benchmarks; logs and result JSON under $OUT; a short table last.
#   EPX_RUN="tests bench"  (default both)   EPX_BENCH="ht ll"
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/epx-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SITE=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || echo /nonexistent)
for lib in "$SITE/nvidia/nccl/lib" "$SITE/nvidia/nvshmem/lib"; do
  [ -d "$lib" ] && export LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}"
done
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
GPUS=$(nvidia-smi -L | grep -c '^GPU' || true)
echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1), $GPUS GPUs, commit $(cat "$D/COMMIT" 2>/dev/null)"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true
RUN=${EPX_RUN:-tests bench}
BENCH=${EPX_BENCH:-ht ll}
summary=()
if [[ " $RUN " == *" tests "* ]]; then
  for n in 2 4 8; do
    [ "$GPUS" -ge "$n" ] || continue
    echo "== GPU tests EP$n"
    timeout ${EPX_TEST_TIMEOUT:-420} "$D/launch.sh" "$n" "$D/epx_gpu_tests" ${EPX_GTEST_FILTER:+--gtest_filter=$EPX_GTEST_FILTER} \
      > "$OUT/gpu-tests-ep$n.log" 2>&1
    rc=$?
    grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|tests passed|FAILURES|SKIPPED|rank [0-9]+:" "$OUT/gpu-tests-ep$n.log" | sort | uniq -c | head -30
    [ $rc -eq 0 ] || tail -40 "$OUT/gpu-tests-ep$n.log"
    summary+=("gpu tests EP$n: rc=$rc")
  done
fi
if [[ " $RUN " == *" bench "* ]]; then
  n=$GPUS
  [ "$n" -gt 8 ] && n=8
  kind="h200x$n"
  for fam in $BENCH; do
    echo "== epx-bench $fam EP$n"
    timeout ${EPX_BENCH_TIMEOUT:-300} "$D/launch.sh" "$n" "$D/epx-bench" "$fam" --json "$OUT/$kind-$fam.json" ${EPX_BENCH_ARGS:-} \
      > "$OUT/bench-$fam.log" 2>&1
    rc=$?
    grep -v "^sweep" "$OUT/bench-$fam.log" | tail -15
    summary+=("bench $fam EP$n: rc=$rc")
  done
fi
echo "== summary"
printf '%s\n' "${summary[@]}"

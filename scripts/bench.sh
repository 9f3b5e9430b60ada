#!/usr/bin/env bash
# The benchmark command: builds and runs epx-bench (high-throughput and
# low-latency) on every local GPU, one process per GPU. Results JSON go to
# bench/results/<device>x<N>-{ht,ll}.json (pass --out DIR to change), after
# epx-nvlink-probe (the copy loop's NVLink store/load and local copy ceilings).
#   scripts/bench.sh [ht|ll|probe|all] [extra epx-bench args]
set -euo pipefail
cd "$(dirname "$0")/.."
fam=${1:-all}
shift || true
bash scripts/install_deps.sh >/dev/null
export PATH="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["scripts"])'):$PATH"
cmake --preset default >/dev/null
cmake --build --preset default -j"$(nproc)"
n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${n:-0}" -ge 2 ] || { echo "bench.sh: needs >= 2 local GPUs (found ${n:-0})" >&2; exit 1; }
[ "$n" -gt 8 ] && n=8
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($NF)}')
if [ "$fam" = all ] || [ "$fam" = probe ]; then
  build/default/bench/epx-nvlink-probe --json "bench/results/${name}x$n-nvlink-probe.json"
fi
for f in ht ll; do
  [ "$fam" = all ] || [ "$fam" = "$f" ] || continue
  scripts/launch.sh "$n" build/default/bench/epx-bench "$f" --json "bench/results/${name}x$n-$f.json" "$@"
done

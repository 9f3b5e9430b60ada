#!/usr/bin/env bash
# Runs on the device machine (from the repository root, after
# scripts/device_pack.sh filled .device/): the low-latency ops across virtual
# nodes, C++ and Python, each run under several environments in one call, to
# pin down a failure that depends on the environment.
#   EPX_LL_CXX   "BACKEND:R:RPN:QPS:FILTER ..." C++ GPU-suite runs (BACKEND proxy
#                or nccl; QPS: contexts per peer). Default: the clean-first
#                tests and the legacy-stream back-to-back one with copies, at
#                2:1:4 and 4:2:4 over the proxy, then the LowLatency,
#                Internode and Network suites at 2:1 over the proxy.
#   EPX_LL_PY    "VAR=VALUE ...;VAR=VALUE ...;..." one Python run per ';'-part,
#                with that environment (EPX_BACKEND=nccl gets the loopback
#                plugin added). Default: the Python LL case over the proxy,
#                then over nccl.
#   EPX_LL_ENVS  "VAR=VALUE ...;..." each C++ run again under each part (default:
#                one run with the library's defaults; e.g. "EPX_PROXY_CUMEM=0" for
#                the proxy's primary-context path, which fails the copy test).
#   EPX_LL_K     pytest -k of the Python runs (default: the LL case at 2 processes)
#   EPX_LL_TIMEOUT_S  EPX_TIMEOUT_S of every run (5: a lost op fails in seconds)
# Every rank's error comes back (tests/python/test_gpu.py waits for them); logs
# in $OUT/ll-logs.tgz.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
source "$D/device_env.sh"  # OUT, GPUS, GIN_PLUGIN, the environment
export CUDA_MODULE_LOADING=EAGER
export EPX_TIMEOUT_S=${EPX_LL_TIMEOUT_S:-5}
LOGS="$OUT/ll"
mkdir -p "$LOGS"
summary=()
tests="LowLatency.CleanOnAFreshBufferThenOps:LowLatency.PythonCaseShapesPairAfterPair:LowLatency.BackToBackOnTheLegacyStreamWithCopies"
IFS=';' read -ra envs <<< "${EPX_LL_ENVS:- }"
for spec in ${EPX_LL_CXX:-proxy:2:1:4:$tests proxy:4:2:4:$tests proxy:2:1:1:LowLatency.*:Internode.*:Network.*}; do
  IFS=: read -r backend r rpn qps filter <<< "$spec"
  [ "$GPUS" -ge "$r" ] || continue
  benv=(EPX_BACKEND="$backend")
  [ "$backend" = nccl ] && benv+=("$GIN_PLUGIN")
  for e in "${envs[@]}"; do
    tag="$backend-$r-$rpn-$qps-${e//[^A-Za-z0-9]/_}"
    t0=$(date +%s)
    # shellcheck disable=SC2086  # e: VAR=VALUE words
    timeout 150 env "${benv[@]}" $e EPX_RANKS_PER_NODE="$rpn" EPX_TEST_QPS="$qps" \
      "$D/launch.sh" "$r" "$D/epx_gpu_tests" --gtest_filter="$filter" > "$LOGS/cxx-$tag.log" 2>&1
    rc=$?
    line="C++ $backend $r:$rpn:$qps $e: rc=$rc ($(($(date +%s) - t0)) s), \
$(grep -c '^\[       OK' "$LOGS/cxx-$tag.log") ok, $(grep -c '^\[  FAILED  \] [A-Z]' "$LOGS/cxx-$tag.log") failed"
    echo "== $line"
    [ $rc -eq 0 ] || grep -E "FAILED|rror|imeout" "$LOGS/cxx-$tag.log" | sort | uniq -c | sort -rn | head -8 | cut -c1-300
    summary+=("$line")
  done
done
# The Python runs: device_run.sh's python step, one per environment.
gin="$GIN_PLUGIN EPX_BACKEND=nccl"
default_py="EPX_BACKEND=proxy;EPX_BACKEND=nccl"
IFS=';' read -ra pys <<< "${EPX_LL_PY-$default_py}"
i=0
for v in "${pys[@]}"; do
  [ -n "${v// /}" ] || continue
  i=$((i + 1))
  [[ " $v " == *" EPX_BACKEND=nccl "* ]] && v="$v $gin"
  echo "== Python ($i): $v"
  # shellcheck disable=SC2086  # v: VAR=VALUE words
  env $v EPX_RUN=python EPX_PY_BENCH=0 EPX_PY_BACKENDS=" " EPX_PY_MAXFAIL=1 \
    EPX_PY_TIMEOUT=${EPX_LL_PY_TIMEOUT:-90} EPX_TEST_STACKS_AFTER_S=60 \
    EPX_PY_K="${EPX_LL_K:-low_latency_across_nodes and low_latency-processes-2}" \
    bash "$D/device_run.sh" > "$LOGS/py$i.out" 2>&1
  [ -f "$OUT/logs.tgz" ] && mv "$OUT/logs.tgz" "$LOGS/py$i-logs.tgz"
  res=$(grep -E "^(=+ .*(passed|failed).*=+)$" "$LOGS/py$i.out" | tail -1)
  echo "${res:-no pytest summary (see py$i.out)}"
  grep -E "EPX\w*Error|rank [0-9]+ failed too" "$LOGS/py$i.out" | sort | uniq | head -8 | cut -c1-300
  summary+=("Python ($i) $v: ${res:-no summary}")
done
echo "== summary"
printf '%s\n' "${summary[@]}"
(cd "$OUT" && tar czf ll-logs.tgz ll && rm -rf ll) || true

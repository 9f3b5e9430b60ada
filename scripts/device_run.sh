#!/usr/bin/env bash
# Runs on the device machine, from the repository root: the GPU test suite on
# all local GPUs (EP2, then EP4/EP8 where there are GPUs), then the
# benchmarks; logs and result JSON under $OUT; a short table last.
#   EPX_RUN="tests bench"  (default both)   EPX_BENCH="ht ll"
#   EPX_EPOCH_WRAP=2: the suite with 2 in-process ranks and epochs crossing 2^32 (default on 1 GPU; 0 skips)
#   EPX_IN_PROCESS="2 4": the test suite again with that many ranks as threads of
#   one process on GPU 0 (default "2 4" on a 1-GPU machine, else none).
#   EPX_PULL=1 (default): the HighThroughput tests again with EPX_HT_PULL=1 (the
#   pull dispatch in every default config): at EP2/4/8, and at EPX_IN_PROCESS's
#   rank counts on one GPU. EPX_PULL=0 skips them.
#   EPX_ARRIVAL=1 (default): the same for the LowLatency tests with
#   EPX_LL_ARRIVAL_ORDER=1 (experimental arrival-order packing), and with
#   EPX_RUN=bench on 2+ GPUs `epx-bench ll` again that way. EPX_ARRIVAL=0 skips them.
#   EPX_RUN="python" (or "tests bench python"): the Python package from a wheel in
#   .device/wheel/ (pytest -m gpu, then python -m epx.bench), EPX_PY_TIMEOUT (300 s) each.
#   EPX_RUN="pybuild python": the wheel built here by `pip wheel .` on this Python instead.
#   EPX_PY_BENCH=0 skips python -m epx.bench, EPX_PY_TESTS=0 the Python tests;
#   EPX_PY_K: only the tests pytest -k selects; EPX_PY_MAXFAIL (5): pytest stops after that
#   many failures (one failing case no longer hides the ones after it). Then the
#   across-nodes cases (processes) again over each of EPX_PY_BACKENDS ("nccl nvshmem"),
#   EPX_PY_BACKEND_TIMEOUT (150 s) each. On 4 GPUs the suite takes about 240 s without
#   test_bench (EPX_PY_K="not test_bench") and test_bench[4] alone 110 s or more.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
source "$D/device_env.sh"  # OUT, SITE, GPUS, the environment
echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1), $GPUS GPUs, commit $(cat "$D/COMMIT" 2>/dev/null)"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true
RUN=${EPX_RUN:-tests bench}
BENCH=${EPX_BENCH:-ht ll}
summary=()
LINEBUF=()
command -v stdbuf >/dev/null 2>&1 && LINEBUF=(stdbuf -oL -eL)
# One GPU test run: LABEL LOG COMMAND...; line-buffered (LINEBUF inside the
# command), so a run killed by the timeout still leaves its log; the summary
# lines, and the log's tail when it failed.
suite() {
  local label=$1 log=$2
  shift 2
  echo "== GPU tests, $label"
  timeout ${EPX_TEST_TIMEOUT:-420} "$@" > "$log" 2>&1
  local rc=$?
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|tests passed|FAILURES|SKIPPED|rank [0-9]+:|in-process ranks|EPX_DEBUG_EPOCH_START" "$log" | sort | uniq -c | head -30
  [ $rc -eq 0 ] || tail -40 "$log"
  summary+=("gpu tests, $label: rc=$rc")
}
if [[ " $RUN " == *" tests "* ]]; then
  # The HighThroughput suite again with the pull dispatch in every default config.
  # The suites again with a mode switched on: "log-tag VAR=1 filter" each.
  variants=()
  [ "${EPX_PULL:-1}" = 1 ] && variants+=("pull EPX_HT_PULL=1 ${EPX_GTEST_FILTER:-HighThroughput.*}")
  [ "${EPX_ARRIVAL:-1}" = 1 ] && variants+=("arrival EPX_LL_ARRIVAL_ORDER=1 LowLatency.*")
  for n in 2 4 8; do
    [ "$GPUS" -ge "$n" ] || continue
    suite "EP$n" "$OUT/gpu-tests-ep$n.log" "$D/launch.sh" "$n" ${LINEBUF[@]+"${LINEBUF[@]}"} \
      "$D/epx_gpu_tests" ${EPX_GTEST_FILTER:+--gtest_filter=$EPX_GTEST_FILTER}
    for v in ${variants[@]+"${variants[@]}"}; do
      read -r tag setting filter <<< "$v"
      suite "EP$n, $setting" "$OUT/gpu-tests-ep$n-$tag.log" env "$setting" "$D/launch.sh" "$n" \
        ${LINEBUF[@]+"${LINEBUF[@]}"} "$D/epx_gpu_tests" --gtest_filter="$filter"
    done
  done
  # Ranks as threads of one process on GPU 0: the multi-rank protocol where
  # there are fewer GPUs (EPX_IN_PROCESS="2 4" by default on a 1-GPU machine).
  # Then the epochs' 2^32 wrap: the suite with every buffer's counters starting
  # 96 ops short of it (EPX_EPOCH_WRAP=R ranks; default 2 on a 1-GPU machine,
  # "" or 0 to skip).
  inproc=${EPX_IN_PROCESS-$([ "$GPUS" -lt 2 ] && echo "2 4")}
  wrap=${EPX_EPOCH_WRAP-$([ "$GPUS" -lt 2 ] && echo 2)}
  [ "$wrap" = 0 ] && wrap=
  tests=(${LINEBUF[@]+"${LINEBUF[@]}"} "$D/epx_gpu_tests")
  for n in $inproc; do
    suite "$n in-process ranks on one GPU" "$OUT/gpu-tests-inproc$n.log" \
      "${tests[@]}" --in-process="$n" ${EPX_GTEST_FILTER:+--gtest_filter=$EPX_GTEST_FILTER}
  done
  for v in ${variants[@]+"${variants[@]}"}; do
    read -r tag setting filter <<< "$v"
    for n in $inproc; do
      suite "$n in-process ranks, $setting" "$OUT/gpu-tests-inproc$n-$tag.log" \
        env "$setting" "${tests[@]}" --in-process="$n" --gtest_filter="$filter"
    done
  done
  for n in $wrap; do
    suite "$n in-process ranks, epochs crossing the 2^32 wrap" "$OUT/gpu-tests-inproc$n-wrap.log" \
      env EPX_DEBUG_EPOCH_START=4294967200 "${tests[@]}" --in-process="$n" \
      ${EPX_GTEST_FILTER:+--gtest_filter=$EPX_GTEST_FILTER}
  done
fi
if [[ " $RUN " == *" bench "* ]]; then
  n=$GPUS
  [ "$n" -gt 8 ] && n=8
  # Result files are named by the GPU model (h100x1-ht.json, h200x4-ll.json, ...).
  model=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h[0-9]{3}' | head -1 | tr 'A-Z' 'a-z')
  kind="${model:-gpu}x$n"
  # The copy loop's ceilings first (NVLink stores and loads between all GPUs,
  # local copies): what the kernels' figures compare against.
  echo "== epx-nvlink-probe ($n GPUs)"
  timeout ${EPX_BENCH_TIMEOUT:-300} "$D/epx-nvlink-probe" --json "$OUT/$kind-nvlink-probe.json" \
    > "$OUT/nvlink-probe.log" 2>&1
  rc=$?
  grep -v "^wrote" "$OUT/nvlink-probe.log" | head -60
  summary+=("nvlink probe: rc=$rc")
  for fam in $BENCH; do
    echo "== epx-bench $fam EP$n"
    timeout ${EPX_BENCH_TIMEOUT:-300} "$D/launch.sh" "$n" "$D/epx-bench" "$fam" --json "$OUT/$kind-$fam.json" ${EPX_BENCH_ARGS:-} \
      > "$OUT/bench-$fam.log" 2>&1
    rc=$?
    grep -v "^sweep" "$OUT/bench-$fam.log" | tail -15
    summary+=("bench $fam EP$n: rc=$rc")
    if [ "$fam" = ll ] && [ "$n" -ge 2 ] && [ "${EPX_ARRIVAL:-1}" = 1 ]; then
      echo "== epx-bench ll EP$n, EPX_LL_ARRIVAL_ORDER=1"
      EPX_LL_ARRIVAL_ORDER=1 timeout ${EPX_BENCH_TIMEOUT:-300} "$D/launch.sh" "$n" "$D/epx-bench" ll \
        --json "$OUT/$kind-ll-arrival.json" ${EPX_BENCH_ARGS:-} > "$OUT/bench-ll-arrival.log" 2>&1
      rc=$?
      tail -8 "$OUT/bench-ll-arrival.log"
      summary+=("bench ll EP$n, arrival order: rc=$rc")
    fi
  done
fi
if [[ " $RUN " == *" pybuild "* ]]; then
  # `pip install .` the way a user runs it, on this machine's own Python, offline
  # (its scikit-build-core, nanobind, cmake and ninja), against the pip NCCL.
  # The wheel it builds is the one the python step installs.
  echo "== pybuild: pip wheel . on $(python3 --version 2>&1)"
  nccl_root=$(python3 -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null)
  rm -rf /tmp/epx-devwheel
  t0=$(date +%s)
  # The compiler must be the one whose libstdc++ the Python process loads:
  # EPX_PYBUILD_CXX (default: the system g++, not a newer one that $CXX may name).
  cxx=${EPX_PYBUILD_CXX:-$(command -v /usr/bin/g++ || echo "${CXX:-g++}")}
  echo "pybuild: CXX=$cxx ($($cxx --version | head -1)), env CXX=${CXX:-unset}"
  CXX=$cxx CUDAHOSTCXX=$cxx NCCL_ROOT=$nccl_root CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) timeout ${EPX_PYBUILD_TIMEOUT:-300} \
    python3 -m pip wheel -v --no-build-isolation --no-deps . -w /tmp/epx-devwheel \
    --config-settings=build-dir=/tmp/epx-devbuild > "$OUT/pybuild.log" 2>&1
  rc=$?
  echo "pybuild: rc=$rc in $(( $(date +%s) - t0 )) s: $(ls /tmp/epx-devwheel 2>/dev/null)"
  [ $rc -eq 0 ] || tail -30 "$OUT/pybuild.log"
  summary+=("pybuild: rc=$rc")
  [ $rc -eq 0 ] && EPX_WHEEL_DIR=/tmp/epx-devwheel
fi
if [[ " $RUN " == *" python "* ]]; then
  # The wheel (and any extra wheels, e.g. matplotlib's) goes to its own target dir;
  # torch, numpy and pytest come from the machine's Python.
  WHEEL_DIR=${EPX_WHEEL_DIR:-.device/wheel}
  shopt -s nullglob
  wheels=("$WHEEL_DIR"/*.whl)
  shopt -u nullglob
  if [ ${#wheels[@]} -eq 0 ]; then
    echo "== python: no wheel in $WHEEL_DIR, skipped"
    summary+=("python: skipped (no wheel in $WHEEL_DIR)")
  else
    echo "== python: installing ${wheels[*]##*/}"
    rm -rf /tmp/epx-site
    python3 -m pip install -q --no-deps --no-index --target /tmp/epx-site "${wheels[@]}" \
      > "$OUT/py-install.log" 2>&1
    rc=$?
    summary+=("python install: rc=$rc")
    if [ $rc -ne 0 ]; then
      tail -20 "$OUT/py-install.log"
    else
      export PYTHONPATH="/tmp/epx-site${PYTHONPATH:+:$PYTHONPATH}"
      # the NCCL wheel next to torch, wherever torch is installed ($SITE's is already first)
      tlib=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia", "nccl", "lib"))' 2>/dev/null)
      if [ -n "$tlib" ] && [ -d "$tlib" ] && [[ ":${LD_LIBRARY_PATH:-}:" != *":$tlib:"* ]]; then
        export LD_LIBRARY_PATH="$tlib:${LD_LIBRARY_PATH:-}"
      fi
      if [ -f "$D/COMMIT" ]; then
        EPX_COMMIT=$(cat "$D/COMMIT")
        export EPX_COMMIT
      fi
      if [ "${EPX_PY_TESTS:-1}" = 0 ]; then
        summary+=("python tests: not run (EPX_PY_TESTS=0)")
      else
        echo "== python GPU tests (pytest tests/python -m gpu)"
        # --capture=sys: the ranks' stderr (and the stacks EPX_TEST_STACKS_AFTER_S
        # dumps from a case that runs too long) reach the log even when the
        # timeout ends pytest.
        # Unbuffered and verbose: a run the timeout ends still says which tests passed.
        pytest_gpu() {  # LOG LIMIT K [VAR=VALUE...]
          local log=$1 limit=$2 k=$3
          shift 3
          EPX_TEST_STACKS_AFTER_S=${EPX_TEST_STACKS_AFTER_S:-60} EPX_TEST_STACKS_DIR="$OUT/py-stacks" \
            timeout "$limit" env "$@" python3 -u -m pytest --maxfail=${EPX_PY_MAXFAIL:-5} -v -ra \
            --durations=10 --capture=sys tests/python -m gpu ${k:+-k "$k"} > "$log" 2>&1
          local rc=$?
          grep -E "::.*(PASSED|FAILED|ERROR|SKIPPED)" "$log" | sed 's/^.*:://' | cut -c1-110
          grep -E "^(FAILED|ERROR) |^E  .*(Error|assert)" "$log" | head -20
          tail -2 "$log"
          return $rc
        }
        pytest_gpu "$OUT/py-tests.log" ${EPX_PY_TIMEOUT:-300} "${EPX_PY_K:-}"
        summary+=("python tests: rc=$?")
        # The across-nodes cases again over the other network backends
        # (EPX_PY_BACKENDS, default "nccl nvshmem"; the run above used the proxy):
        # the cases assert that the buffer is on the backend EPX_BACKEND names.
        if [ "$GPUS" -ge 2 ]; then
          for b in ${EPX_PY_BACKENDS:-nccl nvshmem}; do
            case $b in
              nccl) benv=("${GIN_ENV[@]}") ;;
              nvshmem) benv=("${NVS_ENV[@]}" LD_LIBRARY_PATH="$NVS_LIB:$LD_LIBRARY_PATH") ;;
              *) benv=(EPX_BACKEND="$b") ;;
            esac
            echo "== python GPU tests across nodes over $b"
            pytest_gpu "$OUT/py-tests-$b.log" ${EPX_PY_BACKEND_TIMEOUT:-150} \
              "across_nodes and processes${EPX_PY_K:+ and ($EPX_PY_K)}" "${benv[@]}"
            summary+=("python tests across nodes over $b: rc=$?")
          done
        fi
      fi
      py_plot=(--plot "$OUT/py-bench.png")
      if ! python3 -c "import matplotlib" 2>/dev/null; then
        echo "(no matplotlib here: sweep kept in the JSON; draw it with --replot)"
        py_plot=(--sweep)
      fi
      n=$GPUS
      [ "$n" -gt 8 ] && n=8
      if [ "${EPX_PY_BENCH:-1}" = 0 ]; then
        summary+=("python bench: not run (EPX_PY_BENCH=0)")
      else
        echo "== python -m epx.bench EP$n"
        timeout ${EPX_PY_TIMEOUT:-300} python3 -m epx.bench --ranks "$n" --compare-torch \
          --json "$OUT/py-bench.json" "${py_plot[@]}" ${EPX_PY_BENCH_ARGS:-} \
          > "$OUT/py-bench.log" 2>&1
        rc=$?
        grep -v "tokens done$" "$OUT/py-bench.log" | tail -45
        summary+=("python bench EP$n: rc=$rc")
      fi
    fi
  fi
fi
echo "== summary"
printf '%s\n' "${summary[@]}"
# The device tool brings back at most 8 files from $OUT: results stay files,
# the logs travel as one archive (logs.tgz).
(
  cd "$OUT" || exit 0
  shopt -s nullglob
  logs=(*.log topo.tx[t] py-stack[s])
  if [ ${#logs[@]} -gt 0 ] && tar czf logs.tgz "${logs[@]}"; then rm -rf "${logs[@]}"; fi
) || true

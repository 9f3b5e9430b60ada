#!/usr/bin/env bash
# Runs on the device machine (from the repository root, after
# scripts/device_pack.sh filled .device/): everything across (virtual)
# nodes, and the NVLink before/after comparison. Steps (EPX_NET, default all
# that fit the machine):
#   inproc   the GPU suite (Smoke, LowLatency, Network) with in-process ranks
#            as virtual nodes on GPU 0: EPX_VNODES_INPROC="R:RPN[:QPS] ..."
#            (default "4:2 16:4 4:2:4": 2x2, 4x4, and 2x2 with 4 proxy channels)
#   procs    the same with one process per GPU: EPX_VNODES_PROCS, R:RPN[:QPS]
#            (default "8:4 8:2 4:2 4:2:4 2:1", those that fit this host's
#            GPUs; QPS: contexts per peer, 1 unless given; also
#            EPX_NCCL_PROCS, EPX_NVSHMEM_PROCS)
#   kill     4 processes as 2x2, rank 3 SIGKILLs itself (on 2 GPUs: 2 as 2x1,
#            rank 1): the others must raise naming it (Network.KilledRankIsNamed
#            for the low-latency ops, Internode.KilledRankIsNamed for dispatch
#            and combine across nodes, Internode.KilledRankInCountExchange for
#            the host count exchange; EPX_KILL_TESTS; they print KILL-TEST lines)
#   soak     Network.Soak with EPX_SOAK pairs (default 100000) over 2x2
#            (processes where there are 4 GPUs, else in-process;
#            EPX_SOAK_LINEUP=1: the ranks meet before each pair)
#   bench    epx-bench ll over the proxy (2x2, EPX_BENCH_QPS channels: "1 4")
#            and epx-bench fifo (2 ranks)
#   nccl     (not in the default steps) the NCCL GIN backend through the
#            loopback plugin (.device/libnccl-net-epxloop.so; EPX_NCCL_QUEUE_SIZE:
#            NCCL_GIN_PROXY_QUEUE_SIZE for every run of it), one GPU per
#            rank: the plugin's own 2-process GPU test, the transport smoke
#            test, then the Smoke and LowLatency suites with EPX_BACKEND=nccl
#            as 2 processes of 1 node each and, with 4 GPUs, 4 as 2x2, a
#            killed rank, and epx-bench ll --backend nccl on 4 as 2x2
#   nvshmem  (not in the default steps) the NVSHMEM backend (.device/
#            libepx_nvshmem.so; NVSHMEM_REMOTE_TRANSPORT=none): the Smoke and
#            LowLatency suites as 2 processes of 1 node each and 4 as 2x2
#            (EPX_NVSHMEM_PROCS, EPX_NVSHMEM_FILTER), a killed rank (as the
#            kill step; EPX_NVSHMEM_KILL=0 skips it), and epx-bench ll
#            --backend nvshmem on 4 as 2x2
#   b2b      (not in the default steps) epx-bench ll over the proxy four ways,
#            for its back-to-back pair time: 4 processes; the same with a host
#            wait after each pair (--pair-sync); with the ranks lined up on the
#            GPU before each pair (--pair-lineup); 4 in-process ranks; the proxy
#            channels' stats (EPX_B2B_TRACE=1: every command instead);
#            EPX_B2B_INPROC_ENV: VAR=VALUE for the in-process run
#   xbench   (not in the default steps) epx-bench ht across virtual nodes on
#            4 in-process ranks as 2x2 (proxy), then epx-bench ll and ht with
#            one process per GPU (EPX_XBENCH_LAYOUTS, R:RPN; default 8 as 2x4
#            and 4x2, else 4 as 2x2, else 2 as 2x1) over each backend of
#            EPX_XBENCH_BACKENDS (default "proxy nccl nvshmem"), in this one
#            call (EPX_XBENCH_ARGS: more epx-bench arguments, e.g. --tokens;
#            EPX_XBENCH_FAMS: the families, default "ll ht")
#   rings    (not in the default steps) the Internode suite through the ring
#            dispatch (EPX_HT_RINGS=$EPX_RINGS, default 4 records per ring)
#            with a process per GPU over the proxy, nccl and nvshmem
#            (EPX_RINGS_PROCS, default "2:1 4:2"; EPX_RINGS_FILTER), then 4
#            in-process ranks as 2x2
#   late     (not in the default steps) the late-rank low-latency step at 4x4
#            in-process, EPX_LATE_RUNS times (default 10), then the LowLatency
#            suite at 4x4 once (EPX_LATE_SUITE=0: not)
#   fabric   (not in the default steps) the suites over the libfabric engine
#            (EPX_FABRIC_PROVIDERS, EPX_FABRIC_INPROC, EPX_FABRIC_FILTER)
#   fbench   (not in the default steps) epx-bench ll and ht at in-process 2x2
#            over the cuda_ipc and libfabric (tcp, shm) engines
#   compare  NVLink before/after on all GPUs: .device/base/epx-bench (the
#            baseline build) and .device/epx-bench, ht (24 SMs) and ll,
#            EPX_COMPARE_ROUNDS times (default 2; base first in odd rounds,
#            new first in even ones), families EPX_COMPARE_FAMS ("ht ll")
# Logs and JSON under $OUT, packed into logs.tgz and json.tgz at the end.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
source "$D/device_env.sh"  # OUT, SITE, GPUS, the environment
export CUDA_MODULE_LOADING=EAGER
STEPS=${EPX_NET:-inproc procs kill soak bench compare}
FILTER=${EPX_NET_FILTER:-Smoke.*:LowLatency.*:Network.*}
mkdir -p "$OUT/json"
summary=()
has() { [[ " $STEPS " == *" $1 "* ]]; }
model=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h[0-9]{3}' | head -1 | tr 'A-Z' 'a-z')
echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1), $GPUS GPUs, commit $(cat "$D/COMMIT" 2>/dev/null), steps: $STEPS"
LINEBUF=()
command -v stdbuf >/dev/null 2>&1 && LINEBUF=(stdbuf -oL -eL)
run_suite() {  # LABEL LOG TIMEOUT COMMAND... (line-buffered: a killed run keeps its log)
  local label=$1 log=$2 limit=$3
  shift 3
  echo "== $label"
  local t0=$(date +%s)
  timeout "$limit" ${LINEBUF[@]+"${LINEBUF[@]}"} "$@" > "$log" 2>&1
  local rc=$?
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]|tests passed|FAILURES|epx_gpu_tests:|soak:" "$log" | sort | uniq -c | head -40
  [ $rc -eq 0 ] || tail -40 "$log"
  summary+=("$label: rc=$rc ($(( $(date +%s) - t0 )) s)")
}
# Process runs of the GPU suite: procs_suites BACKEND SPECS FILTER [VAR=VALUE...]
# (the backend's environment); SPECS "R:RPN[:QPS] ...": R processes as nodes of
# RPN with QPS contexts per peer (EPX_TEST_QPS: proxy channels, GIN contexts;
# NVSHMEM uses one), where this host has R GPUs.
procs_suites() {
  local backend=$1 specs=$2 filter=$3 spec r rpn qps
  shift 3
  for spec in $specs; do
    IFS=: read -r r rpn qps <<< "$spec"
    qps=${qps:-1}
    [ "$GPUS" -ge "$r" ] || continue
    run_suite "$r processes, nodes of $rpn, $qps contexts ($backend)" \
      "$OUT/$backend-procs$r-rpn$rpn-qps$qps.log" ${EPX_TEST_TIMEOUT:-420} \
      env "$@" EPX_RANKS_PER_NODE=$rpn EPX_TEST_QPS=$qps "$D/launch.sh" "$r" "$D/epx_gpu_tests" \
      --gtest_filter="$filter"
  done
}
if has inproc; then
  for spec in ${EPX_VNODES_INPROC:-4:2 16:4 4:2:4}; do  # R:RPN[:QPS]
    IFS=: read -r r rpn qps <<< "$spec"
    qps=${qps:-1}
    run_suite "in-process $r ranks, nodes of $rpn, $qps channels (proxy)" \
      "$OUT/net-inproc$r-rpn$rpn-qps$qps.log" ${EPX_TEST_TIMEOUT:-420} \
      env EPX_RANKS_PER_NODE=$rpn EPX_TEST_QPS=$qps "$D/epx_gpu_tests" --in-process=$r \
      --gtest_filter="$FILTER"
  done
fi
if has procs; then
  procs_suites proxy "${EPX_VNODES_PROCS:-8:4 8:2 4:2 4:2:4 2:1}" "$FILTER"
fi
# A killed process: 4 processes as 2x2 (rank 3 dies), or on 2 GPUs 2 as 2x1
# (rank 1 dies); the survivors must raise naming it. kill_test LABEL LOG
# [VAR=VALUE...] (the backend's environment).
kill_test() {
  local label=$1 log=$2 kn=4 krpn=2
  shift 2
  [ "$GPUS" -ge 4 ] || { kn=2; krpn=1; }
  local victim=$((kn - 1)) test
  # The low-latency ops, then dispatch and combine across nodes (EPX_KILL_TESTS)
  for test in ${EPX_KILL_TESTS:-Network.KilledRankIsNamed Internode.KilledRankIsNamed Internode.KilledRankInCountExchange}; do
    local tlog="${log%.log}-${test//./-}.log"
    echo "== a killed process$label, $test ($kn processes, nodes of $krpn, rank $victim SIGKILLs itself)"
    # (EPX_TIMEOUT_S: the communicator's collectives, which the tests' buffers do not set)
    timeout ${EPX_KILL_TIMEOUT:-120} env EPX_TIMEOUT_S=5 "$@" EPX_RANKS_PER_NODE=$krpn EPX_TEST_KILL_RANK=$victim \
      "$D/launch.sh" $kn "$D/epx_gpu_tests" --gtest_filter="$test" > "$tlog" 2>&1
    echo "rc=$?"
    grep "KILL-TEST" "$tlog"
    local pass
    pass=$(grep -c "KILL-TEST rank [0-9]*: PASS" "$tlog")
    summary+=("killed rank$label, $test: $pass of $victim survivors raised naming it$([ "$pass" = $victim ] && echo ' (PASS)' || echo ' (FAIL)')")
  done
}
if has kill && [ "$GPUS" -ge 2 ]; then
  kill_test "" "$OUT/net-kill.log"
fi
if has soak; then
  n=${EPX_SOAK:-100000}
  if [ "$GPUS" -ge 4 ]; then
    run_suite "soak: $n LL pairs, 4 processes as 2x2 (proxy)" "$OUT/net-soak.log" \
      ${EPX_SOAK_TIMEOUT:-540} env EPX_RANKS_PER_NODE=2 EPX_TEST_SOAK=$n \
      EPX_TEST_SOAK_LINEUP=${EPX_SOAK_LINEUP:-0} "$D/launch.sh" 4 \
      "$D/epx_gpu_tests" --gtest_filter="Network.Soak*"
  else
    run_suite "soak: $n LL pairs, 4 in-process ranks as 2x2 (proxy)" "$OUT/net-soak.log" \
      ${EPX_SOAK_TIMEOUT:-540} env EPX_RANKS_PER_NODE=2 EPX_TEST_SOAK=$n \
      EPX_TEST_SOAK_LINEUP=${EPX_SOAK_LINEUP:-0} "$D/epx_gpu_tests" \
      --in-process=4 --gtest_filter="Network.Soak*"
  fi
fi
if has bench; then
  if [ "$GPUS" -ge 4 ]; then
    ll=("$D/launch.sh" 4 "$D/epx-bench" ll) tag="${model}x4"
  else
    ll=("$D/epx-bench" ll --in-process 4) tag="${model}x1-inproc4"
  fi
  for qps in ${EPX_BENCH_QPS:-1 4}; do
    echo "== epx-bench ll --backend proxy --ranks-per-node 2 --qps $qps"
    timeout ${EPX_BENCH_TIMEOUT:-300} ${LINEBUF[@]+"${LINEBUF[@]}"} "${ll[@]}" --backend proxy \
      --ranks-per-node 2 --qps $qps ${EPX_NET_LL_ARGS:-} \
      --json "$OUT/json/$tag-ll-proxy-rpn2-qps$qps.json" > "$OUT/bench-ll-proxy-qps$qps.log" 2>&1
    rc=$?
    tail -8 "$OUT/bench-ll-proxy-qps$qps.log"
    summary+=("bench ll proxy 2x2, $qps channels: rc=$rc")
  done
  if [ "$GPUS" -ge 2 ]; then
    fifo=("$D/launch.sh" 2 "$D/epx-bench" fifo) ftag="${model}x2"
  else
    fifo=("$D/epx-bench" fifo --in-process 2) ftag="${model}x1-inproc2"
  fi
  echo "== epx-bench fifo"
  timeout ${EPX_FIFO_TIMEOUT:-120} "${fifo[@]}" --json "$OUT/json/$ftag-fifo.json" > "$OUT/bench-fifo.log" 2>&1
  rc=$?
  tail -6 "$OUT/bench-fifo.log"
  summary+=("bench fifo: rc=$rc")
fi
if has nccl && [ "$GPUS" -ge 2 ]; then
  gin=(env "$GIN_PLUGIN" NCCL_DEBUG=${EPX_NCCL_DEBUG:-WARN}
       NCCL_DEBUG_SUBSYS=INIT,NET)
  # EPX_NCCL_QUEUE_SIZE: a smaller GIN proxy queue per (context, peer) (a power
  # of two, e.g. 4), so that posts wait in EPX's credit gate all the time
  [ -n "${EPX_NCCL_QUEUE_SIZE:-}" ] && gin+=(NCCL_GIN_PROXY_QUEUE_SIZE=$EPX_NCCL_QUEUE_SIZE)
  run_suite "loopback GIN plugin, 2 processes (its own test)" "$OUT/nccl-plugin.log" 120 \
    "${gin[@]}" "$D/epx_gin_loopback_gpu_tests"
  run_suite "NCCL GIN transport smoke, 2 processes as 2 nodes" "$OUT/nccl-smoke.log" 120 \
    "${gin[@]}" EPX_TEST_NCCL_GIN=1 EPX_RANKS_PER_NODE=1 "$D/launch.sh" 2 "$D/epx_gpu_tests" \
    --gtest_filter=Smoke.TransportPutSignalNcclGin
  procs_suites nccl "${EPX_NCCL_PROCS:-2:1 4:2 4:2:4 8:4 8:2}" "${EPX_NCCL_FILTER:-Smoke.*:LowLatency.*}" \
    "${gin[@]:1}" EPX_BACKEND=nccl
  # (NCCL's device code has no deadline of its own: a hang here is a finding.)
  kill_test " over nccl" "$OUT/nccl-kill.log" "${gin[@]:1}" EPX_BACKEND=nccl
  # A network that stops completing puts 20 s after connecting (the plugin's
  # EPX_GIN_LOOP_STALL_AFTER_S): each rank must raise within the deadline,
  # for the HT ops across nodes and for the LL ops, whose dispatch overfills
  # NCCL's GIN proxy queue (EPX_NCCL_STALL_TESTS; EPX_NCCL_STALL=0 skips it)
  if [ "${EPX_NCCL_STALL:-1}" = 1 ]; then
    for t in ${EPX_NCCL_STALL_TESTS:-Internode.StalledNetworkIsNamed Network.StalledNetworkIsNamed}; do
      echo "== a stalled network over nccl, $t (2 processes, nodes of 1)"
      log="$OUT/nccl-stall-${t//./-}.log"
      # A queue of 32 descriptors per (context, peer) (the plugin's default
      # depth gives 512): the LL dispatch's 128 tokens then overfill it.
      timeout ${EPX_KILL_TIMEOUT:-150} "${gin[@]}" EPX_BACKEND=nccl EPX_RANKS_PER_NODE=1 \
        NCCL_GIN_PROXY_QUEUE_SIZE=${EPX_NCCL_STALL_QUEUE:-32} \
        EPX_GIN_LOOP_STALL_AFTER_S=${EPX_NCCL_STALL_S:-20} "$D/launch.sh" 2 "$D/epx_gpu_tests" \
        --gtest_filter="$t" > "$log" 2>&1
      echo "rc=$?"
      grep "STALL-TEST" "$log"
      pass=$(grep -c "STALL-TEST rank [0-9]*: PASS" "$log")
      summary+=("stalled network over nccl, $t: $pass of 2 ranks raised within the deadline$([ "$pass" = 2 ] && echo ' (PASS)' || echo ' (FAIL)')")
    done
  fi
  if [ "$GPUS" -ge 4 ]; then
    # The LL bench over NCCL's GIN path (GIN_PROXY through the loopback plugin:
    # CUDA/host copies on this host, not a NIC), beside the proxy's figures.
    echo "== epx-bench ll --backend nccl --ranks-per-node 2"
    timeout ${EPX_BENCH_TIMEOUT:-300} env "${gin[@]:1}" "$D/launch.sh" 4 "$D/epx-bench" ll \
      --backend nccl --ranks-per-node 2 --json "$OUT/json/${model}x4-ll-nccl-rpn2.json" \
      > "$OUT/bench-ll-nccl.log" 2>&1
    rc=$?
    tail -8 "$OUT/bench-ll-nccl.log"
    summary+=("bench ll nccl 2x2: rc=$rc")
  fi
fi
# NVSHMEM's environment for the nvshmem and xbench steps: its library from
# this machine's pip wheel, the unique-id bootstrap over loopback (its default
# skips lo); NVSHMEM's INFO log and EPX's trace of each NVSHMEM host call
# (with a message every EPX_TIMEOUT_S while one has not returned) say where a
# start stops. On one host NVSHMEM moves the bytes by P2P; the kernels still
# take the put/signal path for peers of another virtual node.
nvs=(env "${NVS_ENV[@]}" NVSHMEM_DEBUG=${EPX_NVSHMEM_DEBUG:-INFO} EPX_NVSHMEM_TRACE=1
     EPX_TIMEOUT_S=${EPX_TIMEOUT_S:-30})
if has xbench; then
  # On one host the network is CUDA IPC copies (proxy), the loopback GIN
  # plugin (nccl) or NVSHMEM's P2P: these times do not predict a cluster
  # (docs/scaling.md does that from bytes).
  xb() {  # FAMILY LABEL TAG ENV/COMMAND...
    local fam=$1 label=$2 tag=$3
    shift 3
    echo "== epx-bench $fam $label"
    timeout ${EPX_BENCH_TIMEOUT:-300} ${LINEBUF[@]+"${LINEBUF[@]}"} "$@" ${EPX_XBENCH_ARGS:-} \
      --json "$OUT/json/$tag.json" > "$OUT/bench-$tag.log" 2>&1
    local rc=$?
    tail -9 "$OUT/bench-$tag.log"
    summary+=("bench $fam $label: rc=$rc")
  }
  xb ht "4 in-process as 2x2 (proxy)" "${model}x1-inproc4-ht-proxy-rpn2" \
    "$D/epx-bench" ht --in-process 4 --ranks-per-node 2 --backend proxy
  # Layouts R:RPN (EPX_XBENCH_LAYOUTS): 8 GPUs as 2x4 and 4x2, else 4 as 2x2, else 2 as 2x1.
  layouts="2:1"
  [ "$GPUS" -ge 4 ] && layouts="4:2"
  [ "$GPUS" -ge 8 ] && layouts="8:4 8:2"
  for lay in ${EPX_XBENCH_LAYOUTS:-$( [ "$GPUS" -ge 2 ] && echo "$layouts")}; do
    IFS=: read -r hn hrpn <<< "$lay"
    [ "$GPUS" -ge "$hn" ] || continue
    for be in ${EPX_XBENCH_BACKENDS:-proxy nccl nvshmem}; do
      case $be in
        nccl) pre=(env "$GIN_PLUGIN") ;;
        nvshmem) pre=("${nvs[@]}" NVSHMEM_DEBUG=WARN EPX_NVSHMEM_TRACE=0) ;;
        *) pre=(env) ;;
      esac
      for fam in ${EPX_XBENCH_FAMS:-ll ht}; do
        xb $fam "$hn processes, nodes of $hrpn ($be)" "${model}x$GPUS-$fam-$be-rpn$hrpn" \
          "${pre[@]}" "$D/launch.sh" $hn "$D/epx-bench" $fam --ranks-per-node $hrpn --backend $be
      done
    done
  done
fi
if has nvshmem && [ "$GPUS" -ge 2 ]; then
  # The NVSHMEM backend (.device/libepx_nvshmem.so, found beside the test
  # binary).
  # (NVSHMEM's environment: nvs, above.)
  procs_suites nvshmem "${EPX_NVSHMEM_PROCS:-2:1 4:2 8:4 8:2}" "${EPX_NVSHMEM_FILTER:-Smoke.*:LowLatency.*}" \
    "${nvs[@]:1}"
  # A killed process over NVSHMEM (EPX_NVSHMEM_KILL=0 skips it)
  [ "${EPX_NVSHMEM_KILL:-1}" = 1 ] && \
    kill_test " over nvshmem" "$OUT/nvshmem-kill.log" "${nvs[@]:1}" NVSHMEM_DEBUG=WARN \
      EPX_NVSHMEM_TRACE=0 EPX_TIMEOUT_S=3
  if [ "$GPUS" -ge 4 ]; then
    echo "== epx-bench ll --backend nvshmem --ranks-per-node 2"
    timeout ${EPX_BENCH_TIMEOUT:-300} "${nvs[@]}" "$D/launch.sh" 4 "$D/epx-bench" ll \
      --backend nvshmem --ranks-per-node 2 --json "$OUT/json/${model}x4-ll-nvshmem-rpn2.json" \
      > "$OUT/bench-ll-nvshmem.log" 2>&1
    rc=$?
    tail -8 "$OUT/bench-ll-nvshmem.log"
    summary+=("bench ll nvshmem 2x2: rc=$rc")
  fi
fi
if has rings; then
  # The Internode suite through the ring dispatch (EPX_HT_RINGS; EPX_RINGS:
  # its value, default 4: rings of 4 records, so every op wraps and waits
  # for credits): processes over each backend, then in-process ranks.
  rr=${EPX_RINGS:-4}
  rf=${EPX_RINGS_FILTER:-Internode.*}
  procs_suites proxy-rings "${EPX_RINGS_PROCS:-2:1 4:2}" "$rf" EPX_HT_RINGS=$rr
  procs_suites nccl-rings "${EPX_RINGS_PROCS:-2:1 4:2}" "$rf" "$GIN_PLUGIN" EPX_BACKEND=nccl \
    EPX_HT_RINGS=$rr
  [ -n "${NVS_LIB:-}" ] && [ -f "$D/libepx_nvshmem.so" ] && \
    procs_suites nvshmem-rings "${EPX_RINGS_PROCS:-2:1 4:2}" "$rf" "${NVS_ENV[@]}" EPX_HT_RINGS=$rr
  run_suite "in-process 4 ranks, nodes of 2, rings of $rr (proxy)" "$OUT/rings-inproc4.log" \
    ${EPX_TEST_TIMEOUT:-420} env EPX_RANKS_PER_NODE=2 EPX_HT_RINGS=$rr "$D/epx_gpu_tests" \
    --in-process=4 --gtest_filter="$rf"
fi
if has b2b; then
  # Why ops back to back over the proxy are slow: the same bench three ways
  # (4 processes as 2x2; the same with a host wait after each pair; 4
  # in-process ranks on GPU 0), each printing "back to back" per pair and the
  # proxy channels' stats (EPX_B2B_TRACE=1: every command instead).
  runs=()
  [ "$GPUS" -ge 4 ] && runs+=("procs::$D/launch.sh 4 $D/epx-bench ll"
                              "procs-sync::$D/launch.sh 4 $D/epx-bench ll --pair-sync"
                              "procs-lineup::$D/launch.sh 4 $D/epx-bench ll --pair-lineup")
  runs+=("inproc4:${EPX_B2B_INPROC_ENV:-}:$D/epx-bench ll --in-process 4")
  for spec in "${runs[@]}"; do
    IFS=: read -r tag envs cmd <<< "$spec"
    echo "== back to back: $tag"
    timeout ${EPX_B2B_TIMEOUT:-120} env $envs EPX_DEBUG_PROXY=${EPX_B2B_TRACE:-stats} $cmd \
      --backend proxy --ranks-per-node 2 --iters 20 --json "$OUT/json/b2b-$tag.json" \
      > "$OUT/b2b-$tag.log" 2>&1
    rc=$?
    grep -E "^dispatch FP8|^combine BF16 |back to back|CPUs allowed|stats:" "$OUT/b2b-$tag.log" | sort | uniq -c | head -16
    summary+=("back to back $tag: rc=$rc")
  done
fi
if has compare && [ -x "$D/base/epx-bench" ] && [ "$GPUS" -ge 2 ]; then
  n=$GPUS
  [ "$n" -gt 8 ] && n=8
  for round in $(seq 1 ${EPX_COMPARE_ROUNDS:-2}); do
    # base, new in odd rounds and new, base in even ones: a machine that
    # drifts (clocks, heat) favours neither side.
    order="base new"
    [ $((round % 2)) = 0 ] && order="new base"
    for which in $order; do
      bin="$D/epx-bench"
      [ $which = base ] && bin="$D/base/epx-bench"
      for fam in ${EPX_COMPARE_FAMS:-ht ll}; do
        args=()
        [ $fam = ht ] && args=(--no-sweep)
        echo "== compare round $round: $which $fam EP$n"
        timeout 300 "$D/launch.sh" "$n" "$bin" $fam "${args[@]}" \
          --json "$OUT/json/${model}x$n-$fam-$which-r$round.json" > "$OUT/cmp-$which-$fam-r$round.log" 2>&1
        rc=$?
        grep -E "^(dispatch|combine)" "$OUT/cmp-$which-$fam-r$round.log" | head -6
        summary+=("compare $which $fam round $round: rc=$rc")
      done
    done
  done
fi
# The low-latency step with the last rank 50 ms late after a clean, at 16
# in-process ranks as 4x4 over the proxy, EPX_LATE_RUNS times in a row (a
# run of it once left every combine output unwritten without an error), then
# the whole LowLatency suite once at 4x4.
if has late; then
  n=${EPX_LATE_RUNS:-10}
  passed=0
  for i in $(seq 1 "$n"); do
    run_suite "late rank after a clean, 4x4 in-process, run $i of $n" "$OUT/late-$i.log" 200 \
      env EPX_RANKS_PER_NODE=4 "$D/epx_gpu_tests" --in-process=16 \
      --gtest_filter='LowLatency.CleanOnAFreshBufferThenOps:LowLatency.LateRankStepsAfterClean'
    grep -q "^\[  PASSED  \] 2 tests" "$OUT/late-$i.log" && passed=$((passed + 1))
  done
  summary+=("late rank after a clean, 4x4: $passed of $n runs passed")
  if [ "${EPX_LATE_SUITE:-1}" = 1 ]; then
    run_suite "LowLatency suite, 4x4 in-process (proxy, cuda_ipc)" "$OUT/late-suite.log" 420 \
      env EPX_RANKS_PER_NODE=4 "$D/epx_gpu_tests" --in-process=16 --gtest_filter='LowLatency.*'
  fi
fi
# The proxy's libfabric engine (EPX_PROXY_ENGINE=libfabric) over the providers
# of EPX_FABRIC_PROVIDERS (default tcp;ofi_rxm and shm, loopback), with
# in-process ranks as virtual nodes (EPX_FABRIC_INPROC, R:RPN, default 2x2 and
# 4x4), the suites of EPX_FABRIC_FILTER.
if has fabric; then
  echo "== libfabric: $(fi_info --version 2>/dev/null | head -1); providers: $(fi_info -l 2>/dev/null | grep -v version | tr -d ':' | tr '\n' ' ')"
  for prov in ${EPX_FABRIC_PROVIDERS:-"tcp;ofi_rxm" shm}; do
    for spec in ${EPX_FABRIC_INPROC:-4:2 16:4}; do
      IFS=: read -r r rpn <<< "$spec"
      run_suite "libfabric $prov, in-process $r ranks, nodes of $rpn" \
        "$OUT/fabric-${prov//;/-}-inproc$r-rpn$rpn.log" ${EPX_TEST_TIMEOUT:-420} \
        env EPX_PROXY_ENGINE=libfabric EPX_FABRIC_PROVIDER="$prov" FI_TCP_IFACE=lo \
        EPX_RANKS_PER_NODE=$rpn "$D/epx_gpu_tests" --in-process=$r \
        --gtest_filter="${EPX_FABRIC_FILTER:-Smoke.*:LowLatency.*:Network.*:Internode.*}"
    done
  done
fi
# epx-bench ll and ht on 4 in-process ranks as 2x2 over the proxy, the CUDA IPC
# engine and the libfabric one (tcp;ofi_rxm, shm) in this one call.
if has fbench; then
  for eng in cuda_ipc "libfabric:tcp;ofi_rxm" libfabric:shm; do
    IFS=: read -r e prov <<< "$eng"
    tag=${e}${prov:+-${prov//;/-}}
    for fam in ll ht; do
      args=()
      [ $fam = ht ] && args=(--no-sweep)
      echo "== epx-bench $fam, 4 in-process as 2x2, engine $eng"
      timeout 240 env FI_TCP_IFACE=lo "$D/epx-bench" $fam --in-process 4 --ranks-per-node 2 \
        --backend proxy --proxy-engine "$e" ${prov:+--fabric-provider "$prov"} "${args[@]}" \
        --json "$OUT/json/${model}-inproc4-rpn2-$fam-$tag.json" > "$OUT/fbench-$fam-$tag.log" 2>&1
      rc=$?
      grep -E "^(dispatch|combine|pair|  )" "$OUT/fbench-$fam-$tag.log" | head -12
      [ $rc -eq 0 ] || tail -20 "$OUT/fbench-$fam-$tag.log"
      summary+=("epx-bench $fam engine $eng: rc=$rc")
    done
  done
fi
echo "== summary"
printf '%s\n' "${summary[@]}"
(
  cd "$OUT" || exit 0
  shopt -s nullglob
  logs=(*.log)
  if [ ${#logs[@]} -gt 0 ] && tar czf net-logs.tgz "${logs[@]}"; then rm -f "${logs[@]}"; fi
  if [ -d json ] && tar czf json.tgz json; then rm -rf json; fi
) || true

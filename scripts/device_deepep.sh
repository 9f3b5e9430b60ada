#!/usr/bin/env bash
# Runs on the device machine (from the repository root, after
# scripts/device_pack.sh with EPX_WHEEL_PYTHON filled .device/): DeepEP's own
# V1 tests, unchanged, against EPX's `deep_ep` from the wheel in .device/wheel/.
# DeepEP's files are not part of EPX: put them in .device/deepep_v1/ first
# (git-ignored), e.g. from a clone of deepseek-ai/DeepEP at 567632d:
#   for f in test_low_latency.py test_intranode.py utils.py; do
#     git -C DEEPEP show 567632d:tests/$f > .device/deepep_v1/$f; done
# Each test runs with --num-processes = the local GPUs (one on a 1-GPU machine),
# EPX_DEEPEP_TIMEOUT (150 s) each; logs under $OUT/deepep-*.log, a line each last.
#   EPX_DEEPEP_TESTS  the runs, ';'-separated (default: test_intranode.py;
#                     test_low_latency.py;test_low_latency.py --use-logfmt)
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
source "$D/device_env.sh"  # OUT, GPUS, the environment
T=$D/deepep_v1
[ -f "$T/utils.py" ] || { echo "device_deepep.sh: no DeepEP tests in $T (see the header)"; exit 2; }
rm -rf /tmp/epx-site
python3 -m pip install -q --no-deps --no-index --target /tmp/epx-site "$D"/wheel/*.whl \
  > "$OUT/deepep-install.log" 2>&1 || { tail -5 "$OUT/deepep-install.log"; exit 1; }
export PYTHONPATH=/tmp/epx-site
# the NCCL wheel next to torch (torch.distributed's)
tlib=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia", "nccl", "lib"))' 2>/dev/null)
[ -n "$tlib" ] && [ -d "$tlib" ] && export LD_LIBRARY_PATH="$tlib:${LD_LIBRARY_PATH:-}"
summary=()
IFS=';' read -ra runs <<< "${EPX_DEEPEP_TESTS:-test_intranode.py;test_low_latency.py;test_low_latency.py --use-logfmt}"
for run in "${runs[@]}"; do
  tag=$(echo "$run" | tr -c 'A-Za-z0-9\n' '_')
  log="$OUT/deepep-$tag.log"
  t0=$(date +%s)
  # shellcheck disable=SC2086  # run: a file name and its options
  (cd "$T" && timeout "${EPX_DEEPEP_TIMEOUT:-150}" python3 -u $run --num-processes "$GPUS") \
    > "$log" 2>&1
  rc=$?
  summary+=("$run: rc=$rc ($(($(date +%s) - t0)) s)")
  echo "== $run: rc=$rc"
  grep -E "bandwidth|send/recv|Error|error|assert" "$log" | head -8 | cut -c1-300
done
printf '%s\n' "${summary[@]}"

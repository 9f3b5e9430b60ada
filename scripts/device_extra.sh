#!/usr/bin/env bash
# Extra device-side runs (from the repository root on the device machine,
# after scripts/device_pack.sh copied this file into .device/):
#   bash .device/device_extra.sh tokens        # epx-bench ht --tokens T --no-sweep
#                                             # for T in $TOKS (128 256 512 1024 2048)
#   bash .device/device_extra.sh ncu KERNEL [FAMILY]
#                                             # ncu --set full on rank 0, one launch of
#                                             # the kernels matching KERNEL (a regex) in
#                                             # `epx-bench FAMILY` (default ll); only for
#                                             # kernels that are safe to replay (docs/device.md)
# Logs, JSON and reports go to $OUT.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
source "$D/device_env.sh"  # OUT, GPUS, the environment
n=$GPUS
[ "$n" -gt 8 ] && n=8
case "${1:-}" in
  tokens)
    for t in ${TOKS:-128 256 512 1024 2048}; do
      echo "== tokens $t"
      timeout 60 "$D/launch.sh" "$n" "$D/epx-bench" ht --tokens "$t" --no-sweep \
        --json "$OUT/ht-t$t.json" 2>&1 | grep -E "^(dispatch|combine)"
    done
    ;;
  ncu)
    kernel=${2:?usage: device_extra.sh ncu KERNEL_REGEX [FAMILY]}
    fam=${3:-ll}
    ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
    [ -n "$ncu" ] || { echo "no ncu on this machine"; exit 1; }
    wrap=$(mktemp)
    cat > "$wrap" <<EOW
#!/usr/bin/env bash
if [ "\$RANK" = 0 ]; then
  exec "$ncu" --clock-control none --kernel-name "regex:$kernel" --launch-skip 20 --launch-count 1 \
    --set full -f -o "$OUT/$kernel" "\$@"
fi
exec "\$@"
EOW
    chmod +x "$wrap"
    timeout 300 "$D/launch.sh" "$n" "$wrap" "$D/epx-bench" "$fam" > "$OUT/ncu-run.log" 2>&1
    echo "ncu rc=$?"
    "$ncu" --import "$OUT/$kernel.ncu-rep" --page details > "$OUT/$kernel.txt" 2>&1
    "$ncu" --import "$OUT/$kernel.ncu-rep" --page source --csv --print-source sass \
      > "$OUT/$kernel-source.csv" 2>&1
    grep -E "Duration|Throughput|Eligible|No Eligible|Occupancy" "$OUT/$kernel.txt" | head -20
    ;;
  *)
    echo "usage: device_extra.sh tokens | ncu KERNEL_REGEX [FAMILY]"
    exit 2
    ;;
esac

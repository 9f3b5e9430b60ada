"""What ``epx.bench`` reports: the ops it times, their byte counts, the statistics over runs
and ranks, and the tables and plots of a result (no GPU needed: ``--replot`` uses these alone)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

# Per family: (key, label, EPX bytes kind). Bytes kind: "bf16", "fp8" or None (time only).
HT_OPS = (
    ("dispatch_bf16", "dispatch BF16 (cached)", "bf16"),
    ("dispatch_fp8", "dispatch FP8 (cached)", "fp8"),
    ("combine", "combine BF16", "bf16"),
    ("dispatch_bf16_uncached", "dispatch BF16 (uncached)", "bf16"),
    ("dispatch_bf16_full", "layout + dispatch BF16", "bf16"),
    ("layout", "get_dispatch_layout", None),
)
LL_OPS = (
    ("dispatch_fp8", "dispatch FP8", "fp8"),
    ("dispatch_bf16", "dispatch BF16", "bf16"),
    ("combine", "combine BF16", "bf16"),
    ("combine_logfmt", "combine BF16 + LogFMT", None),
    ("dispatch_send", "dispatch FP8 send (hook)", None),
    ("dispatch_recv", "dispatch FP8 recv (hook)", None),
    ("combine_send", "combine send (hook)", None),
    ("combine_recv", "combine recv (hook)", None),
)
# --mode v2: DeepEP V2's API (deep_ep.ElasticBuffer, non-expanded, with CPU sync) at the SM
# count its get_theoretical_num_sms picks, beside V1's (epx.Buffer) on the same tokens.
V2_OPS = (
    ("v2_dispatch_bf16", "V2 dispatch BF16", "bf16"),
    ("v2_dispatch_fp8", "V2 dispatch FP8", "fp8"),
    ("v2_combine", "V2 combine BF16", "bf16"),
    ("v1_dispatch_bf16", "V1 layout + dispatch BF16", "bf16"),
    ("v1_combine", "V1 combine BF16", "bf16"),
)
# Ops drawn by --plot (EPX solid, torch dashed).
PLOT_OPS = {"ht": ("dispatch_bf16", "dispatch_fp8", "combine", "dispatch_bf16_full"),
            "ll": ("dispatch_fp8", "dispatch_bf16", "combine")}
FAMILY_NAMES = {"ht": "high-throughput", "ll": "low-latency",
                "v2": "V2 API (ElasticBuffer) beside V1 (Buffer)"}
OPS = {"ht": HT_OPS, "ll": LL_OPS, "v2": V2_OPS}


# ---- byte counts (DESIGN.md, Metrics) ------------------------------------------------------------

def ht_bytes(num_recv_tokens: int, hidden: int, fp8: bool = False) -> int:
    """Bytes of one high-throughput dispatch or combine: ``recv_x.numel() * element size``;
    FP8 adds its float32 scales (one per 128 channels)."""
    if fp8:
        return num_recv_tokens * hidden + num_recv_tokens * (hidden // 128) * 4
    return num_recv_tokens * hidden * 2


def ll_bytes(num_selections: int, hidden: int, fp8: bool = False) -> int:
    """Bytes of one low-latency dispatch or combine: per valid (token, top-k) selection
    ``H + H/128*4 + 16`` (FP8) or ``2H`` (BF16)."""
    per = hidden + hidden // 128 * 4 + 16 if fp8 else 2 * hidden
    return num_selections * per


def op_bytes(family: str, kind: Optional[str], count: int, hidden: int) -> Optional[int]:
    """Bytes of an op of ``family`` ("ht" and "v2": count = tokens received; "ll": count =
    valid selections sent) whose payload is ``kind`` ("bf16", "fp8", or None: not counted)."""
    if kind is None:
        return None
    count_fn = ll_bytes if family == "ll" else ht_bytes
    return count_fn(count, hidden, fp8=kind == "fp8")


# ---- statistics ----------------------------------------------------------------------------------

def median(values: Sequence[float]) -> float:
    """The median as the C++ bench takes it: element n/2 of the sorted values."""
    if not values:
        raise ValueError("median: no values")
    return sorted(values)[len(values) // 2]


def spread(values: Sequence[float]) -> Dict[str, float]:
    """{"mean", "min", "max"} of per-rank values."""
    if not values:
        raise ValueError("spread: no values")
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def summarize_op(per_rank: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One op's per-rank {"us", "bytes"[, "host_us"]} -> {"us": spread, "gbps": spread or
    None, "bytes": spread or None[, "host_us": spread]}. GB/s per rank = bytes / time
    (1 GB = 1e9 B), then spread."""
    us = [r["us"] for r in per_rank]
    out: Dict[str, Any] = {"us": spread(us), "gbps": None, "bytes": None}
    if all(r.get("host_us") is not None for r in per_rank):
        out["host_us"] = spread([r["host_us"] for r in per_rank])
    if per_rank[0].get("bytes") is not None:
        b = [r["bytes"] for r in per_rank]
        out["bytes"] = spread(b)
        out["gbps"] = spread([nb / t / 1e3 for nb, t in zip(b, us)])
    return out


def summarize_point(per_rank: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Per-rank measurements of one (family, tokens) point -> the point's summary:
    {"tokens", "ops": {key: summary}, "torch": {key: summary}, "epx_over_torch": {key: x}}."""
    first = per_rank[0]
    point: Dict[str, Any] = {"tokens": first["tokens"], "ops": {}, "torch": {},
                             "epx_over_torch": {}}
    for side in ("ops", "torch"):
        for key in first.get(side, {}):
            point[side][key] = summarize_op([r[side][key] for r in per_rank])
    for key, t in point["torch"].items():
        e = point["ops"].get(key)
        if e is not None and e["gbps"] is not None and t["gbps"] is not None:
            point["epx_over_torch"][key] = e["gbps"]["mean"] / t["gbps"]["mean"]
        elif e is not None:
            point["epx_over_torch"][key] = t["us"]["mean"] / e["us"]["mean"]
    for k in ("num_recv_tokens", "num_selections"):
        if k in first:
            point[k] = spread([r[k] for r in per_rank])
    return point


def headline(family: str, point: Dict[str, Any]) -> Dict[str, Any]:
    """The figures of one point under the names the C++ epx-bench writes."""
    ops = point["ops"]

    def us(k):
        return ops[k]["us"]["mean"] if k in ops else None

    def gbps(k, agg="mean"):
        return ops[k]["gbps"][agg] if k in ops and ops[k]["gbps"] else None

    if family == "v2":
        out: Dict[str, Any] = {}
        for key, _, _ in V2_OPS:
            out[f"{key}_us"], out[f"{key}_gbps"] = us(key), gbps(key)
        return out
    if family == "ht":
        return {
            "dispatch_bf16_gbps": gbps("dispatch_bf16"), "dispatch_fp8_gbps": gbps("dispatch_fp8"),
            "combine_gbps": gbps("combine"), "dispatch_bf16_us": us("dispatch_bf16"),
            "dispatch_fp8_us": us("dispatch_fp8"), "combine_us": us("combine"),
            "dispatch_bf16_uncached_us": us("dispatch_bf16_uncached"),
            "dispatch_bf16_uncached_gbps": gbps("dispatch_bf16_uncached"),
            "min_rank_gbps": {"dispatch_bf16": gbps("dispatch_bf16", "min"),
                              "dispatch_fp8": gbps("dispatch_fp8", "min"),
                              "combine": gbps("combine", "min")},
        }
    return {
        "dispatch_us": us("dispatch_fp8"), "dispatch_gbps": gbps("dispatch_fp8"),
        "dispatch_bf16_us": us("dispatch_bf16"), "dispatch_bf16_gbps": gbps("dispatch_bf16"),
        "combine_us": us("combine"), "combine_gbps": gbps("combine"),
        "combine_logfmt_us": us("combine_logfmt"),
        "dispatch_send_us": us("dispatch_send"), "dispatch_recv_us": us("dispatch_recv"),
        "combine_send_us": us("combine_send"), "combine_recv_us": us("combine_recv"),
        "max_rank_us": {"dispatch": ops["dispatch_fp8"]["us"]["max"] if "dispatch_fp8" in ops
                        else None,
                        "combine": ops["combine"]["us"]["max"] if "combine" in ops else None},
    }


# ---- tables and plots ----------------------------------------------------------------------------

def _fmt(v: Optional[float], width: int, prec: int = 1) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}.{prec}f}"


def format_report(result: Dict[str, Any]) -> str:
    """Readable tables: one per family (headline point), then the sweep if any."""
    w = result["workload"]
    lines = [f"epx.bench on {result['device']}: {result['num_ranks']} ranks, hidden "
             f"{w['hidden']}, top-{w['topk']}, {w['experts']} experts; median of "
             f"{result['iters']} runs per rank (after {result['warmup']}), mean over ranks"]
    if result.get("profiled"):
        lines.append(f"PROFILED ({result['profiled']})")
    has_torch = result.get("compare_torch", False)
    for fam, ops in OPS.items():
        if fam not in result:
            continue
        r = result[fam]
        extra = {"ht": f", {result['num_sms']} SMs",
                 "v2": f", {r.get('num_sms')} SMs (get_theoretical_num_sms)"}.get(fam, "")
        lines.append("")
        lines.append(f"EPX {FAMILY_NAMES[fam]}: {r['tokens']} tokens per rank{extra}")
        head = (f"{'op':<28}{'us':>9}{'us min':>9}{'us max':>9}{'GB/s':>9}{'GB/s min':>9}"
                f"{'GB/s max':>9}{'host us':>9}")
        if has_torch:
            head += f"{'torch us':>10}{'torch GB/s':>11}{'EPX/torch':>10}"
        lines.append(head)
        for key, label, _ in ops:
            s = r["ops"].get(key)
            if s is None:
                continue
            g = s["gbps"] or {}
            line = (f"{label:<28}{_fmt(s['us']['mean'], 9)}{_fmt(s['us']['min'], 9)}"
                    f"{_fmt(s['us']['max'], 9)}{_fmt(g.get('mean'), 9)}{_fmt(g.get('min'), 9)}"
                    f"{_fmt(g.get('max'), 9)}{_fmt((s.get('host_us') or {}).get('mean'), 9)}")
            if has_torch:
                t = r["torch"].get(key)
                ratio = r["epx_over_torch"].get(key)
                line += (f"{_fmt(t['us']['mean'] if t else None, 10)}"
                         f"{_fmt(t['gbps']['mean'] if t and t['gbps'] else None, 11)}"
                         + (f"{ratio:>9.2f}x" if ratio is not None else f"{'-':>10}"))
            lines.append(line)
        if fam in ("ht", "v2") and "num_recv_tokens" in r:
            lines.append(f"tokens received per rank: {r['num_recv_tokens']['mean']:.0f} "
                         f"(min {r['num_recv_tokens']['min']:.0f}, max "
                         f"{r['num_recv_tokens']['max']:.0f})")
    lines.append("")
    lines.append("host us: median time of the Python call itself (until it returns; no sync). "
                 "It includes GPU time only where the op waits on the host (dispatch with a "
                 "new layout).")
    for fam, pts in result.get("sweep", {}).items():
        keys = PLOT_OPS[fam]
        labels = dict((k, lab) for k, lab, _ in (HT_OPS if fam == "ht" else LL_OPS))
        lines.append("")
        lines.append(f"sweep, {FAMILY_NAMES[fam]}: us / GB/s (mean over ranks)"
                     + ("; torch in brackets" if has_torch else ""))
        lines.append(f"{'tokens':>7}" + "".join(f"  {labels[k]:>30}" for k in keys))
        for p in pts:
            cells = []
            for k in keys:
                s = p["ops"].get(k)
                cell = "-" if s is None else f"{s['us']['mean']:.1f} / {s['gbps']['mean']:.1f}"
                t = p["torch"].get(k)
                if t is not None:
                    cell += f" [{t['us']['mean']:.1f} / {t['gbps']['mean']:.1f}]"
                cells.append(f"  {cell:>30}")
            lines.append(f"{p['tokens']:>7}" + "".join(cells))
    return "\n".join(lines)


def plot_sweep(result: Dict[str, Any], path: str) -> None:
    """Draws GB/s and us against tokens per rank for every family of the sweep (EPX solid,
    torch dashed) into ``path`` (PNG). Needs matplotlib."""
    plt = _pyplot()
    sweep = result.get("sweep") or {}
    if not sweep:
        raise ValueError("plot: the result holds no sweep (run with --sweep or --plot)")
    fams = [f for f in ("ht", "ll") if f in sweep]
    fig, axes = plt.subplots(len(fams), 2, figsize=(12, 4.5 * len(fams)), squeeze=False)
    labels = {k: lab for k, lab, _ in HT_OPS + LL_OPS}
    for row, fam in enumerate(fams):
        pts = sweep[fam]
        xs = [p["tokens"] for p in pts]
        ax_bw, ax_us = axes[row]
        for i, key in enumerate(PLOT_OPS[fam]):
            color = f"C{i}"
            for side, style, marker, who in (("ops", "-", "o", "EPX"),
                                             ("torch", "--", "x", "torch")):
                ys_bw = [p[side][key]["gbps"]["mean"] if key in p[side] else None for p in pts]
                ys_us = [p[side][key]["us"]["mean"] if key in p[side] else None for p in pts]
                if all(v is None for v in ys_us):
                    continue
                xb = [x for x, v in zip(xs, ys_bw) if v is not None]
                xu = [x for x, v in zip(xs, ys_us) if v is not None]
                name = f"{who} {labels[key]}"
                ax_bw.plot(xb, [v for v in ys_bw if v is not None], style, color=color,
                           marker=marker, label=name)
                ax_us.plot(xu, [v for v in ys_us if v is not None], style, color=color,
                           marker=marker, label=name)
        title = (f"{FAMILY_NAMES[fam]}, {result['num_ranks']} ranks, hidden "
                 f"{result['workload']['hidden']}, top-{result['workload']['topk']}, "
                 f"{result['workload']['experts']} experts")
        for ax, ylabel in ((ax_bw, "GB/s per rank"), (ax_us, "latency (us)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels([str(x) for x in xs])
            ax.set_xlabel("tokens per rank")
            ax.set_ylabel(ylabel)
            ax.set_title(title, fontsize=9)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        ax_us.set_yscale("log")
    fig.suptitle(f"epx.bench on {result['device']} (commit {result['commit']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("epx.bench: --plot needs matplotlib (pip install matplotlib); "
                         "--sweep --json FILE records the sweep, and --replot FILE --plot "
                         "OUT.png draws it later") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt

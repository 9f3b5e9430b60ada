"""Benchmark of epx.Buffer through its DeepEP API: ``python -m epx.bench``.

Reports the figures of the C++ ``epx-bench`` (bench/ht.cpp, bench/ll.cpp),
measured and counted the same way (DESIGN.md, Metrics):

- one process per GPU (torch.multiprocessing), all work on one side stream;
- every timed run: L2 flushed (a 256 MB fill), ranks lined up by a device
  all-reduce, the call timed with CUDA events; the median of ``--iters``
  (default 50) runs after ``--warmup`` (default 10) untimed ones, per rank;
  the headline is the mean over ranks, min and max are kept in the JSON;
- high-throughput bytes = ``recv_x.numel() * element size`` (FP8 adds its
  scales): dispatch BF16 and FP8 with a cached handle (as the C++ bench and
  DeepEP's tuning loop time them), combine BF16, the uncached dispatch and
  layout + dispatch;
- low-latency bytes per valid (token, top-k) selection: FP8 ``H + H/128*4 +
  16``, BF16 ``2H``; dispatch FP8 and BF16, combine BF16 (and LogFMT), and the
  send / receive split in hook mode (``return_recv_hook=True``: the send call
  is timed, the ranks are lined up again, then the hook is timed).

``--compare-torch`` times the same data movement written with
``torch.distributed.all_to_all_single`` (``TorchAllToAll``), including its
routing work, counted with the same bytes, and prints EPX/torch per op.
``--plot FILE.png`` sweeps the token count and draws bandwidth and latency
against it (needs matplotlib); ``--sweep`` records the sweep without drawing;
``--replot RESULT.json --plot FILE.png`` draws a saved sweep without GPUs.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

if TYPE_CHECKING:  # pragma: no cover
    import torch

HT_SWEEP = (256, 512, 1024, 2048, 4096)
LL_SWEEP = (1, 8, 32, 64, 128)
FLUSH_BYTES = 256 << 20  # > 2x the L2 of H100 / H200 (50 / 60 MB)
HOLD_US = 500  # GPU hold after each line-up (--hold-us), longer than any timed call's host time
TIMING = ("CUDA events around each call on the benchmark stream; per run: L2 flushed (256 MB "
          "fill), ranks lined up by a device all-reduce, then the GPU held (--hold-us) so that "
          "the host has queued the call before the first event: GPU time, as the C++ epx-bench, "
          "with the host time of the call reported apart; median of the timed runs per rank; "
          "headline = mean over ranks (min/max kept); hook split: ranks lined up again (and L2 "
          "flushed) between the send call and the hook")

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
# Ops drawn by --plot (EPX solid, torch dashed).
PLOT_OPS = {"ht": ("dispatch_bf16", "dispatch_fp8", "combine", "dispatch_bf16_full"),
            "ll": ("dispatch_fp8", "dispatch_bf16", "combine")}
FAMILY_NAMES = {"ht": "high-throughput", "ll": "low-latency"}


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
    """Bytes of an op of ``family`` ("ht": count = tokens received; "ll": count = valid
    selections sent) whose payload is ``kind`` ("bf16", "fp8", or None: not counted)."""
    if kind is None:
        return None
    count_fn = ht_bytes if family == "ht" else ll_bytes
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


# ---- the torch.distributed baseline --------------------------------------------------------------

@dataclass
class Route:
    """Where the rows of one dispatch go (``TorchAllToAll.route``).

    ``token[i]`` is the source token of sent row i (rows grouped by destination rank, in
    rank order); ``k[i]`` its top-k slot (per-selection rows only); ``dest[i]`` its rank.
    ``send_splits`` / ``recv_splits`` are the rows sent to / received from each rank.
    """

    token: "torch.Tensor"
    k: Optional["torch.Tensor"]
    dest: "torch.Tensor"
    send_splits: List[int]
    recv_splits: List[int]
    num_tokens: int


def quantize_fp8(x: "torch.Tensor") -> Tuple["torch.Tensor", "torch.Tensor"]:
    """[T, H] -> (float8_e4m3fn [T, H], float32 scales [T, H/128]): per-128-channel
    amax / 448 scales, as the FP8 inputs of the benchmark are made."""
    import torch

    T, H = x.shape
    g = x.float().view(T, H // 128, 128)
    scales = g.abs().amax(-1).clamp(min=1e-4) / 448.0
    q = (g / scales.unsqueeze(-1)).view(T, H).to(torch.float8_e4m3fn)
    return q, scales.contiguous()


class TorchAllToAll:
    """The baseline: MoE dispatch and combine written with
    ``torch.distributed.all_to_all_single`` (works on any backend, gloo included).

    ``per_rank=True`` (high-throughput semantics): one row per (token, destination rank);
    a dispatch given ``topk_idx`` also delivers each row's top-k ids (local to the
    receiver, -1 for experts elsewhere) and, given them, the top-k weights; combine sums
    the returned rows of each token, unweighted.
    ``per_rank=False`` (low-latency semantics): one row per valid (token, top-k) selection,
    grouped by expert; a dispatch given ``topk_idx`` also delivers each row's local expert
    id; combine weights each returned row by its top-k weight and sums.

    Routing work, all of it timed when the benchmark times ``route`` + ``dispatch``: the
    per-destination permutation built from ``topk_idx``, the split-size exchange (an
    all_to_all_single of counts and one host synchronization), the gather of the rows,
    the all_to_all_single of the rows, and one of the per-row metadata (FP8 scales, ids,
    weights packed into one int32 tensor). Combine: the reverse all_to_all_single, then a
    float32 ``index_add_`` into [T, H] and the cast to BF16.
    """

    def __init__(self, group: Any, num_experts: int, per_rank: bool = True) -> None:
        import torch.distributed as dist

        self.group = group
        self.num_ranks = dist.get_world_size(group)
        if num_experts % self.num_ranks:
            raise ValueError(f"num_experts: {num_experts} is not divisible by "
                             f"{self.num_ranks} ranks")
        self.num_experts = num_experts
        self.local_experts = num_experts // self.num_ranks
        self.per_rank = per_rank

    def _a2a(self, t: "torch.Tensor", out_splits: List[int],
             in_splits: List[int]) -> "torch.Tensor":
        import torch
        import torch.distributed as dist

        out = t.new_empty((sum(out_splits),) + tuple(t.shape[1:]))
        src, dst = t, out
        if t.dtype == torch.float8_e4m3fn:  # not every backend takes float8: move the bytes
            src, dst = t.view(torch.uint8), out.view(torch.uint8)
        dist.all_to_all_single(dst, src.contiguous(), out_splits, in_splits, group=self.group)
        return out

    def route(self, topk_idx: "torch.Tensor") -> Route:
        """Builds the permutation of ``topk_idx`` [T, K] (-1 = none) and exchanges the
        split sizes with every rank (collective; one host synchronization)."""
        import torch
        import torch.distributed as dist

        T = topk_idx.shape[0]
        R, El = self.num_ranks, self.local_experts
        valid = topk_idx >= 0
        if self.per_rank:
            dest = torch.where(valid, topk_idx // El, R)  # R = nowhere
            hit = torch.zeros(T, R + 1, dtype=torch.bool, device=topk_idx.device)
            hit.scatter_(1, dest, True)
            pairs = hit[:, :R].t().nonzero()  # (rank, token), rank-major
            rank_of, token, k = pairs[:, 0], pairs[:, 1], None
        else:
            sel = valid.nonzero()  # (token, k)
            expert = topk_idx[sel[:, 0], sel[:, 1]]
            order = torch.argsort(expert, stable=True)
            token, k = sel[order, 0], sel[order, 1]
            rank_of = expert[order] // El
        send = torch.bincount(rank_of, minlength=R)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        counts = torch.cat([send, recv]).tolist()
        return Route(token=token, k=k, dest=rank_of, send_splits=counts[:R],
                     recv_splits=counts[R:], num_tokens=T)

    def dispatch(self, x: Any, route: Route, topk_idx: Optional["torch.Tensor"] = None,
                 topk_weights: Optional["torch.Tensor"] = None):
        """Moves the rows of ``x`` ([T, H], or (float8 [T, H], scales [T, H/128])).

        Returns (recv_x or (recv_q, recv_scales), recv_ids, recv_weights): recv_ids is
        [N, K] int64 top-k ids local to this rank (per-rank rows) or [N] int64 local expert
        ids (per-selection rows), None without ``topk_idx``; recv_weights [N, K] float32
        (per-rank rows with ``topk_weights``) or None.
        """
        import torch

        x, scales = x if isinstance(x, tuple) else (x, None)
        token = route.token
        side: List["torch.Tensor"] = []
        widths: List[int] = []
        if scales is not None:
            side.append(scales.index_select(0, token).view(torch.int32))
            widths.append(scales.shape[1])
        if topk_idx is not None:
            El = self.local_experts
            if self.per_rank:
                local = topk_idx.index_select(0, token) - (route.dest * El).unsqueeze(1)
                local = torch.where((local >= 0) & (local < El), local, -1).to(torch.int32)
                side.append(local)
                widths.append(local.shape[1])
                if topk_weights is not None:
                    # As DeepEP (and EPX): 0 where the pick's expert is elsewhere.
                    w = topk_weights.index_select(0, token).float()
                    side.append(torch.where(local >= 0, w, torch.zeros_like(w)).view(torch.int32))
                    widths.append(topk_weights.shape[1])
            else:
                local = (topk_idx[token, route.k] - route.dest * El).to(torch.int32)
                side.append(local.unsqueeze(1))
                widths.append(1)
        rows = x.index_select(0, token)
        recv_rows = self._a2a(rows, route.recv_splits, route.send_splits)
        recv_side = None
        if side:
            packed = side[0] if len(side) == 1 else torch.cat(side, 1)
            recv_side = self._a2a(packed, route.recv_splits, route.send_splits)
        parts = list(torch.split(recv_side, widths, 1)) if recv_side is not None else []
        recv_scales = parts.pop(0).view(torch.float32) if scales is not None else None
        ids = weights = None
        if topk_idx is not None:
            ids = parts.pop(0).to(torch.int64)
            if not self.per_rank:
                ids = ids.squeeze(1)
            elif topk_weights is not None:
                weights = parts.pop(0).contiguous().view(torch.float32)
        recv_x = (recv_rows, recv_scales) if scales is not None else recv_rows
        return recv_x, ids, weights

    def combine(self, y: "torch.Tensor", route: Route,
                topk_weights: Optional["torch.Tensor"] = None) -> "torch.Tensor":
        """Returns the rows ``y`` [N, H] (in this rank's receive order) to their source
        ranks and sums them per token: [T, H] in y's dtype. Per-selection rows are weighted
        by ``topk_weights`` [T, K] (required there; not accepted for per-rank rows)."""
        import torch

        if self.per_rank and topk_weights is not None:
            raise ValueError("topk_weights: per-rank rows are combined unweighted")
        if not self.per_rank and topk_weights is None:
            raise ValueError("topk_weights: per-selection rows need the top-k weights")
        back = self._a2a(y, route.send_splits, route.recv_splits)
        acc = back.float()
        if topk_weights is not None:
            acc = acc * topk_weights[route.token, route.k].float().unsqueeze(1)
        out = torch.zeros(route.num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
        out.index_add_(0, route.token, acc)
        return out.to(y.dtype)


# ---- timing (inside the ranks) -------------------------------------------------------------------

class Timer:
    """CUDA-event timing of one call per run, as the C++ bench's time_us / split_us."""

    def __init__(self, group: Any, device: "torch.device", warmup: int, iters: int,
                 flush_bytes: int = FLUSH_BYTES, hold_us: int = HOLD_US) -> None:
        import torch

        self.group, self.warmup, self.iters = group, warmup, iters
        # About 2 cycles per ns (H100/H200 clocks); torch.cuda._sleep spins that many.
        self.hold_cycles = 2000 * hold_us if hasattr(torch.cuda, "_sleep") else 0
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8, device=device)
        self.sync = torch.zeros(1, dtype=torch.int32, device=device)
        self.runs = 0
        self.last_host_us: Optional[float] = None  # host time of the last time_us's calls

    def _line_up(self, flush: bool = True) -> None:
        import torch.distributed as dist

        if flush:
            self.flush.fill_(self.runs & 0xFF)
            self.runs += 1
        dist.all_reduce(self.sync, group=self.group)  # the current stream waits for it
        if self.hold_cycles > 0:
            # Every rank's GPU waits the same time after the line-up, while its host queues
            # the timed call: the events then time the GPU's work, not the host's (a rank
            # whose host is late would otherwise hold up every rank's LL kernels).
            import torch

            torch.cuda._sleep(self.hold_cycles)

    def time_us(self, fn: Callable[[], Any]) -> float:
        """Median microseconds of ``fn`` over the timed runs (GPU time between two events;
        with ``hold_us`` 0 the GPU idles while the host prepares the call, so host time
        shows in it). The median host time of the call itself (return to Python, no
        synchronization) is left in ``last_host_us``."""
        import torch

        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        samples, host = [], []
        for i in range(self.warmup + self.iters):
            self._line_up()
            a.record()
            t0 = time.perf_counter()
            keep = fn()
            t1 = time.perf_counter()
            b.record()
            b.synchronize()
            del keep
            if i >= self.warmup:
                samples.append(a.elapsed_time(b) * 1e3)
                host.append((t1 - t0) * 1e6)
        self.last_host_us = median(host)
        return median(samples)

    def measure(self, fn: Callable[[], Any], nbytes: Optional[int]) -> Dict[str, Any]:
        """{"us", "host_us", "bytes"} of ``fn`` (see time_us)."""
        us = self.time_us(fn)
        return {"us": us, "host_us": self.last_host_us, "bytes": nbytes}

    def split_us(self, send: Callable[[], Tuple]) -> Tuple[float, float]:
        """Hook mode: median microseconds of ``send()`` (which returns a tuple whose last
        entry is the receive hook) and of the hook, the ranks lined up between them."""
        import torch

        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ts, tr = [], []
        for i in range(self.warmup + self.iters):
            self._line_up()
            ev[0].record()
            out = send()
            ev[1].record()
            self._line_up()
            ev[2].record()
            out[-1]()
            ev[3].record()
            ev[3].synchronize()
            del out
            if i >= self.warmup:
                ts.append(ev[0].elapsed_time(ev[1]) * 1e3)
                tr.append(ev[2].elapsed_time(ev[3]) * 1e3)
        return median(ts), median(tr)


def _routing(T: int, K: int, E: int, seed: int, device) -> "torch.Tensor":
    """[T, K] int64: K distinct experts per token, uniformly at random (seeded)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(device)


def _tokens(T: int, H: int, seed: int, device) -> "torch.Tensor":
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g).to(device=device, dtype=torch.bfloat16)


def _measure_ht(buf, timer: Timer, group, args, T: int, rank: int, dev) -> Dict[str, Any]:
    import torch

    H, K, E = args.hidden, args.topk, args.experts
    x = _tokens(T, H, 2000 + rank, dev)
    xq = quantize_fp8(x)
    idx = _routing(T, K, E, 1000 + rank, dev)
    w = torch.full((T, K), 1.0 / K, dtype=torch.float32, device=dev)
    layout = buf.get_dispatch_layout(idx, E)
    lay = dict(num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
               num_tokens_per_expert=layout[2])
    recv, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **lay)
    N = recv.shape[0]
    y = recv.clone()  # expert outputs for the combine: the received rows

    def full(x_in):
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        return buf.dispatch(x_in, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
                            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

    fns = {
        "dispatch_bf16": lambda: buf.dispatch(x, handle=handle),
        "dispatch_fp8": lambda: buf.dispatch(xq, handle=handle),
        "combine": lambda: buf.combine(y, handle),
        "dispatch_bf16_uncached": lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, **lay),
        "dispatch_bf16_full": lambda: full(x),
        "layout": lambda: buf.get_dispatch_layout(idx, E),
    }
    point: Dict[str, Any] = {"tokens": T, "num_recv_tokens": N, "ops": {}, "torch": {}}
    for key, _, kind in HT_OPS:
        point["ops"][key] = timer.measure(fns[key], op_bytes("ht", kind, N, H))

    if args.compare_torch:
        tb = TorchAllToAll(group, E, per_rank=True)
        r0 = tb.route(idx)
        n_torch = sum(r0.recv_splits)
        if n_torch != N:
            raise RuntimeError(f"torch baseline receives {n_torch} rows, EPX {N}: the two "
                               f"do not move the same data")
        ty = tb.dispatch(x, r0)[0].clone()

        def t_full(x_in):
            r = tb.route(idx)
            return tb.dispatch(x_in, r, idx, w)

        tfns = {
            "dispatch_bf16": (lambda: tb.dispatch(x, r0), "bf16"),
            "dispatch_fp8": (lambda: tb.dispatch(xq, r0), "fp8"),
            "combine": (lambda: tb.combine(ty, r0), "bf16"),
            "dispatch_bf16_full": (lambda: t_full(x), "bf16"),
        }
        for key, (fn, kind) in tfns.items():
            point["torch"][key] = timer.measure(fn, op_bytes("ht", kind, N, H))
    return point


def _measure_ll(buf, timer: Timer, group, args, T: int, rank: int, dev) -> Dict[str, Any]:
    import torch

    H, K, E = args.hidden, args.topk, args.experts
    maxT = T
    x = _tokens(T, H, 2000 + rank, dev)
    idx = _routing(T, K, E, 1000 + rank, dev)
    w = (0.5 + 0.5 * (torch.arange(T * K, device=dev) % 7).float() / 7.0).view(T, K)
    sel = int((idx >= 0).sum())
    buf.clean_low_latency_buffer(maxT, H, E)  # the layout of the buffer follows maxT

    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, maxT, E, use_fp8=False)
    fns = {
        "dispatch_fp8": lambda: buf.low_latency_dispatch(x, idx, maxT, E, use_fp8=True),
        "dispatch_bf16": lambda: buf.low_latency_dispatch(x, idx, maxT, E, use_fp8=False),
        "combine": lambda: buf.low_latency_combine(recv, idx, w, handle),
        "combine_logfmt": lambda: buf.low_latency_combine(recv, idx, w, handle, use_logfmt=True),
    }
    point: Dict[str, Any] = {"tokens": T, "num_selections": sel, "ops": {}, "torch": {}}
    for key, _, kind in LL_OPS:
        if key in fns:
            point["ops"][key] = timer.measure(fns[key], op_bytes("ll", kind, sel, H))
    ds, dr = timer.split_us(lambda: buf.low_latency_dispatch(x, idx, maxT, E, use_fp8=True,
                                                             return_recv_hook=True))
    cs, cr = timer.split_us(lambda: buf.low_latency_combine(recv, idx, w, handle,
                                                            return_recv_hook=True))
    for key, us in (("dispatch_send", ds), ("dispatch_recv", dr), ("combine_send", cs),
                    ("combine_recv", cr)):
        point["ops"][key] = {"us": us, "bytes": None}

    if args.compare_torch:
        tb = TorchAllToAll(group, E, per_rank=False)
        r0 = tb.route(idx)
        ty = tb.dispatch(x, r0)[0].clone()

        def t_dispatch(fp8):
            r = tb.route(idx)
            return tb.dispatch(quantize_fp8(x) if fp8 else x, r, idx)

        tfns = {
            "dispatch_fp8": (lambda: t_dispatch(True), "fp8"),
            "dispatch_bf16": (lambda: t_dispatch(False), "bf16"),
            "combine": (lambda: tb.combine(ty, r0, w), "bf16"),
        }
        for key, (fn, kind) in tfns.items():
            point["torch"][key] = timer.measure(fn, op_bytes("ll", kind, sel, H))
    return point


def _points(args: argparse.Namespace) -> Dict[str, List[int]]:
    """Token counts measured per family: the headline count, plus the sweep if asked."""
    out: Dict[str, List[int]] = {}
    for fam in families(args.mode):
        main_tokens = args.tokens if fam == "ht" else args.ll_tokens
        pts = {main_tokens}
        if args.sweep:
            pts |= set(args.sweep_tokens if fam == "ht" else args.sweep_ll_tokens)
        out[fam] = sorted(pts)
    return out


def families(mode: str) -> Tuple[str, ...]:
    return ("ht", "ll") if mode == "all" else (mode,)


_TEARDOWN_TIMEOUT_S = 120  # seconds from the final barrier to process exit


def _run(rank: int, world: int, init: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world,
                            device_id=dev)
    try:
        prof_path = os.environ.get("EPX_BENCH_PROFILE", "")
        if prof_path and rank == 0:  # host-side profile of rank 0 (cProfile, by own time)
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            try:
                prof.runcall(_bench_rank, rank, world, dev, args)
            finally:
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(40)
                with open(prof_path, "w") as f:
                    f.write(out.getvalue())
        else:
            _bench_rank(rank, world, dev, args)
    except BaseException:
        # The peers may be inside a collective, so a collective teardown here
        # (Buffer.destroy, destroy_process_group) would hang them and us: exit
        # now; torch.multiprocessing then stops the other ranks and reports it.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    dist.barrier()  # rank 0 writes the report and plot; leave together
    # Twice on 4x H200 a run wrote its results and then did not exit (cause
    # not found yet). If teardown takes minutes, print every thread's stack
    # (the diagnostic) and exit instead of hanging.
    faulthandler.dump_traceback_later(_TEARDOWN_TIMEOUT_S, exit=True)
    dist.destroy_process_group()


def _bench_rank(rank: int, world: int, dev, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import epx

    group = dist.group.WORLD
    H, K, E = args.hidden, args.topk, args.experts
    if args.sms:
        epx.Buffer.set_num_sms(args.sms)
    points = _points(args)
    nvl = rdma = 0
    if "ht" in points:
        nvl = max(c.get_nvl_buffer_size_hint(H * 2, world, K)
                  for c in (epx.Buffer.get_dispatch_config(world),
                            epx.Buffer.get_combine_config(world)))
    if "ll" in points:
        rdma = epx.Buffer.get_low_latency_rdma_size_hint(max(points["ll"]), H, world, E)
    stream = torch.cuda.Stream(dev)
    measured: Dict[str, List[Dict[str, Any]]] = {}
    with torch.cuda.stream(stream):
        buf = epx.Buffer(group, nvl, rdma, low_latency_mode="ll" in points,
                         num_qps_per_rank=max(1, E // world), explicitly_destroy=True)
        timer = Timer(group, dev, args.warmup, args.iters, hold_us=args.hold_us)
        for fam, tokens in points.items():
            measure = _measure_ht if fam == "ht" else _measure_ll
            measured[fam] = []
            for T in tokens:
                measured[fam].append(measure(buf, timer, group, args, T, rank, dev))
                if rank == 0 and len(tokens) > 1:
                    print(f"epx.bench: {fam} {T} tokens done", file=sys.stderr, flush=True)
        torch.cuda.synchronize()
        # Collective: only on the path every rank takes (an error exits instead, see _run).
        buf.destroy()
    del buf, timer  # EPX's communicator goes here, at the same point on every rank
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, measured, group)
    if rank == 0:
        result = build_result(args, world, gathered, device=_device_name(dev))
        print(format_report(result), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
                f.write("\n")
            print(f"wrote {args.json}")
        if args.plot:
            plot_sweep(result, args.plot)
            print(f"wrote {args.plot}")


def _device_name(dev) -> str:
    import torch

    return f"{torch.cuda.get_device_name(dev)} x{torch.cuda.device_count()}"


def _commit() -> str:
    if os.environ.get("EPX_COMMIT"):
        return os.environ["EPX_COMMIT"]
    for path in (".device/COMMIT",):
        if os.path.exists(path):
            with open(path) as f:
                return f.read().strip() or "unknown"
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        if out.returncode == 0:
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


# ---- results -------------------------------------------------------------------------------------

def build_result(args: argparse.Namespace, world: int,
                 ranks: Sequence[Dict[str, List[Dict[str, Any]]]],
                 device: str = "unknown") -> Dict[str, Any]:
    """The JSON document from every rank's measurements (``ranks[r][family][i]`` is rank r's
    i-th point of ``family``: {"tokens", "ops": {key: {"us", "bytes"}}, "torch": {...}})."""
    import epx

    result: Dict[str, Any] = {
        "tool": "python -m epx.bench",
        "device": device,
        "commit": _commit(),
        "command": getattr(args, "command", ""),
        "num_ranks": world,
        "num_sms": args.sms or epx.Buffer.num_sms,
        "workload": {"tokens": args.tokens, "ll_tokens": args.ll_tokens, "hidden": args.hidden,
                     "topk": args.topk, "experts": args.experts,
                     "routing": "uniform random distinct experts, seeded per rank"},
        "warmup": args.warmup, "iters": args.iters, "hold_us": args.hold_us,
        "timing": TIMING,
        "compare_torch": bool(args.compare_torch),
        "sweep": {},
    }
    if os.environ.get("EPX_BENCH_PROFILE"):
        # rank 0 ran under cProfile and every rank waited for it at each line-up
        result["profiled"] = "rank 0 under cProfile: times are not comparable"
    for fam in ranks[0]:
        pts = [summarize_point([r[fam][i] for r in ranks]) for i in range(len(ranks[0][fam]))]
        main_tokens = args.tokens if fam == "ht" else args.ll_tokens
        main = next(p for p in pts if p["tokens"] == main_tokens)
        fam_result: Dict[str, Any] = {"family": fam, "tokens": main_tokens}
        if fam == "ht":
            fam_result["num_sms"] = result["num_sms"]
        else:
            fam_result["num_max_dispatch_tokens_per_rank"] = main_tokens
            fam_result["num_valid_selections"] = main["num_selections"]["mean"]
        fam_result.update(headline(fam, main))
        fam_result.update(main)
        result[fam] = fam_result
        if len(pts) > 1 or args.sweep:
            result["sweep"][fam] = pts
    return result


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
    for fam, ops in (("ht", HT_OPS), ("ll", LL_OPS)):
        if fam not in result:
            continue
        r = result[fam]
        extra = f", {result['num_sms']} SMs" if fam == "ht" else ""
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
        if fam == "ht" and "num_recv_tokens" in r:
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


# ---- command line --------------------------------------------------------------------------------

def _token_list(text: str) -> List[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}")
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive token counts, got {text!r}")
    return vals


def _int_at_least(low: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low`` (``what`` names the rule in the error)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
        if v < low:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {v}")
        return v
    return parse


_positive = _int_at_least(1, "positive")
_non_negative = _int_at_least(0, "non-negative")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parses and checks the command line (SystemExit with a message on errors)."""
    p = argparse.ArgumentParser(prog="python -m epx.bench", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=0, help="processes, one per GPU (default: all)")
    p.add_argument("--mode", choices=("ht", "ll", "all"), default="all")
    p.add_argument("--tokens", type=_positive, default=4096,
                   help="tokens per rank, high-throughput (default 4096)")
    p.add_argument("--ll-tokens", type=_positive, default=128,
                   help="tokens per rank = num_max_dispatch_tokens_per_rank, low-latency "
                        "(default 128)")
    p.add_argument("--hidden", type=_positive, default=7168)
    p.add_argument("--topk", type=_positive, default=8)
    p.add_argument("--experts", type=_positive, default=256)
    p.add_argument("--sms", type=int, default=0,
                   help="SMs of the high-throughput kernels (Buffer.set_num_sms; even; "
                        "default: EPX's)")
    p.add_argument("--warmup", type=int, default=10, help="untimed runs per op (default 10)")
    p.add_argument("--iters", type=_positive, default=50,
                   help="timed runs per op, median reported (default 50)")
    p.add_argument("--hold-us", type=_non_negative, default=HOLD_US,
                   help="microseconds the GPU waits after each line-up, so the events time "
                        f"the GPU's work and not the host's (default {HOLD_US}; 0: eager, "
                        "host time included where it exceeds the flush)")
    p.add_argument("--compare-torch", action="store_true",
                   help="also time torch.distributed.all_to_all_single moving the same data")
    p.add_argument("--sweep", action="store_true", help="also measure the token sweeps")
    p.add_argument("--sweep-tokens", type=_token_list, default=None, metavar="N,N,...",
                   help="high-throughput sweep (implies --sweep; default "
                        f"{','.join(map(str, HT_SWEEP))})")
    p.add_argument("--sweep-ll-tokens", type=_token_list, default=None, metavar="N,N,...",
                   help="low-latency sweep (implies --sweep; default "
                        f"{','.join(map(str, LL_SWEEP))})")
    p.add_argument("--plot", default="", metavar="FILE.png",
                   help="draw GB/s and us against tokens (implies --sweep; needs matplotlib)")
    p.add_argument("--replot", default="", metavar="RESULT.json",
                   help="with --plot: draw the sweep saved in RESULT.json; no GPU needed")
    p.add_argument("--json", default="", help="write the results to this file")
    args = p.parse_args(argv)
    if args.sweep_tokens is not None or args.sweep_ll_tokens is not None or args.plot:
        args.sweep = True
    if args.sweep_tokens is None:
        args.sweep_tokens = list(HT_SWEEP)
    if args.sweep_ll_tokens is None:
        args.sweep_ll_tokens = list(LL_SWEEP)
    if args.replot and not args.plot:
        p.error("--replot needs --plot FILE.png")
    if args.warmup < 0:
        p.error(f"--warmup: expected >= 0, got {args.warmup}")
    if args.sms < 0 or args.sms % 2:
        p.error(f"--sms: expected an even number of SMs, got {args.sms}")
    if args.hidden % 128:
        p.error(f"--hidden: must be a multiple of 128 (FP8 scales), got {args.hidden}")
    if args.topk > args.experts:
        p.error(f"--topk: {args.topk} is more than --experts {args.experts}")
    args.command = " ".join(["python -m epx.bench"] + list(argv if argv is not None
                                                          else sys.argv[1:]))
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.plot:
        _pyplot()  # fail now, not after the measurements
    if args.replot:
        with open(args.replot) as f:
            plot_sweep(json.load(f), args.plot)
        print(f"wrote {args.plot}")
        return 0

    import torch
    import torch.multiprocessing as mp

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = args.ranks or found
    if found == 0:
        print("epx.bench: no CUDA GPU found", file=sys.stderr)
        return 1
    if world < 1 or world > found:
        print(f"epx.bench: --ranks {world}: need 1 to {found} (the GPUs found)",
              file=sys.stderr)
        return 1
    if args.experts % world:
        print(f"epx.bench: --experts {args.experts} is not divisible by {world} ranks",
              file=sys.stderr)
        return 1
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
        os.environ.setdefault(k, v)
    # file:// rendezvous in a fresh directory: no TCP port to collide with
    init = "file://" + os.path.join(tempfile.mkdtemp(prefix="epx-bench-"), "store")
    mp.spawn(_run, args=(world, init, args), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

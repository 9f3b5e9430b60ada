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

- ``--mode v2``: DeepEP V2's API (``deep_ep.ElasticBuffer``: dispatch BF16 and
  FP8, non-expanded, with CPU sync, and combine BF16) at the SM count its
  ``get_theoretical_num_sms`` picks, beside V1's (``epx.Buffer``: layout +
  dispatch, combine) on the same tokens in the same run, bytes counted as
  high-throughput ones. EPX's ``get_theoretical_num_sms`` is V1's default SM
  count, so both run on the same SMs.

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

from .bench_report import (FAMILY_NAMES, HT_OPS, LL_OPS, PLOT_OPS, V2_OPS, _pyplot,  # noqa: F401
                           format_report,
                           headline, ht_bytes, ll_bytes, median, op_bytes, plot_sweep, spread,
                           summarize_op, summarize_point)
from .torch_baseline import Route, TorchAllToAll, quantize_fp8  # noqa: F401


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


def _ht_inputs(args, T: int, rank: int, dev):
    """A rank's high-throughput inputs: x BF16, x as (FP8, scales), routing, equal weights."""
    import torch

    x = _tokens(T, args.hidden, 2000 + rank, dev)
    idx = _routing(T, args.topk, args.experts, 1000 + rank, dev)
    w = torch.full((T, args.topk), 1.0 / args.topk, dtype=torch.float32, device=dev)
    return x, quantize_fp8(x), idx, w


def _layout_and_dispatch(buf, x_in, idx, w, E: int):
    """V1's whole call: the layout, then the dispatch with it."""
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    return buf.dispatch(x_in, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
                        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)


def _measure_ht(buf, timer: Timer, group, args, T: int, rank: int, dev) -> Dict[str, Any]:
    H, E = args.hidden, args.experts
    x, xq, idx, w = _ht_inputs(args, T, rank, dev)
    layout = buf.get_dispatch_layout(idx, E)
    lay = dict(num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
               num_tokens_per_expert=layout[2])
    recv, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **lay)
    N = recv.shape[0]
    y = recv.clone()  # expert outputs for the combine: the received rows

    def full(x_in):
        return _layout_and_dispatch(buf, x_in, idx, w, E)

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


def _measure_v2(buf, ebuf, timer: Timer, group, args, T: int, rank: int,
                dev) -> Dict[str, Any]:
    """V2's dispatch and combine (``ebuf``, a deep_ep.ElasticBuffer) at its theoretical SM
    count, and V1's (``buf``) on the same rows."""
    H, K, E = args.hidden, args.topk, args.experts
    x, xq, idx, w = _ht_inputs(args, T, rank, dev)
    num_sms = ebuf.get_theoretical_num_sms(E, K)

    def v2(x_in):
        return ebuf.dispatch(x_in, topk_idx=idx, topk_weights=w, num_experts=E, num_sms=num_sms)

    recv, _, _, h, _ = v2(x)
    N = recv.shape[0]
    y = recv.clone()

    def v1(x_in):
        return _layout_and_dispatch(buf, x_in, idx, w, E)

    recv1, _, _, _, handle1, _ = v1(x)
    if recv1.shape[0] != N:
        raise RuntimeError(f"V1 receives {recv1.shape[0]} rows, V2 {N}: the two APIs do not "
                           f"move the same data")
    y1 = recv1.clone()
    fns = {
        "v2_dispatch_bf16": lambda: v2(x),
        "v2_dispatch_fp8": lambda: v2(xq),
        "v2_combine": lambda: ebuf.combine(y, h, num_sms=num_sms),
        "v1_dispatch_bf16": lambda: v1(x),
        "v1_combine": lambda: buf.combine(y1, handle1),
    }
    point: Dict[str, Any] = {"tokens": T, "num_recv_tokens": N, "num_sms": num_sms, "ops": {},
                             "torch": {}}
    for key, _, kind in V2_OPS:
        point["ops"][key] = timer.measure(fns[key], op_bytes("v2", kind, N, H))
    return point


def _points(args: argparse.Namespace) -> Dict[str, List[int]]:
    """Token counts measured per family: the headline count, plus the sweep if asked (not
    for v2, measured at the headline count only)."""
    out: Dict[str, List[int]] = {}
    for fam in families(args.mode):
        main_tokens = args.ll_tokens if fam == "ll" else args.tokens
        pts = {main_tokens}
        if args.sweep and fam != "v2":
            pts |= set(args.sweep_tokens if fam == "ht" else args.sweep_ll_tokens)
        out[fam] = sorted(pts)
    return out


def families(mode: str) -> Tuple[str, ...]:
    """"all" is the high-throughput and low-latency families; "v2" runs alone."""
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
    if "ht" in points or "v2" in points:
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
        ebuf = None
        if "v2" in points:
            import deep_ep

            # Beside the V1 buffer, as a V2 caller's process may hold both.
            ebuf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=max(points["v2"]),
                                         hidden=H, num_topk=K, explicitly_destroy=True)
        timer = Timer(group, dev, args.warmup, args.iters, hold_us=args.hold_us)
        for fam, tokens in points.items():
            measured[fam] = []
            for T in tokens:
                if fam == "v2":
                    measured[fam].append(_measure_v2(buf, ebuf, timer, group, args, T, rank, dev))
                    continue
                measure = _measure_ht if fam == "ht" else _measure_ll
                measured[fam].append(measure(buf, timer, group, args, T, rank, dev))
                if rank == 0 and len(tokens) > 1:
                    print(f"epx.bench: {fam} {T} tokens done", file=sys.stderr, flush=True)
        torch.cuda.synchronize()
        # Collective: only on the path every rank takes (an error exits instead, see _run).
        if ebuf is not None:
            ebuf.destroy()
        buf.destroy()
    del buf, ebuf, timer  # EPX's communicator goes here, at the same point on every rank
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
        main_tokens = args.ll_tokens if fam == "ll" else args.tokens
        main = next(p for p in pts if p["tokens"] == main_tokens)
        fam_result: Dict[str, Any] = {"family": fam, "tokens": main_tokens}
        if fam == "ht":
            fam_result["num_sms"] = result["num_sms"]
        elif fam == "v2":  # get_theoretical_num_sms's, the same on every rank
            fam_result["num_sms"] = ranks[0][fam][0]["num_sms"]
        else:
            fam_result["num_max_dispatch_tokens_per_rank"] = main_tokens
            fam_result["num_valid_selections"] = main["num_selections"]["mean"]
        fam_result.update(headline(fam, main))
        fam_result.update(main)
        result[fam] = fam_result
        if fam != "v2" and (len(pts) > 1 or args.sweep):
            result["sweep"][fam] = pts
    return result


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
    p.add_argument("--mode", choices=("ht", "ll", "all", "v2"), default="all",
                   help="all: ht and ll; v2: DeepEP V2's API beside V1's (--tokens)")
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

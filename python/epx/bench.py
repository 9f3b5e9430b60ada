"""Benchmark of epx.Buffer through its DeepEP API: ``python -m epx.bench``.

Starts one process per GPU (torch.multiprocessing) and times the
high-throughput layout/dispatch/combine and the low-latency dispatch/combine
on random routing. Prints per-op time and bandwidth (min / mean / max over
ranks); ``--json`` also writes them to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

if TYPE_CHECKING:  # pragma: no cover
    import torch


def _time(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Mean seconds per call of `fn`, measured on the host between barriers."""
    import time

    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def _routing(T: int, K: int, E: int, device) -> "torch.Tensor":
    import torch

    scores = torch.rand(T, E, device=device)
    return scores.topk(K, dim=1).indices.to(torch.int64)


def _run(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import epx

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=dev)
    group = dist.group.WORLD
    torch.manual_seed(1 + rank)
    T, H, K, E = args.tokens, args.hidden, args.topk, args.experts
    results: List[Dict] = []

    modes = ("ht", "ll") if args.mode == "all" else (args.mode,)
    nvl = rdma = 0
    if "ht" in modes:
        nvl = max(c.get_nvl_buffer_size_hint(H * 2, world, K)
                  for c in (epx.Buffer.get_dispatch_config(world),
                            epx.Buffer.get_combine_config(world)))
    if "ll" in modes:
        rdma = epx.Buffer.get_low_latency_rdma_size_hint(args.ll_tokens, H, world, E)
    buf = epx.Buffer(group, nvl, rdma, low_latency_mode="ll" in modes,
                     num_qps_per_rank=max(1, E // world), explicitly_destroy=True)

    def record(op: str, seconds: float, nbytes: int) -> None:
        results.append({"op": op, "us": seconds * 1e6, "GBps": nbytes / seconds / 1e9})

    if "ht" in modes:
        x = torch.randn(T, H, device=dev).to(torch.bfloat16)
        if args.fp8:
            amax = x.float().view(T, H // 128, 128).abs().amax(-1).clamp(min=1e-4)
            scales = amax / 448.0
            q = (x.float().view(T, H // 128, 128) / scales[..., None]).view(T, H)
            x_in = (q.to(torch.float8_e4m3fn), scales.contiguous())
        else:
            x_in = x
        idx = _routing(T, K, E, dev)
        w = torch.rand(T, K, device=dev)
        layout = buf.get_dispatch_layout(idx, E)
        kw = dict(num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                  num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w)
        recv, _, _, _, handle, _ = buf.dispatch(x_in, **kw)
        recv_x = recv[0] if args.fp8 else recv
        n_recv = recv_x.shape[0]
        elem = 1 if args.fp8 else 2
        record("layout", _time(lambda: buf.get_dispatch_layout(idx, E), args.warmup, args.iters),
               idx.numel() * 8)
        record("dispatch", _time(lambda: buf.dispatch(x_in, **kw), args.warmup, args.iters),
               n_recv * H * elem)
        record("dispatch (cached)",
               _time(lambda: buf.dispatch(x_in, handle=handle), args.warmup, args.iters),
               n_recv * H * elem)
        y = torch.randn(n_recv, H, device=dev).to(torch.bfloat16)
        record("combine", _time(lambda: buf.combine(y, handle), args.warmup, args.iters),
               n_recv * H * 2)

    if "ll" in modes:
        Tl = args.ll_tokens
        x = torch.randn(Tl, H, device=dev).to(torch.bfloat16)
        idx = _routing(Tl, K, E, dev)
        w = torch.rand(Tl, K, device=dev)
        buf.clean_low_latency_buffer(Tl, H, E)
        # bytes on the wire: one row per (token, destination expert)
        pairs = int((idx >= 0).sum())
        for fp8 in (False, True):
            name = "ll_dispatch" + (" fp8" if fp8 else "")
            record(name, _time(lambda: buf.low_latency_dispatch(x, idx, Tl, E, use_fp8=fp8),
                               args.warmup, args.iters),
                   pairs * (H + H // 128 * 4 if fp8 else H * 2))
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, Tl, E, use_fp8=False)
        record("ll_combine", _time(lambda: buf.low_latency_combine(recv, idx, w, handle),
                                   args.warmup, args.iters), pairs * H * 2)

    torch.cuda.synchronize()
    gathered = [None] * world
    dist.all_gather_object(gathered, results, group)
    buf.destroy()
    dist.destroy_process_group()
    if rank == 0:
        _print(args, world, gathered)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "world": world, "ranks": gathered}, f, indent=2)


def _print(args: argparse.Namespace, world: int, ranks: List[List[Dict]]) -> None:
    print(f"epx.bench: {world} ranks, tokens={args.tokens} (ll {args.ll_tokens}), "
          f"hidden={args.hidden}, topk={args.topk}, experts={args.experts}, "
          f"fp8={args.fp8}, iters={args.iters}")
    print(f"{'op':<20}{'us min':>10}{'us mean':>10}{'us max':>10}{'GB/s mean':>12}")
    for i, row in enumerate(ranks[0]):
        us = [r[i]["us"] for r in ranks]
        gbps = sum(r[i]["GBps"] for r in ranks) / world
        print(f"{row['op']:<20}{min(us):>10.1f}{sum(us) / world:>10.1f}{max(us):>10.1f}"
              f"{gbps:>12.1f}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m epx.bench", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=0, help="processes (default: all GPUs)")
    p.add_argument("--mode", choices=("ht", "ll", "all"), default="all")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank (high-throughput)")
    p.add_argument("--ll-tokens", type=int, default=128, help="tokens per rank (low-latency)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--fp8", action="store_true", help="FP8 payload in the high-throughput dispatch")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default="", help="also write the results to this file")
    args = p.parse_args(argv)

    import torch
    import torch.multiprocessing as mp

    world = args.ranks or torch.cuda.device_count()
    if world < 1 or world > torch.cuda.device_count():
        print(f"epx.bench: need {world} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 1
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
        os.environ.setdefault(k, v)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_run, args=(world, port, args), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

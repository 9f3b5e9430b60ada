import epx as deep_ep  # the only line that differs from the same program written for DeepEP

# An expert-parallel Mixture-of-Experts layer written against DeepEP's Python API
# (deep_ep.Buffer), the way DeepEP's README and tests use it:
#
#   prefill / training (high-throughput kernels):
#     get_dispatch_layout -> dispatch -> one GEMM per local expert over the received
#     tokens, grouped by recv_topk_idx with num_recv_tokens_per_expert_list -> combine
#   decode (low-latency kernels):
#     low_latency_dispatch -> batched GEMM over [E_local, R*maxT, H] masked by
#     recv_count -> low_latency_combine
#
# Expert e is silu(x @ w1[e]) @ w2[e] in BF16; the weights come from a seeded
# generator (moe_reference.expert_weights), so every rank and the single-process
# reference (moe_reference.moe_forward) agree on them.
#
# Run on every GPU of a node (checks each rank's output against the reference):
#   torchrun --nproc-per-node 4 examples/moe_layer.py
# or call run_example(group, ...) from a program that has set up torch.distributed.
# The layer uses only deep_ep's API; the check of an FP8 run (moe_reference.py)
# quantizes with EPX's reference model, so that check needs epx installed even
# when the layer runs on DeepEP.

import argparse
import os
import sys
from typing import Dict, List, Optional, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_reference  # noqa: E402  (NumPy only: weights and the dense reference)

Recv = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def expert_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert: [n, H] -> [n, H] (BF16 GEMMs)."""
    return F.silu(x @ w1) @ w2


def grouped_experts(recv_x: torch.Tensor, recv_topk_idx: torch.Tensor,
                    recv_topk_weights: torch.Tensor, num_recv_tokens_per_expert_list: List[int],
                    w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The local experts over the tokens a high-throughput dispatch delivered.

    recv_x [N, H] BF16; recv_topk_idx [N, K] local expert ids (-1: an expert of another
    rank); recv_topk_weights [N, K]; num_recv_tokens_per_expert_list: tokens per local
    expert; w1 [E_local, H, I], w2 [E_local, I, H]. The (token, expert) pairs are sorted by
    expert, so expert e's tokens are the e-th segment of the lengths the dispatch reported,
    and each segment is one GEMM. Returns [N, H] BF16: per received token, the weighted sum
    of its local experts' outputs (combine adds up the ranks' partial sums).
    """
    N, H = recv_x.shape
    rows, ks = (recv_topk_idx >= 0).nonzero(as_tuple=True)
    order = torch.argsort(recv_topk_idx[rows, ks], stable=True)
    rows, ks = rows[order], ks[order]
    if rows.numel() != sum(num_recv_tokens_per_expert_list):
        raise RuntimeError(f"recv_topk_idx selects {rows.numel()} (token, expert) pairs, "
                           f"num_recv_tokens_per_expert_list adds up to "
                           f"{sum(num_recv_tokens_per_expert_list)}")
    out = torch.zeros(N, H, dtype=torch.float32, device=recv_x.device)
    start = 0
    for e, n in enumerate(num_recv_tokens_per_expert_list):
        if n:
            r, k = rows[start:start + n], ks[start:start + n]
            y = expert_mlp(recv_x.index_select(0, r), w1[e], w2[e])
            out.index_add_(0, r, y.float() * recv_topk_weights[r, k].float().unsqueeze(1))
        start += n
    return out.to(torch.bfloat16)


def masked_experts(recv_x: Recv, recv_count: torch.Tensor, w1: torch.Tensor,
                   w2: torch.Tensor) -> torch.Tensor:
    """The local experts over a low-latency dispatch's packed rows.

    recv_x [E_local, R*maxT, H] BF16, or the FP8 pair (data, scales [E_local, R*maxT,
    H/128]); recv_count [E_local]: valid rows per expert (the first ones). One batched GEMM
    over all rows, as a masked grouped GEMM does; rows past the count are zeroed first
    (they hold stale data) and are not read by the combine. Returns [E_local, R*maxT, H]
    BF16.
    """
    if isinstance(recv_x, tuple):  # FP8 with per-128-channel scales: dequantize
        q, scales = recv_x
        El, rows, H = q.shape
        x = (q.float().view(El, rows, H // 128, 128) * scales.unsqueeze(-1)).view(El, rows, H)
        x = x.to(torch.bfloat16)
    else:
        x = recv_x
        El, rows, H = x.shape
    valid = torch.arange(rows, device=x.device).unsqueeze(0) < recv_count.unsqueeze(1)
    x = torch.where(valid.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return torch.bmm(F.silu(torch.bmm(x, w1)), w2)


class MoELayer:
    """Router + E experts spread over the ranks of ``group`` (E_local = E / R per rank)."""

    def __init__(self, group: dist.ProcessGroup, hidden: int, intermediate: int,
                 num_experts: int, topk: int, num_max_dispatch_tokens_per_rank: int = 128,
                 seed: int = 0) -> None:
        R, rank = group.size(), group.rank()
        if num_experts % R:
            raise ValueError(f"num_experts {num_experts} is not divisible by {R} ranks")
        self.hidden, self.num_experts, self.topk = hidden, num_experts, topk
        self.num_local_experts = num_experts // R
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        device = torch.device("cuda", torch.cuda.current_device())
        gate, w1, w2 = moe_reference.expert_weights(seed, num_experts, hidden, intermediate)
        first = rank * self.num_local_experts
        mine = slice(first, first + self.num_local_experts)
        self.gate = torch.from_numpy(gate).to(device)  # float32 router
        self.w1 = torch.from_numpy(w1[mine]).to(device, torch.bfloat16)
        self.w2 = torch.from_numpy(w2[mine]).to(device, torch.bfloat16)

        num_nvl_bytes = max(cfg.get_nvl_buffer_size_hint(hidden * 2, R)
                            for cfg in (deep_ep.Buffer.get_dispatch_config(R),
                                        deep_ep.Buffer.get_combine_config(R)))
        num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank, hidden, R, num_experts)
        self.buffer = deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes,
                                     low_latency_mode=True,
                                     num_qps_per_rank=self.num_local_experts,
                                     explicitly_destroy=True)

    def close(self) -> None:
        self.buffer.destroy()

    def route(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> topk_idx [T, K] int64, topk_weights [T, K] float32 (sum to 1)."""
        scores = torch.softmax(x.float() @ self.gate, dim=-1)
        weights, idx = torch.topk(scores, self.topk, dim=-1)
        return idx.to(torch.int64), weights / weights.sum(dim=-1, keepdim=True)

    # ---- prefill / training: high-throughput kernels ---------------------------------------

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
         is_token_in_rank, _) = self.buffer.get_dispatch_layout(topk_idx, self.num_experts)
        recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, _ = \
            self.buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                                 num_tokens_per_rank=num_tokens_per_rank,
                                 num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
                                 is_token_in_rank=is_token_in_rank,
                                 num_tokens_per_expert=num_tokens_per_expert)
        return recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle

    def combine(self, y: torch.Tensor, handle) -> torch.Tensor:
        combined_x, _, _ = self.buffer.combine(y, handle)
        return combined_x

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H] BF16 -> [T, H] BF16."""
        recv_x, recv_topk_idx, recv_topk_weights, counts, handle = self.dispatch(
            x, topk_idx, topk_weights)
        y = grouped_experts(recv_x, recv_topk_idx, recv_topk_weights, counts, self.w1, self.w2)
        return self.combine(y, handle)

    # ---- decode: low-latency kernels --------------------------------------------------------

    def dispatch_decode(self, x: torch.Tensor, topk_idx: torch.Tensor, use_fp8: bool = True):
        recv_x, recv_count, handle, _, hook = self.buffer.low_latency_dispatch(
            x, topk_idx, self.num_max_dispatch_tokens_per_rank, self.num_experts,
            use_fp8=use_fp8, return_recv_hook=True)
        hook()  # the receive half; a model overlaps other work with the send before it
        return recv_x, recv_count, handle

    def combine_decode(self, y: torch.Tensor, topk_idx: torch.Tensor,
                       topk_weights: torch.Tensor, handle,
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
        combined_x, _, hook = self.buffer.low_latency_combine(
            y, topk_idx, topk_weights, handle, return_recv_hook=True, out=out)
        hook()
        return combined_x

    def forward_decode(self, x: torch.Tensor, topk_idx: torch.Tensor,
                       topk_weights: torch.Tensor, use_fp8: bool = True) -> torch.Tensor:
        """x [T, H] BF16 (T <= num_max_dispatch_tokens_per_rank) -> [T, H] BF16."""
        recv_x, recv_count, handle = self.dispatch_decode(x, topk_idx, use_fp8)
        y = masked_experts(recv_x, recv_count, self.w1, self.w2)
        return self.combine_decode(y, topk_idx, topk_weights, handle)


def run_example(group: dist.ProcessGroup, num_tokens: int = 512, num_decode_tokens: int = 64,
                num_max_dispatch_tokens_per_rank: int = 128, hidden: int = 1024,
                intermediate: int = 512, num_experts: int = 32, topk: int = 4, seed: int = 0,
                use_fp8: bool = True) -> Dict[str, np.ndarray]:
    """Runs the layer once in prefill mode and once in decode mode on this rank's random
    tokens (the counts may differ between ranks; num_max_dispatch_tokens_per_rank may
    not). Returns NumPy arrays: x [T, H], topk_idx, topk_weights, out [T, H] (prefill), and
    x_decode, topk_idx_decode, topk_weights_decode, out_decode [T_decode, H] (decode: the
    first T_decode of the tokens)."""
    rank = group.rank()
    if not 0 < num_decode_tokens <= min(num_tokens, num_max_dispatch_tokens_per_rank):
        raise ValueError(f"num_decode_tokens: must be in [1, min(num_tokens, "
                         f"num_max_dispatch_tokens_per_rank)], got {num_decode_tokens}")
    layer = MoELayer(group, hidden, intermediate, num_experts, topk,
                     num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                     seed=seed)
    device = layer.gate.device
    try:
        x_np = moe_reference.random_tokens(seed + 1000 + rank, num_tokens, hidden)
        x = torch.from_numpy(x_np).to(device, torch.bfloat16)
        idx, weights = layer.route(x)
        out = layer.forward(x, idx, weights)
        xd, idx_d, weights_d = x[:num_decode_tokens], idx[:num_decode_tokens], \
            weights[:num_decode_tokens]
        out_d = layer.forward_decode(xd, idx_d, weights_d, use_fp8=use_fp8)
        torch.cuda.synchronize()
        result = {"x": x_np, "topk_idx": idx.cpu().numpy(), "topk_weights": weights.cpu().numpy(),
                  "out": out.float().cpu().numpy(), "x_decode": x_np[:num_decode_tokens],
                  "topk_idx_decode": idx_d.cpu().numpy(),
                  "topk_weights_decode": weights_d.cpu().numpy(),
                  "out_decode": out_d.float().cpu().numpy()}
        dist.barrier(group)
    finally:
        layer.close()
    return result


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="MoE layer on deep_ep's API (run with torchrun)")
    p.add_argument("--tokens", type=int, default=512, help="prefill tokens per rank")
    p.add_argument("--decode-tokens", type=int, default=64, help="decode tokens per rank")
    p.add_argument("--max-decode-tokens", type=int, default=128,
                   help="num_max_dispatch_tokens_per_rank of the low-latency buffer")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16-decode", action="store_true", help="BF16 instead of FP8 dispatch")
    args = p.parse_args(argv)

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    group = dist.group.WORLD
    try:
        r = run_example(group, args.tokens, args.decode_tokens, args.max_decode_tokens,
                        args.hidden, args.intermediate, args.experts, args.topk, args.seed,
                        use_fp8=not args.bf16_decode)
        _, w1, w2 = moe_reference.expert_weights(args.seed, args.experts, args.hidden,
                                                 args.intermediate)
        xd = r["x_decode"] if args.bf16_decode else moe_reference.fp8_roundtrip(r["x_decode"])
        failures = 0
        for name, x, idx, w, got in (
                ("prefill", r["x"], r["topk_idx"], r["topk_weights"], r["out"]),
                ("decode", xd, r["topk_idx_decode"], r["topk_weights_decode"], r["out_decode"])):
            want = moe_reference.moe_forward(x, idx, w, w1, w2)
            err = moe_reference.compare(got, want)
            failures += err is not None
            print(f"rank {group.rank()}: {name} {got.shape[0]} tokens: "
                  f"{'matches the reference' if err is None else 'MISMATCH: ' + err}", flush=True)
    finally:
        dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

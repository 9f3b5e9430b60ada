"""The ``torch.distributed`` baseline of ``epx.bench --compare-torch``: the same data movement
as EPX's dispatch and combine, written with ``all_to_all_single``, including its routing work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

if TYPE_CHECKING:  # pragma: no cover
    import torch

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

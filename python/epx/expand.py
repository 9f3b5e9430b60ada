"""DeepEP V2's expanded layout (``do_expand=True``) over EPX's non-expanded dispatch.

EPX's high-throughput dispatch returns one row per (token, destination rank): rows
[N, H] and the local expert ids [N, K] of each row (-1 for experts of other ranks).
V2's expanded layout has one slot per (token, local expert) instead, grouped by
expert, each expert's group starting at a multiple of ``expert_alignment``, so a
grouped GEMM reads each expert's rows contiguously. Within an expert the slots
follow the received rows' order (EPX's is by source rank, then source token: V2's
deterministic order), so the layout is the same run after run.

These functions map one layout onto the other with PyTorch operations on the
tensors' device; their shapes depend only on their inputs' shapes (no host
synchronisation), so they capture in CUDA graphs. ``epx.reference.ht_expand`` /
``ht_fold`` state the same rules independently, with loops over NumPy arrays.

Shapes: N received rows, K top-k, E_local local experts, S expanded slots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Tuple

from .utils import _torch

if TYPE_CHECKING:  # pragma: no cover
    import torch


def worst_case_slots(num_rows: int, num_topk: int, num_local_experts: int,
                     expert_alignment: int) -> int:
    """The most slots an expanded dispatch of ``num_rows`` rows can fill: every row
    sends ``min(K, E_local)`` of its pairs here, and every expert's group may end in
    ``expert_alignment - 1`` padding slots (V2's bound, rounded up to the alignment)."""
    n = num_rows * min(num_topk, num_local_experts) + (expert_alignment - 1) * num_local_experts
    return (n + expert_alignment - 1) // expert_alignment * expert_alignment


def count_pairs(recv_topk_idx: "torch.Tensor", num_local_experts: int) -> "torch.Tensor":
    """[E_local] int64: the received (row, k) pairs of each local expert (ids of -1,
    experts of other ranks and rows past the data, are not counted)."""
    torch = _torch()
    flat = recv_topk_idx.reshape(-1).to(torch.int64) + 1  # -1 -> spill bin 0
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=recv_topk_idx.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return counts[1:]


def align_counts(counts: "torch.Tensor", expert_alignment: int) -> "torch.Tensor":
    """Each count rounded up to a multiple of expert_alignment."""
    return (counts + expert_alignment - 1) // expert_alignment * expert_alignment


def layout(recv_topk_idx: "torch.Tensor", counts: "torch.Tensor",
           expert_alignment: int) -> Tuple["torch.Tensor", "torch.Tensor"]:
    """Where each received (row, k) pair goes in the expanded layout.

    recv_topk_idx: [N, K] local expert ids, -1 where the pair is not this rank's;
    counts: ``count_pairs`` of it.

    Returns:
        slots [N, K] int32: the pair's slot, -1 where the id is -1. Expert e's slots
            start at the exclusive prefix sum of the aligned counts and follow the
            pairs' (row, k) order.
        psum [E_local] int32: V2's ``psum_num_recv_tokens_per_expert`` in expand mode,
            each expert's first slot plus its real count.
    """
    torch = _torch()
    n, k = recv_topk_idx.shape
    num_local_experts = counts.shape[0]
    ids = recv_topk_idx.reshape(-1).to(torch.int64)
    # -1 sorts last as expert E_local; its "start" entries are never used for a slot.
    key = torch.where(ids >= 0, ids, torch.full_like(ids, num_local_experts))
    aligned = align_counts(counts, expert_alignment)
    starts = torch.cumsum(aligned, 0) - aligned
    first_pair = torch.cumsum(counts, 0) - counts  # the expert's first pair once sorted
    pad = counts.new_zeros(1)
    # A stable sort by expert keeps the pairs of one expert in (row, k) order.
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    rank_in_expert = torch.arange(n * k, device=ids.device) - torch.cat([first_pair, pad])[sorted_key]
    slot_sorted = torch.cat([starts, pad])[sorted_key] + rank_in_expert
    slot_sorted = torch.where(sorted_key < num_local_experts, slot_sorted,
                              torch.full_like(slot_sorted, -1))
    slots = torch.empty_like(slot_sorted)
    slots[order] = slot_sorted
    return slots.view(n, k).to(torch.int32), (starts + counts).to(torch.int32)


def expand_rows(rows: "torch.Tensor", slots: "torch.Tensor", num_slots: int) -> "torch.Tensor":
    """rows [N, ...] -> [num_slots, ...]: row i copied to each of its pairs' slots;
    padding and unused slots are zero."""
    torch = _torch()
    # PyTorch has no index_copy_ for FP8: one-byte rows are copied as bytes.
    data = rows.view(torch.uint8) if rows.element_size() == 1 else rows
    # One spill slot past the end takes the pairs that are not here; it is cut off.
    out = torch.zeros((num_slots + 1,) + tuple(data.shape[1:]), dtype=data.dtype,
                      device=rows.device)
    idx = _or_spill(slots, num_slots)
    for j in range(slots.shape[1]):  # one top-k column at a time: no [N * K, H] copy
        out.index_copy_(0, idx[:, j], data)
    return out[:num_slots].view(rows.dtype)


def expand_weights(weights: "torch.Tensor", slots: "torch.Tensor",
                   num_slots: int) -> "torch.Tensor":
    """weights [N, K] -> [num_slots]: each pair's weight at its slot; other slots zero."""
    torch = _torch()
    out = torch.zeros(num_slots + 1, dtype=weights.dtype, device=weights.device)
    out.index_copy_(0, _or_spill(slots, num_slots).reshape(-1), weights.reshape(-1))
    return out[:num_slots]


def _or_spill(slots: "torch.Tensor", num_slots: int) -> "torch.Tensor":
    """slots as int64 indices, -1 replaced by num_slots: a zero row past the end."""
    torch = _torch()
    s = slots.to(torch.int64)
    return torch.where(s >= 0, s, torch.full_like(s, num_slots))


def fold_rows(expanded: "torch.Tensor", slots: "torch.Tensor") -> "torch.Tensor":
    """expanded [S, H] BF16 -> [N, H] BF16: each row the sum, in float32 and in top-k
    order, of its pairs' slots, rounded to BF16 once (V2's reduction within a rank);
    rows with no pair here are zero."""
    torch = _torch()
    n, k = slots.shape
    padded = torch.cat([expanded, expanded.new_zeros((1,) + tuple(expanded.shape[1:]))])
    idx = _or_spill(slots, expanded.shape[0])
    acc = torch.zeros((n,) + tuple(expanded.shape[1:]), dtype=torch.float32,
                      device=expanded.device)
    for j in range(k):  # one top-k column at a time: no [N, K, H] copy
        acc += padded.index_select(0, idx[:, j]).float()
    return acc.to(expanded.dtype)


def fold_weights(weights: "torch.Tensor", slots: "torch.Tensor") -> "torch.Tensor":
    """weights [S] -> [N, K]: each pair's slot weight, zero where the pair is not here."""
    padded = _torch().cat([weights, weights.new_zeros(1)])
    return padded.index_select(0, _or_spill(slots, weights.shape[0]).reshape(-1)) \
        .view(slots.shape)


def check_expanded(op: str, name: str, t: Any, num_slots: int) -> None:
    """An expanded-layout input has the handle's slot count as its first dimension."""
    if t is not None and t.shape[0] != num_slots:
        from . import _core

        _core._raise(_core.ErrorCode.invalid_argument,
                     f"{op}: {name}: has {t.shape[0]} rows; the expanded layout of this "
                     f"handle has {num_slots} slots (handle.num_expanded_tokens)")

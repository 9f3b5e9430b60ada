"""NumPy front end of EPX's CPU reference model (C++: include/epx/reference.hpp).

Simulates R ranks in one process: every function takes one array per rank and
returns one result per rank. BF16 values travel as uint16 bit patterns and FP8
e4m3 values as uint8 bytes (NumPy has neither type). Shapes: T_r tokens on
rank r, H hidden, K top-k, E experts (E_local = E / R), N_r tokens received,
maxT = max_tokens.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _core

_ref = _core.ref


# ---- element conversions -----------------------------------------------------------------------

def bf16_from_float(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bits (uint16), round to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)


def bf16_to_float(bits: np.ndarray) -> np.ndarray:
    """BF16 bits (uint16) -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


_FP8_TABLE: Optional[np.ndarray] = None


def fp8_to_float(q: np.ndarray) -> np.ndarray:
    """FP8 e4m3 bytes (uint8) -> float32 (exact)."""
    global _FP8_TABLE
    if _FP8_TABLE is None:
        _FP8_TABLE = np.array([_ref.fp8_e4m3_to_float(i) for i in range(256)], dtype=np.float32)
    return _FP8_TABLE[np.asarray(q, dtype=np.uint8)]


def quantize_fp8(x: np.ndarray, round_scale: bool = False) -> Tuple[np.ndarray, np.ndarray]:
    """[T, H] float32 -> (q [T, H] uint8, scales [T, H/128] float32), per 128 channels."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    T, H = x.shape
    if T == 0:
        return np.zeros((0, H), np.uint8), np.zeros((0, H // 128), np.float32)
    # One call for all rows (a call per row took minutes in a 4-process test on
    # the GPU host, where one process took 0.06 s for the same rows).
    q, s = _ref.quantize_rows_fp8(x.reshape(-1), H, round_scale)
    return q.reshape(T, H), s.reshape(T, H // 128)


def dequantize_fp8(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(q [.., H] uint8, scales [.., H/128]) -> float32 [.., H]."""
    return fp8_to_float(q) * np.repeat(np.asarray(scales, np.float32), 128, axis=-1)


# ---- routing -----------------------------------------------------------------------------------

def dispatch_layout(topk_idx: np.ndarray, num_experts: int,
                    num_ranks: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """topk_idx [T, K] -> (num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
    is_token_in_rank [T, R] bool)."""
    topk_idx = np.ascontiguousarray(topk_idx, dtype=np.int64)
    T, K = topk_idx.shape
    lay = _ref.get_dispatch_layout(topk_idx, T, K, num_experts, num_ranks)
    return (lay.num_tokens_per_rank.astype(np.int32), lay.num_tokens_per_expert.astype(np.int32),
            lay.is_token_in_rank.reshape(T, num_ranks).astype(bool))


def tokens_per_node(topk_idx: np.ndarray, num_experts: int, num_ranks: int,
                    ranks_per_node: int) -> np.ndarray:
    """[R / ranks_per_node] int32: tokens with any expert on a rank of each node
    (DeepEP's num_tokens_per_rdma_rank)."""
    topk_idx = np.ascontiguousarray(topk_idx, dtype=np.int64)
    T, K = topk_idx.shape
    lay = _ref.get_dispatch_layout(topk_idx, T, K, num_experts, num_ranks, ranks_per_node)
    return lay.num_tokens_per_node.astype(np.int32)


# ---- high-throughput ---------------------------------------------------------------------------

XInput = Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]


def _ht_input(x: XInput, topk_idx: np.ndarray,
              topk_weights: Optional[np.ndarray]) -> "_core.ref.HtInput":
    inp = _ref.HtInput()
    topk_idx = np.ascontiguousarray(topk_idx, dtype=np.int64)
    inp.num_tokens = topk_idx.shape[0]
    if isinstance(x, tuple):
        inp.fp8 = True
        inp.x_fp8 = np.ascontiguousarray(x[0], dtype=np.uint8)
        inp.x_scales = np.ascontiguousarray(x[1], dtype=np.float32)
    else:
        inp.x_bf16 = np.ascontiguousarray(x, dtype=np.uint16)
    inp.topk_idx = topk_idx
    if topk_weights is not None:
        inp.topk_weights = np.ascontiguousarray(topk_weights, dtype=np.float32)
    return inp


def ht_dispatch(x: Sequence[XInput], topk_idx: Sequence[np.ndarray], num_experts: int,
                topk_weights: Optional[Sequence[np.ndarray]] = None,
                expert_alignment: int = 1) -> List[Dict[str, object]]:
    """High-throughput dispatch of R ranks.

    x[r] is [T_r, H] BF16 bits, or (q [T_r, H] uint8, scales [T_r, H/128] float32);
    topk_idx[r] is [T_r, K]. Returns per rank a dict: recv_x ([N, H], or (q, scales)),
    recv_topk_idx [N, K] (local expert ids, -1 elsewhere), recv_topk_weights [N, K] or
    None, num_recv_tokens_per_expert (list of E_local), recv_src_rank [N], recv_src_idx [N].
    """
    R = len(x)
    first = x[0][0] if isinstance(x[0], tuple) else x[0]
    H, K = first.shape[1], np.asarray(topk_idx[0]).shape[1]
    weights = topk_weights if topk_weights is not None else [None] * R
    inputs = [_ht_input(x[r], topk_idx[r], weights[r]) for r in range(R)]
    outs = _ref.ht_dispatch(inputs, H, K, num_experts, expert_alignment)
    result = []
    for r, o in enumerate(outs):
        N = o.num_recv_tokens
        if isinstance(x[r], tuple):
            recv_x = (o.recv_x_fp8.reshape(N, H), o.recv_x_scales.reshape(N, H // 128))
        else:
            recv_x = o.recv_x_bf16.reshape(N, H)
        w = o.recv_topk_weights
        result.append({
            "recv_x": recv_x,
            "recv_topk_idx": o.recv_topk_idx.reshape(N, K),
            "recv_topk_weights": w.reshape(N, K) if w.size else None,
            "num_recv_tokens_per_expert": o.num_recv_tokens_per_expert.tolist(),
            "recv_src_rank": o.recv_src_rank,
            "recv_src_idx": o.recv_src_idx,
            "rank_prefix_matrix": o.rank_prefix_matrix.reshape(R, R),
            "source_num_tokens": o.source_num_tokens,
        })
    return result


def deepep_intranode_handle(is_token_in_rank: Sequence[np.ndarray], rank: int,
                            num_channels: int) -> Tuple[np.ndarray, ...]:
    """DeepEP V1's intranode dispatch handle of ``rank``, from every rank's
    is_token_in_rank [T_r, R], by DeepEP's definitions, written as plain loops:

    0. rank_prefix_matrix [R, R]: [i][j] = tokens ranks 0..i send to rank j;
    1. channel_prefix_matrix [R, C]: tokens this rank sends to r from channels
       0..c, where channel c holds tokens [c * w, (c + 1) * w), w = ceil(T / C);
    2. recv_channel_prefix_matrix [R, C]: source s's channel_prefix_matrix
       [rank][c - 1] (0 for c = 0): where channel c's rows start in s's block;
    3. recv_src_idx [N]: source token of each received row (sources in rank
       order, each in token order);
    4. is_token_in_rank [T, R] of this rank;
    5. send_head [T, R]: for a token sent to r, how many tokens of its channel
       before it go to r; -1 where it is not sent.
    """
    R, C = len(is_token_in_rank), num_channels
    masks = [np.asarray(m, dtype=bool) for m in is_token_in_rank]

    def channel_counts(m: np.ndarray) -> np.ndarray:  # [R, C] per-channel counts
        T = m.shape[0]
        w = -(-T // C) if T else 0
        out = np.zeros((R, C), dtype=np.int64)
        for t in range(T):
            for r in range(R):
                if m[t, r]:
                    out[r, t // w] += 1
        return out

    prefix = np.zeros((R, R), dtype=np.int32)
    for j in range(R):
        acc = 0
        for i in range(R):
            acc += int(masks[i][:, j].sum())
            prefix[i, j] = acc
    mine = masks[rank]
    chan = np.cumsum(channel_counts(mine), axis=1).astype(np.int32)
    recv_chan = np.zeros((R, C), dtype=np.int32)
    for s in range(R):
        theirs = np.cumsum(channel_counts(masks[s]), axis=1)
        for c in range(1, C):
            recv_chan[s, c] = theirs[rank, c - 1]
    src_idx = [t for s in range(R) for t in range(masks[s].shape[0]) if masks[s][t, rank]]
    T = mine.shape[0]
    w = -(-T // C) if T else 0
    head = np.full((T, R), -1, dtype=np.int32)
    for r in range(R):
        seen = {}
        for t in range(T):
            if mine[t, r]:
                c = t // w
                head[t, r] = seen.get(c, 0)
                seen[c] = head[t, r] + 1
    return (prefix, chan, recv_chan, np.asarray(src_idx, dtype=np.int32), mine.copy(), head)


def deepep_internode_handle(is_token_in_rank: Sequence[np.ndarray], rank: int,
                            num_channels: int, ranks_per_node: int) -> Tuple[np.ndarray, ...]:
    """DeepEP V1's internode dispatch handle of ``rank``, from every rank's
    is_token_in_rank [T_r, R], by DeepEP's definitions, written as plain loops: what the
    internode dispatch must give DeepEP's code (docs/internode_ht.md).

    Ranks are r = n * L + l: node n of N = R / L, local index l (L = ranks_per_node). A
    token goes to node n when it goes to any rank there, and it crosses the network once
    per such node, to the rank of the sender's local index there (the forwarder), which
    passes it on over NVLink. Channel c of a rank's T tokens holds tokens
    [c * q, (c + 1) * q), q = ceil(T / C). This rank is D = (m, l).

    0. is_token_in_rank [T, R] bool of this rank.
    1. rdma_channel_prefix_matrix [N, C]: tokens of channels 0..c that go to node n.
    2. gbl_channel_prefix_matrix [R, C]: tokens of channels 0..c that go to rank r.
    3. recv_rdma_channel_prefix_matrix [N, C]: element 1 of rank (s, l) at [m, c], what
       this forwarder receives from node s by channel (each source node counted from 0).
    4. recv_rdma_rank_prefix_sum [N]: tokens that ranks (0, l) .. (s, l) send to node m;
       the last is what this forwarder receives in all.
    5. recv_gbl_channel_prefix_matrix [R, C]: the first row of recv_x that holds source
       r's channel c: element 6 at r - 1 (0 for r = 0) plus element 2 of rank r at
       [rank, c - 1] (0 for c = 0).
    6. recv_gbl_rank_prefix_sum [R]: tokens that ranks 0..r send to this rank.
    7. recv_src_meta [N_recv, 8] uint8: per row of recv_x (sources in rank order, each in
       token order), the int32 source node, then the int32 mask of the ranks of node m the
       token goes to (bit p: rank m * L + p), little-endian.
    8. send_rdma_head [T, N]: for a token that goes to node n, how many earlier tokens of
       its channel go to node n; -1 where it does not.
    9. send_nvl_head [M, L] (M = element 4's last): the tokens this forwarder receives, by
       source node, then channel, then token; for local rank p, how many earlier tokens of
       the same source node and channel go to rank (m, p); -1 where the token does not.

    Every prefix above includes its own index (inclusive) except element 5's.
    """
    R, C, L = len(is_token_in_rank), num_channels, ranks_per_node
    if L <= 0 or R % L:
        raise ValueError(f"ranks_per_node: must divide the {R} ranks, got {L}")
    N, m, l = R // L, rank // L, rank % L
    masks = [np.asarray(x, dtype=bool) for x in is_token_in_rank]

    def channel_of(T: int, t: int) -> int:
        return t // -(-T // C)

    def to_node(mask: np.ndarray, t: int, n: int) -> bool:
        return bool(mask[t, n * L:(n + 1) * L].any())

    def rdma_prefix(r: int) -> np.ndarray:  # element 1 of rank r
        T, out = masks[r].shape[0], np.zeros((N, C), dtype=np.int32)
        for n in range(N):
            for t in range(T):
                if to_node(masks[r], t, n):
                    out[n, channel_of(T, t)] += 1
        return np.cumsum(out, axis=1).astype(np.int32)

    def gbl_prefix(r: int) -> np.ndarray:  # element 2 of rank r
        T, out = masks[r].shape[0], np.zeros((R, C), dtype=np.int32)
        for d in range(R):
            for t in range(T):
                if masks[r][t, d]:
                    out[d, channel_of(T, t)] += 1
        return np.cumsum(out, axis=1).astype(np.int32)

    mine = masks[rank]
    T = mine.shape[0]
    rdma = rdma_prefix(rank)
    gbl = gbl_prefix(rank)
    recv_rdma = np.stack([rdma_prefix(s * L + l)[m] for s in range(N)]).astype(np.int32)
    recv_rdma_sum = np.cumsum(recv_rdma[:, C - 1]).astype(np.int32)
    recv_gbl_sum = np.cumsum([int(masks[r][:, rank].sum()) for r in range(R)]).astype(np.int32)
    recv_gbl = np.zeros((R, C), dtype=np.int32)
    for r in range(R):
        g = gbl_prefix(r)
        for c in range(C):
            recv_gbl[r, c] = (recv_gbl_sum[r - 1] if r else 0) + (g[rank, c - 1] if c else 0)
    meta = []
    for r in range(R):
        for t in range(masks[r].shape[0]):
            if masks[r][t, rank]:
                bits = sum(1 << p for p in range(L) if masks[r][t, m * L + p])
                meta.append(np.array([r // L, bits], dtype="<i4").view(np.uint8))
    src_meta = np.stack(meta) if meta else np.zeros((0, 8), dtype=np.uint8)
    rdma_head = np.full((T, N), -1, dtype=np.int32)
    for n in range(N):
        seen: Dict[int, int] = {}
        for t in range(T):
            if to_node(mine, t, n):
                c = channel_of(T, t)
                rdma_head[t, n] = seen.get(c, 0)
                seen[c] = rdma_head[t, n] + 1
    nvl_head = np.full((int(recv_rdma_sum[-1]) if N else 0, L), -1, dtype=np.int32)
    row = 0
    for s in range(N):
        src = masks[s * L + l]
        Ts = src.shape[0]
        for c in range(C):
            seen = [0] * L
            for t in range(Ts):
                if channel_of(Ts, t) != c or not to_node(src, t, m):
                    continue
                for p in range(L):
                    if src[t, m * L + p]:
                        nvl_head[row, p] = seen[p]
                        seen[p] += 1
                row += 1
    return (mine.copy(), rdma, gbl, recv_rdma, recv_rdma_sum, recv_gbl, recv_gbl_sum, src_meta,
            rdma_head, nvl_head)


def ht_combine(topk_idx: Sequence[np.ndarray], x: Sequence[np.ndarray], num_experts: int,
               topk_weights: Optional[Sequence[np.ndarray]] = None,
               bias: Optional[Sequence[Tuple[Optional[np.ndarray], Optional[np.ndarray]]]] = None,
               ranks_per_node: int = 0) -> List[Tuple[np.ndarray, Optional[np.ndarray]]]:
    """High-throughput combine of R ranks.

    topk_idx[r] is rank r's dispatch routing [T_r, K]; x[r] is [N_r, H] BF16 bits in r's
    dispatch receive order; topk_weights[r] [N_r, K]; bias[r] a pair of [T_r, H] BF16 bits
    (or None). ranks_per_node (0: one node) groups the sum by node as the combine across
    nodes does: each node's rows summed, rounded to BF16, then the nodes' sums in node
    order (ref::ht_combine). Returns per rank (combined_x [T_r, H] BF16 bits,
    combined_topk_weights [T_r, K] or None).
    """
    R = len(x)
    H, K = np.asarray(x[0]).shape[1], np.asarray(topk_idx[0]).shape[1]
    routing = [_ht_input(np.zeros((0, H), np.uint16), topk_idx[r], None) for r in range(R)]
    inputs = []
    for r in range(R):
        ci = _ref.HtCombineInput()
        ci.x = np.ascontiguousarray(x[r], dtype=np.uint16)
        if topk_weights is not None:
            ci.topk_weights = np.ascontiguousarray(topk_weights[r], dtype=np.float32)
        if bias is not None:
            b0, b1 = bias[r]
            if b0 is not None:
                ci.bias_0 = np.ascontiguousarray(b0, dtype=np.uint16)
            if b1 is not None:
                ci.bias_1 = np.ascontiguousarray(b1, dtype=np.uint16)
        inputs.append(ci)
    outs = _ref.ht_combine(routing, inputs, H, K, num_experts, ranks_per_node)
    result = []
    for r, o in enumerate(outs):
        T = np.asarray(topk_idx[r]).shape[0]
        w = o.combined_topk_weights
        result.append((o.combined_x.reshape(T, H), w.reshape(T, K) if w.size else None))
    return result


# ---- DeepEP V2's expanded layout ---------------------------------------------------------------

def ht_expand(recv_topk_idx: np.ndarray, num_local_experts: int,
              expert_alignment: int = 1) -> Dict[str, np.ndarray]:
    """The expanded layout of one rank's non-expanded dispatch (DeepEP V2's
    do_expand=True): one slot per received (row, k) pair whose local expert id is not
    -1. Expert e's slots start at the sum of the earlier experts' counts, each rounded
    up to expert_alignment, and are taken by its pairs in row order, then k order.

    Returns slots [N, K] (-1 where the id is -1), counts [E_local] (pairs per expert),
    starts [E_local] (each expert's first slot), num_slots (the aligned total).
    """
    idx = np.asarray(recv_topk_idx)
    counts = np.zeros(num_local_experts, np.int64)
    for e in idx.reshape(-1):
        if e >= 0:
            counts[e] += 1
    starts = np.zeros(num_local_experts, np.int64)
    total = 0
    for e in range(num_local_experts):
        starts[e] = total
        total += -(-counts[e] // expert_alignment) * expert_alignment
    slots = np.full(idx.shape, -1, np.int64)
    taken = np.zeros(num_local_experts, np.int64)
    for i in range(idx.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[i, j]
            if e >= 0:
                slots[i, j] = starts[e] + taken[e]
                taken[e] += 1
    return {"slots": slots, "counts": counts, "starts": starts, "num_slots": total}


def ht_fold(expanded: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """[S, H] BF16 bits in slot order -> [N, H] BF16 bits: row i is the float32 sum of
    its pairs' slots in k order, rounded to BF16 once; 0 for a row with no pair."""
    slots = np.asarray(slots)
    vals = bf16_to_float(np.asarray(expanded, np.uint16))
    out = np.zeros((slots.shape[0], vals.shape[1]), np.float32)
    for i in range(slots.shape[0]):
        for j in range(slots.shape[1]):
            if slots[i, j] >= 0:
                out[i] += vals[slots[i, j]]
    return bf16_from_float(out)


# ---- low-latency -------------------------------------------------------------------------------

def ll_dispatch(x: Sequence[np.ndarray], topk_idx: Sequence[np.ndarray], num_experts: int,
                max_tokens: int, use_fp8: bool = False,
                round_scale: bool = False) -> List[Dict[str, np.ndarray]]:
    """Low-latency dispatch of R ranks: x[r] [T_r, H] BF16 bits, topk_idx[r] [T_r, K].

    Returns per rank a dict: recv_x [E_local, R*maxT, H] (BF16 bits, or uint8 with
    use_fp8), recv_x_scales [E_local, R*maxT, H/128] (use_fp8), recv_count [E_local],
    src_info and recv_src_rank [E_local, R*maxT] (-1 past the count), layout_range
    [E_local, R] ((begin << 32) | count).
    """
    R = len(x)
    H, K = np.asarray(x[0]).shape[1], np.asarray(topk_idx[0]).shape[1]
    E_local, rows = num_experts // R, R * max_tokens
    outs = _ref.ll_dispatch([np.ascontiguousarray(a, dtype=np.uint16) for a in x],
                            [np.ascontiguousarray(a, dtype=np.int64) for a in topk_idx],
                            [np.asarray(a).shape[0] for a in x], H, K, num_experts, max_tokens,
                            use_fp8, round_scale)
    result = []
    for o in outs:
        d = {
            "recv_x": (o.recv_x_fp8 if use_fp8 else o.recv_x_bf16).reshape(E_local, rows, H),
            "recv_count": o.recv_count,
            "src_info": o.src_info.reshape(E_local, rows),
            "recv_src_rank": o.recv_src_rank.reshape(E_local, rows),
            "layout_range": o.layout_range.reshape(E_local, R),
        }
        if use_fp8:
            d["recv_x_scales"] = o.recv_x_scales.reshape(E_local, rows, H // 128)
        result.append(d)
    return result


def ll_combine(expert_out: Sequence[np.ndarray], topk_idx: Sequence[np.ndarray],
               topk_weights: Sequence[np.ndarray], num_experts: int, max_tokens: int,
               use_logfmt: bool = False) -> List[np.ndarray]:
    """Low-latency combine of R ranks: expert_out[r] [E_local, R*maxT, H] BF16 bits in the
    packed order of ll_dispatch; topk_idx[r] / topk_weights[r] [T_r, K]. Returns per rank
    [T_r, H] BF16 bits: sum over k of weight * expert output (float32 accumulation)."""
    H, K = np.asarray(expert_out[0]).shape[-1], np.asarray(topk_idx[0]).shape[1]
    num_tokens = [np.asarray(a).shape[0] for a in topk_idx]
    outs = _ref.ll_combine([np.ascontiguousarray(a, dtype=np.uint16) for a in expert_out],
                           [np.ascontiguousarray(a, dtype=np.int64) for a in topk_idx],
                           [np.ascontiguousarray(a, dtype=np.float32) for a in topk_weights],
                           num_tokens, H, K, num_experts, max_tokens, use_logfmt)
    return [o.reshape(T, H) for o, T in zip(outs, num_tokens)]

"""Handles shaped like DeepEP V1's: tuples whose elements are DeepEP's, in its
order, with EPX's own routing state riding along as ``.core``.

Code written for DeepEP indexes its handles (``handle[0]``, ``handle[1][i]``);
EPX's calls take the tuple back unchanged (or EPX's core handle, as before).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple, Union

from . import _core
from .utils import _torch


class _Handle(tuple):
    """What EPX's handle tuples share: EPX's handle as ``.core``, whose
    attributes the tuple also answers, and no pickling (device state)."""

    core: Any
    _own = ("core",)  # attributes of the tuple itself, never the core's

    def __getattr__(self, name: str) -> Any:
        # Only called for names the tuple lacks: EPX's handle attributes.
        if name in self._own:
            raise AttributeError(name)
        return getattr(self.core, name)

    def __reduce__(self):
        raise TypeError("an EPX handle refers to device state of one buffer and cannot be "
                        "pickled or copied")


def _core_of(op: str, handle: Any, tuple_cls: type, core_cls: type, made_by: str) -> Any:
    """EPX's handle inside ``handle`` (a ``tuple_cls`` or a ``core_cls``); a
    TypeError naming ``op`` and the argument otherwise."""
    if isinstance(handle, tuple_cls):
        return handle.core
    if isinstance(handle, core_cls):
        return handle
    what = "a plain tuple (rebuilt from a handle's elements?)" if isinstance(handle, tuple) \
        else type(handle).__name__
    raise TypeError(f"{op}: handle: expected the handle returned by {made_by}, got {what}")


class LowLatencyHandle(_Handle):
    """A low-latency dispatch's handle, DeepEP's 5-tuple:

    0. src_info: [E_local, R*maxT] int32, the source token index of each
       packed row (rows past an expert's count are -1);
    1. layout_range: [E_local, R] int64, ``(first row << 32) | rows`` of each
       source rank in an expert's packed rows;
    2. num_max_dispatch_tokens_per_rank; 3. hidden; 4. num_experts.

    ``.core`` is EPX's handle (the combine's reduction plan and the op's
    state); other attributes (``src_info``, ``num_tokens``, ...) read from it.
    """

    def __new__(cls, core: "_core.LowLatencyHandle", src_info: Any,
                layout_range: Any) -> "LowLatencyHandle":
        if not isinstance(core, _core.LowLatencyHandle):
            raise TypeError(f"core: expected an epx._core.LowLatencyHandle, "
                            f"got {type(core).__name__}")
        self = super().__new__(cls, (src_info, layout_range,
                                     core.num_max_dispatch_tokens_per_rank, core.hidden,
                                     core.num_experts))
        self.core = core
        return self

    def __repr__(self) -> str:
        c = self.core
        return (f"epx.LowLatencyHandle(num_max_dispatch_tokens_per_rank="
                f"{c.num_max_dispatch_tokens_per_rank}, hidden={c.hidden}, "
                f"num_experts={c.num_experts}, num_ranks={c.num_ranks}, "
                f"num_tokens={c.num_tokens})")


def core_low_latency_handle(op: str, handle: Any) -> "_core.LowLatencyHandle":
    """EPX's handle inside ``handle`` (a LowLatencyHandle tuple or the core
    handle itself); a TypeError naming ``op`` and the argument otherwise."""
    return _core_of(op, handle, LowLatencyHandle, _core.LowLatencyHandle, "low_latency_dispatch")


# ---- the intranode dispatch handle -----------------------------------------------------------

class _Ops:
    """The few array operations the channel elements need, for torch tensors (what
    handles hold) and numpy arrays (what the CPU tests without torch use)."""

    def __init__(self, like: Any) -> None:
        # numpy only where a numpy array comes in (epx itself needs no numpy)
        self.np = type(like).__module__ == "numpy"
        self.dev = None if self.np else like.device
        if self.np:
            import numpy
            self.numpy = numpy
        else:
            self.torch = _torch()

    def arange(self, n: int) -> Any:
        return self.numpy.arange(n) if self.np else self.torch.arange(n, device=self.dev)

    def zeros(self, shape: Any, i64: bool = False) -> Any:
        if self.np:
            return self.numpy.zeros(shape, dtype=self.numpy.int64 if i64 else self.numpy.int32)
        dt = self.torch.int64 if i64 else self.torch.int32
        return self.torch.zeros(shape, dtype=dt, device=self.dev)

    def i32(self, x: Any) -> Any:
        return x.astype(self.numpy.int32) if self.np else x.to(self.torch.int32)

    def i64(self, x: Any) -> Any:
        return x.astype(self.numpy.int64) if self.np else x.to(self.torch.int64)

    def add_rows(self, out: Any, index: Any, values: Any) -> Any:
        """out[index[i]] += values[i] (repeated indices add up)."""
        if self.np:
            self.numpy.add.at(out, index, values)
        else:
            out.index_add_(0, index, values)
        return out

    def cumsum(self, x: Any, axis: int) -> Any:
        return self.numpy.cumsum(x, axis=axis, dtype=self.numpy.int32) if self.np \
            else x.cumsum(axis, dtype=self.torch.int32)

    def cat_cols(self, a: Any, b: Any) -> Any:
        return self.numpy.concatenate([a, b], axis=1) if self.np \
            else self.torch.cat([a, b], dim=1)

    def where(self, cond: Any, a: Any, fill: int) -> Any:
        if self.np:
            return self.numpy.where(cond, a, fill).astype(self.numpy.int32)
        return self.torch.where(cond, a, self.torch.full_like(a, fill))

    def repeat(self, values: Any, counts: Any, total: int) -> Any:
        return self.numpy.repeat(values, counts) if self.np \
            else self.torch.repeat_interleave(values, counts, output_size=total)

    def array(self, values: Any) -> Any:
        """int64 array of a host list, on this device."""
        return self.numpy.asarray(values, dtype=self.numpy.int64) if self.np \
            else self.torch.tensor(values, dtype=self.torch.int64, device=self.dev)

    def bits(self, masks: Any, n: int) -> Any:
        """[M] int masks -> [M, n] int32 of their bits 0..n-1."""
        shifts = self.arange(n)
        return self.i32((masks.reshape(-1, 1) >> shifts) & 1)

    def stack_cols(self, a: Any, b: Any) -> Any:
        return self.numpy.stack([a, b], axis=1) if self.np else self.torch.stack([a, b], dim=1)

    def as_bytes(self, x: Any) -> Any:
        """A contiguous int32 array [M, k] seen as uint8 [M, 4k] (little-endian)."""
        x = self.contiguous(self.i32(x))
        return x.view(self.numpy.uint8) if self.np else x.view(self.torch.uint8)

    def contiguous(self, x: Any) -> Any:
        return self.numpy.ascontiguousarray(x) if self.np else x.contiguous()

    def any_of_groups(self, m: Any, group: int) -> Any:
        """[T, R] bool -> [T, R / group] bool: any of each run of `group` columns."""
        g = m.reshape(m.shape[0], m.shape[1] // group, group)  # (no -1: T may be 0)
        return g.any(axis=2) if self.np else g.any(dim=2)


def _channel_width(num_tokens: Any, num_channels: int) -> Any:
    """DeepEP's channel size: ceil(T / C) tokens (at least 1, so that T = 0 divides);
    elementwise for an array of token counts."""
    if isinstance(num_tokens, int):
        return max(1, -(-num_tokens // num_channels))
    w = (num_tokens + num_channels - 1) // num_channels
    return w.clamp(min=1) if hasattr(w, "clamp") else w.clip(min=1)


def channel_prefix_matrix(is_token_in_rank: Any, num_channels: int) -> Any:
    """[R, C] int32: tokens sent to rank r from channels 0..c (inclusive), channel c
    being tokens [c * w, (c + 1) * w) with w = ceil(T / C), as DeepEP's notify."""
    ops = _Ops(is_token_in_rank)
    T, R = is_token_in_rank.shape
    chan = ops.arange(T) // _channel_width(int(T), num_channels)
    counts = ops.add_rows(ops.zeros((num_channels, R)), chan, ops.i32(is_token_in_rank))
    return ops.contiguous(ops.cumsum(counts.T, 1))


def send_head(is_token_in_rank: Any, chan_prefix: Any) -> Any:
    """[T, R] int32: for a token sent to r, how many tokens of its channel before it
    go to r (DeepEP's channel-local index); -1 where the token is not sent."""
    ops = _Ops(is_token_in_rank)
    T, R = is_token_in_rank.shape
    C = chan_prefix.shape[1]
    m = ops.i32(is_token_in_rank)
    before = ops.cumsum(m, 0) - m  # tokens before t going to r, over all channels
    # [R, C]: tokens to r in the channels before c
    start = ops.cat_cols(ops.zeros((R, 1)), chan_prefix[:, :-1])
    chan = ops.arange(T) // _channel_width(int(T), C)
    return ops.where(is_token_in_rank, before - start[:, chan].T, -1)


def recv_channel_prefix_matrix(rank_prefix_matrix: Any, recv_src_idx: Any,
                               source_num_tokens: Any, rank: int, num_channels: int) -> Any:
    """[R, C] int32: for source s, the rows it sent here from its channels before c
    (its channel_prefix_matrix[rank][c - 1], 0 for c = 0), as DeepEP's receivers record."""
    return _recv_channel_starts(rank_prefix_matrix[:, rank], recv_src_idx, source_num_tokens,
                                num_channels)


def _block_starts(ops: "_Ops", ends: Any) -> Any:
    """[R] int64 ends of consecutive blocks (an inclusive prefix sum) -> their starts."""
    if ends.shape[0] == 0:
        return ends
    return ops.cat_cols(ops.zeros((1, 1), i64=True), ends[:-1].reshape(1, -1))[0]


def _recv_channel_starts(source_ends: Any, recv_src_idx: Any, source_num_tokens: Any,
                         num_channels: int) -> Any:
    """[R, C] int32: where source s's channel c starts within s's block of received rows;
    source_ends [R]: the end row of each source's block (inclusive prefix sum)."""
    ops = _Ops(recv_src_idx)
    R, C = source_ends.shape[0], num_channels
    ends = ops.i64(source_ends)
    rows = ends - _block_starts(ops, ends)
    # Rows actually received (with num_worst_tokens, recv_src_idx is longer);
    # reading it waits for the dispatch (as reading any of its outputs does).
    n = int(ends[-1]) if R > 0 else 0
    src = ops.repeat(ops.arange(R), rows, n)
    width = _channel_width(ops.i64(source_num_tokens), C)
    flat = src * C + ops.i64(recv_src_idx[:n]) // width[src]
    counts = ops.add_rows(ops.zeros(R * C), flat, ops.i32(ops.zeros(n) + 1)).reshape(R, C)
    return ops.contiguous(ops.cumsum(counts, 1) - counts)


# ---- the internode dispatch handle's derivable elements (docs/internode_ht.md) ---------------

def rdma_channel_prefix_matrix(is_token_in_rank: Any, num_channels: int,
                               ranks_per_node: int) -> Any:
    """[N, C] int32: tokens sent to node n (to any of its ranks) from channels 0..c
    (inclusive), as DeepEP's internode notify."""
    ops = _Ops(is_token_in_rank)
    return channel_prefix_matrix(ops.any_of_groups(is_token_in_rank, ranks_per_node),
                                 num_channels)


def send_rdma_head(is_token_in_rank: Any, rdma_prefix: Any, ranks_per_node: int) -> Any:
    """[T, N] int32: for a token sent to node n, how many tokens of its channel before
    it go to node n; -1 where it goes to no rank of n."""
    ops = _Ops(is_token_in_rank)
    return send_head(ops.any_of_groups(is_token_in_rank, ranks_per_node), rdma_prefix)


def recv_gbl_channel_prefix_matrix(recv_gbl_rank_prefix_sum: Any, recv_src_idx: Any,
                                   source_num_tokens: Any, num_channels: int) -> Any:
    """[R, C] int32: the first row of recv_x that holds source r's channel c (absolute:
    the rows of sources before r, then r's channels before c), as DeepEP's internode
    receivers record."""
    ops = _Ops(recv_src_idx)
    ends = ops.i64(recv_gbl_rank_prefix_sum)
    starts = _recv_channel_starts(ends, recv_src_idx, source_num_tokens, num_channels)
    return ops.contiguous(ops.i32(ops.i64(starts) + _block_starts(ops, ends).reshape(-1, 1)))


def _forwarded_records(ops: "_Ops", fwd_token: Any, fwd_rows: Any) -> Tuple[Any, Any, Any]:
    """The records a forwarder kept, by source node: [M] source node, position in its
    node's rows and token index of each, from fwd_token [N, rows] (node s's first fwd_rows[s] rows are its records, in
    token order) and fwd_rows [N] (a host list)."""
    rows = ops.array(list(fwd_rows))
    M = int(sum(fwd_rows))
    node = ops.repeat(ops.arange(len(fwd_rows)), rows, M)
    pos = ops.arange(M) - _exclusive_sum(ops, rows)[node]
    return node, pos, ops.i64(fwd_token[node, pos])


def _exclusive_sum(ops: "_Ops", counts: Any) -> Any:
    """[n] counts -> [n] int64: where each block of consecutive rows starts."""
    return _block_starts(ops, ops.i64(ops.cumsum(counts, 0)))


def _forwarded_channels(ops: "_Ops", node: Any, token: Any, source_tokens: Any,
                        num_channels: int) -> Any:
    """[M] int64: each forwarded record's channel at its source (source_tokens [N]: the
    token count of each node's source)."""
    width = _channel_width(ops.i64(source_tokens), num_channels)
    return token // width[node]


def recv_rdma_channel_prefix_matrix(fwd_token: Any, fwd_rows: Sequence[int],
                                    source_tokens: Any, num_channels: int) -> Any:
    """[N, C] int32: the records this forwarder got from node s's source (the rank of
    its local index there) from that source's channels 0..c (inclusive), as DeepEP's
    forwarders record. fwd_token [N, rows]: each record's token index; fwd_rows [N]
    (host): the records per node; source_tokens [N]: each of those sources' token count."""
    ops = _Ops(fwd_token)
    N, C = len(fwd_rows), num_channels
    node, _, token = _forwarded_records(ops, fwd_token, fwd_rows)
    chan = _forwarded_channels(ops, node, token, source_tokens, C)
    ones = ops.i32(ops.zeros(node.shape[0]) + 1)
    counts = ops.add_rows(ops.zeros(N * C), node * C + chan, ones).reshape(N, C)
    return ops.contiguous(ops.cumsum(counts, 1))


def recv_rdma_rank_prefix_sum(fwd_rows: Sequence[int], like: Any) -> Any:
    """[N] int32: the records this forwarder got from nodes 0..s (inclusive), on
    ``like``'s device."""
    ops = _Ops(like)
    return ops.contiguous(ops.cumsum(ops.array(list(fwd_rows)), 0))


def recv_src_meta(recv_meta: Any, ranks_per_node: int) -> Any:
    """[N_recv, 8] uint8: per received row the int32 source node, then the int32 mask of
    this node's ranks its token reached, from EPX's recv_meta [N_recv, 3] (source rank,
    record index, mask)."""
    ops = _Ops(recv_meta)
    return ops.as_bytes(ops.stack_cols(recv_meta[:, 0] // ranks_per_node, recv_meta[:, 2]))


def send_nvl_head(fwd_mask: Any, fwd_token: Any, fwd_rows: Sequence[int], source_tokens: Any,
                  num_channels: int, ranks_per_node: int) -> Any:
    """[M, L] int32: for each record this forwarder got (by source node, then token) and
    each local rank p its token reaches, how many earlier records of the same source
    node and channel reach p; -1 where it does not reach p."""
    ops = _Ops(fwd_token)
    N, C, L = len(fwd_rows), num_channels, ranks_per_node
    node, pos, token = _forwarded_records(ops, fwd_token, fwd_rows)
    M = node.shape[0]
    chan = _forwarded_channels(ops, node, token, source_tokens, C)
    reach = ops.bits(ops.i64(fwd_mask[node, pos]), L)  # [M, L]
    before = ops.cumsum(reach, 0) - reach  # records before each one reaching p, overall
    # the first record of each (node, channel) group (groups are contiguous)
    key = node * C + chan
    ones = ops.i32(ops.zeros(M) + 1)
    first = _exclusive_sum(ops, ops.add_rows(ops.zeros(N * C), key, ones))[key]
    return ops.contiguous(ops.where(reach > 0, before - before[first], -1))


class _LazyHandle(_Handle):
    """A dispatch handle tuple whose elements are made when first read (a dispatch
    pays nothing for them), from the core handle's tensors with torch on the
    current stream. ``.core`` is EPX's handle, which dispatch (cached) and
    combine take."""

    _own = ("core", "_lazy", "_cache", "_out")
    _size = 0
    _out: Callable[[Any], Any]
    _lazy: Dict[int, Callable[[], Any]]
    _cache: Dict[int, Any]

    def __new__(cls, core: "_core.DispatchHandle", out: Callable[[Any], Any],
                lazy: Callable[[Any], Dict[int, Callable[[], Any]]]) -> Any:
        if not isinstance(core, _core.DispatchHandle):
            raise TypeError(f"core: expected an epx._core.DispatchHandle, "
                            f"got {type(core).__name__}")
        self = super().__new__(cls, (None,) * cls._size)
        self.core = core
        self._out = out
        self._cache = {}
        self._lazy = lazy(self)
        return self

    def _tensor(self, name: str) -> Any:
        """One of the core handle's tensors (as ``out`` turns it into a torch.Tensor)."""
        return self._out(getattr(self.core, name))

    def _element(self, i: int) -> Any:
        if i not in self._cache:
            self._cache[i] = self._lazy[i]()
        return self._cache[i]

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return tuple(self._element(i) for i in range(*key.indices(len(self))))
        i = key.__index__()
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("handle index out of range")
        return self._element(i)

    def __iter__(self):
        return (self._element(i) for i in range(len(self)))

    # One handle is one dispatch's device state: equal only to itself (the
    # tuple's own slots are placeholders).
    def __eq__(self, other: Any) -> bool:
        return self is other

    def __ne__(self, other: Any) -> bool:
        return self is not other

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        c = self.core
        return (f"epx.{type(self).__name__}(num_ranks={c.num_ranks}, "
                f"num_tokens={c.num_tokens}, num_recv_tokens={c.num_recv_tokens}, "
                f"hidden={c.hidden})")


def _channel_count(num_channels: Union[int, Callable[[], int]]) -> Callable[[], int]:
    """What gives C (``num_channels`` itself, or what it returns when a channel element
    is first read: the dispatch passes its config's lookup, so a call pays nothing); a
    plain int is checked now."""
    def channels() -> int:
        c = num_channels() if callable(num_channels) else num_channels
        if c < 1:
            raise ValueError(f"num_channels: must be >= 1, got {c}")
        return c

    if not callable(num_channels):
        channels()
    return channels


class DispatchHandle(_LazyHandle):
    """An intranode dispatch's handle, DeepEP's 6-tuple (``C`` channels: the
    dispatch config's ``num_sms // 2``, as DeepEP):

    0. rank_prefix_matrix [R, R] int32: [i][j] = tokens ranks 0..i send to rank j;
    1. channel_prefix_matrix [R, C] int32: tokens this rank sends to r from its
       channels 0..c (channel c: tokens [c * w, (c + 1) * w), w = ceil(T / C));
    2. recv_channel_prefix_matrix [R, C] int32: source s's channel_prefix_matrix
       [rank][c - 1] (0 for c = 0), where its channel c's rows start in its block;
    3. recv_src_idx [N] int32: the source token of each received row;
    4. is_token_in_rank [T, R] bool;
    5. send_head [T, R] int32: a sent token's index among its channel's tokens to
       that rank, -1 where not sent (DeepEP's combine later rewrites those -1
       entries in place; EPX leaves them).

    0, 3 and 4 are EPX's own tensors; 1, 2 and 5 are derived from them with torch
    on the current stream (EPX's kernels do not use channels); each element is
    made when first read.
    ``.core`` is EPX's handle, which dispatch (cached) and combine take.
    """

    _size = 6

    def __new__(cls, core: "_core.DispatchHandle", rank: int,
                num_channels: Union[int, Callable[[], int]],
                out: Callable[[Any], Any]) -> "DispatchHandle":
        """``num_channels``: C, or what gives it when a channel element is first
        read."""
        channels = _channel_count(num_channels)
        return super().__new__(cls, core, out, lambda self: {
            0: lambda: self._tensor("rank_prefix_matrix"),
            1: lambda: channel_prefix_matrix(self[4], channels()),
            2: lambda: recv_channel_prefix_matrix(self[0], self[3],
                                                  self._tensor("source_num_tokens"), rank,
                                                  channels()),
            3: lambda: self._tensor("recv_src_idx"),
            4: lambda: self._tensor("is_token_in_rank"),
            5: lambda: send_head(self[4], self[1]),
        })


class InternodeDispatchHandle(_LazyHandle):
    """A dispatch's handle across nodes, DeepEP's internode 10-tuple (``C``
    channels: the config's ``num_sms // 2``; N nodes of L ranks; this rank is
    (m, l); reference.deepep_internode_handle states each element in loops):

    0. is_token_in_rank [T, R] bool;
    1. rdma_channel_prefix_matrix [N, C] int32: tokens of channels 0..c to node n;
    2. gbl_channel_prefix_matrix [R, C] int32: tokens of channels 0..c to rank r;
    3. recv_rdma_channel_prefix_matrix [N, C] int32: what this rank forwards from
       node s's rank (s, l), by that rank's channels 0..c;
    4. recv_rdma_rank_prefix_sum [N] int32: what it forwards from nodes 0..s;
    5. recv_gbl_channel_prefix_matrix [R, C] int32: the first row of recv_x of
       source r's channel c;
    6. recv_gbl_rank_prefix_sum [R] int32: rows from ranks 0..r (the end of each
       source's rows; DeepEP's test reads ``handle[-4]``);
    7. recv_src_meta [N_recv, 8] uint8: per row the int32 source node, then the
       int32 mask of this node's ranks its token reached;
    8. send_rdma_head [T, N] int32: a token's index among its channel's tokens
       to node n, -1 where it does not go there;
    9. send_nvl_head [M, L] int32: per forwarded record (M: element 4's last),
       its index among the records of its source node and channel that reach
       local rank p, -1 where it does not reach p.

    0 is EPX's own tensor, 3, 4, 7 and 9 come from what the kernels record
    (each forwarded record's token and mask, each row's mask), the rest are
    derived with torch; every prefix is inclusive except element 5's. DeepEP's
    combine rewrites the -1 entries of 8 and 9 in place; EPX leaves them.
    """

    _size = 10

    def __new__(cls, core: "_core.DispatchHandle", rank: int,
                num_channels: Union[int, Callable[[], int]],
                out: Callable[[Any], Any]) -> "InternodeDispatchHandle":
        channels = _channel_count(num_channels)
        L = core.ranks_per_node
        if L < 1 or core.num_ranks % L:
            raise ValueError(f"core: not the handle of a dispatch across nodes "
                             f"(ranks_per_node {L})")
        N, local = core.num_ranks // L, rank % L

        def elements(self: "InternodeDispatchHandle") -> Dict[int, Callable[[], Any]]:
            forwarded: List[List[int]] = []  # elements 3, 4 and 9 read it: made once

            def fwd_rows() -> List[int]:  # records of each node's source (s, l)
                if forwarded:
                    return forwarded[0]
                if core.net_worst == 0:  # from the host count exchange
                    to_node = core.net_tokens_to_node
                    rows = [to_node[(s * L + local) * N + rank // L] for s in range(N)]
                else:
                    # num_worst_tokens: the route table's first N ints, made on the GPU
                    # (copied on the current stream: .tolist() of a device tensor
                    # stalled in-process ranks, as a legacy-stream copy would)
                    rows = [int(v) for v in self._tensor("net_table")[:N].cpu().tolist()]
                forwarded.append(rows)
                return rows

            def source_tokens() -> Any:  # the token counts of those sources
                return self._tensor("source_num_tokens")[local::L]

            return {
                0: lambda: self._tensor("is_token_in_rank"),
                1: lambda: rdma_channel_prefix_matrix(self[0], channels(), L),
                2: lambda: channel_prefix_matrix(self[0], channels()),
                3: lambda: recv_rdma_channel_prefix_matrix(
                    self._tensor("net_fwd_token"), fwd_rows(), source_tokens(), channels()),
                4: lambda: recv_rdma_rank_prefix_sum(fwd_rows(), self[0]),
                5: lambda: recv_gbl_channel_prefix_matrix(
                    self[6], self._tensor("recv_src_idx"), self._tensor("source_num_tokens"),
                    channels()),
                6: lambda: self._tensor("rank_prefix_matrix")[:, rank].contiguous(),
                7: lambda: recv_src_meta(self._tensor("net_recv_meta"), L),
                8: lambda: send_rdma_head(self[0], self[1], L),
                9: lambda: send_nvl_head(self._tensor("net_fwd_mask"),
                                         self._tensor("net_fwd_token"), fwd_rows(),
                                         source_tokens(), channels(), L),
            }

        return super().__new__(cls, core, out, elements)


def core_dispatch_handle(op: str, handle: Any) -> "_core.DispatchHandle":
    """EPX's handle inside ``handle`` (a DispatchHandle or InternodeDispatchHandle
    tuple, or the core handle); a TypeError naming ``op`` and the argument
    otherwise."""
    return _core_of(op, handle, _LazyHandle, _core.DispatchHandle, "dispatch")


class EPHandle:
    """V2's dispatch handle.

    Attributes V2's callers read (docs/deepep_v2_api.md):
        do_expand: whether the dispatch returned the expanded layout.
        num_experts, expert_alignment, num_max_tokens_per_rank, num_sms: the dispatch's.
        topk_idx: [T, K] the dispatched top-k (a clone with do_handle_copy).
        num_recv_tokens: N, rows of the non-expanded recv_x (maxT x R without CPU sync).
        num_expanded_tokens: sum of num_recv_tokens_per_expert_list (V2's worst case
            without CPU sync); in expand mode the slots of recv_x.
        num_recv_tokens_per_expert_list: E_local ints rounded up to expert_alignment;
            empty without CPU sync.
        psum_num_recv_tokens_per_scaleup_rank: [scale-up ranks] int32 on the GPU,
            inclusive prefix sum of the rows from each scale-up peer; its last entry is
            the rows actually received (also without CPU sync).
        psum_num_recv_tokens_per_expert: [E_local] int32 on the GPU, inclusive prefix
            sum of the aligned per-expert counts (also without CPU sync); in expand
            mode each expert's aligned first slot plus its real count, as V2's.
        num_unaligned_recv_tokens_per_expert: [E_local] int32 real counts in expand
            mode, None otherwise (as V2).
        recv_src_metadata: [N, K + 2] int32 (made when first read): column 0 the source
            token's global index, src_rank * maxT + src_token (-1 for rows past the
            rows received); column 1 is V2's kernel bookkeeping, -1 in EPX; columns 2..
            in expand mode each (row, k) pair's slot in recv_x (-1 where the expert is
            not this rank's), else -1.
        dst_buffer_slot_idx, token_metadata_at_forward, channel_linked_list: None (V2's
            kernel state; EPX's lives in ``epx_handle``).
        epx_handle: EPX's V1 dispatch handle, which the combine uses.
    """

    def __init__(self, epx_handle: Any, num_experts: int, expert_alignment: int,
                 num_max_tokens_per_rank: int, num_sms: int, topk_idx: Any,
                 num_recv_tokens: int, num_expanded_tokens: int,
                 num_recv_tokens_per_expert_list: List[int],
                 psum_num_recv_tokens_per_scaleup_rank: Any,
                 psum_num_recv_tokens_per_expert: Any,
                 make_recv_src_metadata: Callable[[], Any],
                 expand_slots: Any = None,
                 num_unaligned_recv_tokens_per_expert: Any = None,
                 recv_topk_idx: Any = None) -> None:
        # expand_slots: [N, K] int32 slots of the expanded layout (None: non-expanded)
        # recv_topk_idx: [N, K] int64 the dispatch's local expert ids (-1 elsewhere), which
        # a cached dispatch returns again and masks the weights it carries with
        self.do_expand = expand_slots is not None
        self._recv_topk_idx = recv_topk_idx
        self.expand_slots = expand_slots
        self.epx_handle = epx_handle
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.dst_buffer_slot_idx = None
        self.token_metadata_at_forward = None
        self.channel_linked_list = None
        self._make_meta = make_recv_src_metadata
        self._meta = None

    @property
    def recv_src_metadata(self) -> Any:
        if self._meta is None:
            self._meta = self._make_meta()
        return self._meta

    @recv_src_metadata.setter
    def recv_src_metadata(self, value: Any) -> None:  # V2's test slices it in place
        self._meta = value

    def __repr__(self) -> str:
        return (f"epx.EPHandle(do_expand={self.do_expand}, num_experts={self.num_experts}, "
                f"num_recv_tokens={self.num_recv_tokens}, "
                f"expert_alignment={self.expert_alignment})")

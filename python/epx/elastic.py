"""epx.ElasticBuffer / epx.EPHandle: DeepEP V2's ``deep_ep.ElasticBuffer`` API on EPX.

V2's surface (docs/deepep_v2_api.md) served by EPX's V1 high-throughput path
(``epx.Buffer``): a non-expanded dispatch is ``get_dispatch_layout`` + ``dispatch``,
a combine is ``combine``, within one NVLink domain and across (virtual) nodes
wherever ``epx.Buffer`` runs. Signatures are V2's, name for name and default for
default. Every argument is either honoured, or refused with EPXUnsupportedError
naming it, or (a knob that changes only how data moves, never what a call
returns) warned about once with EPXIgnoredArgumentWarning, as epx.compat does for
V1. docs/deepep_v2_api.md's last section lists which is which and why.

Shapes: T tokens on this rank, H hidden, K top-k, R ranks, E experts
(E_local = E / R), N rows received, maxT = num_max_tokens_per_rank.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple, Union

from . import _core
from . import compat as _compat
from . import expand as _expand
from .config import Config
from .handles import EPHandle
from .in_process import InProcessComm
from .utils import EventHandle, EventOverlap, _event_of, _int, _torch

if TYPE_CHECKING:  # pragma: no cover
    import torch
    import torch.distributed as dist

#: V2's buffers are multiples of 2 MiB (its get_elastic_buffer_alignment()); EPX's size
#: hints are rounded up to it so that code adding V2-aligned areas keeps working.
BUFFER_ALIGNMENT = 2 << 20
#: V2's TMA-aligned column-major scales pad the row count to 16 bytes of 4-byte packs.
_SF_ROW_ALIGNMENT = 4
#: EPX's network contexts per peer across nodes unless EPX_PROXY_CHANNELS /
#: EPX_GIN_CONTEXTS say otherwise (docs/api.md): what get_theoretical_num_qps caps at.
_DEFAULT_NET_CONTEXTS = 4


def _value_error(msg: str) -> None:
    _core._raise(_core.ErrorCode.invalid_argument, msg)


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _group_size(group: Any) -> Tuple[int, int]:
    """(rank, size) of a torch ProcessGroup or an epx.InProcessComm."""
    if isinstance(group, InProcessComm):
        return group.Get_rank(), group.Get_size()
    if group is None or not hasattr(group, "size") or not hasattr(group, "rank"):
        raise TypeError(f"group: expected a torch.distributed ProcessGroup or an "
                        f"epx.InProcessComm, got {type(group).__name__}")
    return group.rank(), group.size()


def _ranks_per_node(group: Any) -> int:
    """Ranks of `group` per (virtual) node, as epx.Buffer will see them: EPX_RANKS_PER_NODE
    when set, else the ranks on this host (in-process ranks: all of them). Collective
    over a torch group (an all-gather of host names), as V2's helpers are."""
    _, size = _group_size(group)
    env = os.environ.get("EPX_RANKS_PER_NODE", "")
    if env:
        rpn = int(env)
    elif isinstance(group, InProcessComm):
        rpn = size
    else:
        import torch.distributed as dist

        names: List[Any] = [None] * size
        dist.all_gather_object(names, socket.gethostname(), group)
        rpn = names.count(socket.gethostname())
    if rpn < 1 or size % rpn:
        _value_error(f"group: {size} ranks do not split into nodes of {rpn} "
                     f"(EPX_RANKS_PER_NODE or ranks per host)")
    return rpn


def get_physical_domain_size(group: Any) -> Tuple[int, int]:
    """V2's ``deep_ep.get_physical_domain_size(group)``: (nodes, ranks per NVLink node)."""
    _, size = _group_size(group)
    rpn = _ranks_per_node(group)
    return size // rpn, rpn


def get_logical_domain_size(group: Any, allow_hybrid_mode: bool = True) -> Tuple[int, int]:
    """V2's ``deep_ep.get_logical_domain_size(group, allow_hybrid_mode)``: (scale-out
    ranks, scale-up ranks): the physical domains with hybrid mode, else (1, R)."""
    nodes, rpn = get_physical_domain_size(group)
    return (nodes, rpn) if allow_hybrid_mode else (1, nodes * rpn)


def _size_hint(num_ranks: int, ranks_per_node: int, num_max_tokens_per_rank: int, hidden: int,
               num_topk: int) -> int:
    """EPX's num_nvl_bytes for these sizes, rounded up to BUFFER_ALIGNMENT. The combine
    moves BF16 rows, so H x 2 bytes covers an FP8 dispatch (1 byte + 4 per 128) too."""
    k = num_topk if num_topk > 0 else 16  # V2's 0: unknown top-k; EPX's most is 16
    if ranks_per_node >= num_ranks:
        n = max(cfg.get_nvl_buffer_size_hint(hidden * 2, num_ranks, k)
                for cfg in (Config._wrap(_core.get_dispatch_config(num_ranks)),
                            Config._wrap(_core.get_combine_config(num_ranks))))
    else:
        n = _core.Buffer.get_internode_nvl_size_hint(num_max_tokens_per_rank, hidden, num_ranks,
                                                     ranks_per_node, k)
    return _align(n, BUFFER_ALIGNMENT)


def _experimental(name: str) -> None:
    _compat.unsupported(f"ElasticBuffer.{name}", name,
                        "DeepEP V2's experimental Engram / pipeline-parallel / AGRS features "
                        "are not provided by EPX (only dispatch and combine are)")


def _tma_col_major(sf: "torch.Tensor") -> "torch.Tensor":
    """[N, S] scales as V2's TMA-aligned column-major layout: the same values, column
    stride N rounded up to _SF_ROW_ALIGNMENT rows."""
    torch = _torch()
    n, s = sf.shape
    col = torch.empty_strided((n, s), (1, _align(max(n, 1), _SF_ROW_ALIGNMENT)),
                              dtype=sf.dtype, device=sf.device)
    return col.copy_(sf)


def _comm_stream_event(x: Any, inputs: Tuple[Any, ...]) -> EventOverlap:
    """The event of an asynchronous dispatch, recorded on the current (comm) stream
    after what EPX derived there; it keeps x and `inputs` alive until waited on."""
    return EventOverlap(EventHandle(), extra_tensors=tuple(
        t for t in (x if isinstance(x, tuple) else (x,)) + tuple(inputs) if t is not None))


def _record_on_current(rt: Any, made: Tuple[Any, ...]) -> None:
    """Tensors made on the comm stream and used on the caller's: recorded on it."""
    torch = _torch()
    current = torch.cuda.current_stream(rt._device)
    for t in made:
        if t is not None and t.device.type == "cuda":
            t.record_stream(current)


class ElasticBuffer:
    """DeepEP V2's ``deep_ep.ElasticBuffer`` on EPX (non-expanded dispatch and combine).

    ``group`` may also be an ``epx.InProcessComm`` (ranks as threads of one process,
    ``epx.run_in_process``; EPX's addition, with explicitly_destroy=True).

    Attributes (V2's): group, rank_idx, num_ranks, allow_hybrid_mode,
    allow_multiple_reduction, prefer_overlap_with_compute, deterministic, num_bytes,
    num_max_tokens_per_rank, num_allocated_qps, explicitly_destroy,
    num_scaleout_ranks, num_scaleup_ranks, scaleout_rank_idx, scaleup_rank_idx,
    num_rdma_ranks, num_nvlink_ranks; runtime: the ``epx.Buffer`` underneath
    (None after destroy).
    """

    def __init__(self,
                 group: "dist.ProcessGroup",
                 num_bytes: Optional[int] = None,
                 num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0,
                 hidden: int = 0,
                 num_topk: int = 0,
                 use_fp8_dispatch: bool = False,
                 deterministic: bool = False,
                 allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True,
                 sl_idx: int = 3,
                 num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False):
        op = "ElasticBuffer"
        # Checks that need neither torch nor a GPU come first.
        _compat.unsupported_unless_default(op, "num_cpu_bytes", num_cpu_bytes, 0,
                                           "EPX's buffers are GPU memory only (V2 uses CPU "
                                           "bytes for Engram storage, which EPX lacks)")
        if num_bytes is not None:
            _int("num_bytes", num_bytes, (1, 2**63 - 1))
        _int("num_max_tokens_per_rank", num_max_tokens_per_rank, (0, 2**31 - 1))
        _int("hidden", hidden, (0, 2**31 - 1))
        _int("num_topk", num_topk, (0, 2**31 - 1))
        if num_bytes is None and (num_max_tokens_per_rank <= 0 or hidden <= 0):
            _value_error(f"{op}: num_max_tokens_per_rank and hidden: both must be > 0 to size "
                         f"the buffer when num_bytes is None (got {num_max_tokens_per_rank}, "
                         f"{hidden})")
        _int("num_allocated_qps", num_allocated_qps, (0, 2**31 - 1))
        _int("num_cpu_timeout_secs", num_cpu_timeout_secs, (1, 2**31 - 1))
        _int("num_gpu_timeout_secs", num_gpu_timeout_secs, (1, 2**31 - 1))
        _int("sl_idx", sl_idx)
        _compat.ignored_unless_default(op, "sl_idx", sl_idx, 3,
                                       "has no effect: EPX does not set an RDMA service level")
        _compat.ignored_unless_default(op, "num_allocated_qps", num_allocated_qps, 0,
                                       "has no effect: EPX's network contexts per peer come "
                                       "from EPX_PROXY_CHANNELS / EPX_GIN_CONTEXTS")
        _compat.ignored_unless_default(op, "prefer_overlap_with_compute",
                                       prefer_overlap_with_compute, True,
                                       "has no effect: get_theoretical_num_sms returns EPX's "
                                       "default SM count either way")
        rank, size = _group_size(group)
        try:
            torch = _torch()
        except ImportError as e:
            raise ImportError(f"{op}: needs PyTorch with CUDA (pip install torch)") from e
        if not torch.cuda.is_available():
            raise RuntimeError(f"{op}: needs a CUDA GPU (torch.cuda.is_available() is False)")

        self.group = group
        self.rank_idx, self.num_ranks = rank, size
        self.allow_hybrid_mode = bool(allow_hybrid_mode)
        self.allow_multiple_reduction = bool(allow_multiple_reduction)
        self.prefer_overlap_with_compute = bool(prefer_overlap_with_compute)
        # EPX's dispatch returns rows by (source rank, token): the order V2's
        # deterministic mode sorts into; its combine sums in rank order. Both modes are that.
        self.deterministic = bool(deterministic)
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.explicitly_destroy = bool(explicitly_destroy)
        self.num_allocated_qps = num_allocated_qps or _DEFAULT_NET_CONTEXTS
        rpn = _ranks_per_node(group)
        if num_bytes is None:
            num_bytes = _size_hint(size, rpn, num_max_tokens_per_rank, hidden, num_topk)
        self.num_bytes = num_bytes
        comm = group if isinstance(group, InProcessComm) else None
        from .buffer import Buffer

        # EPX has one deadline for host and device waits: the longer of V2's two.
        self.runtime: Optional[Buffer] = Buffer(
            None if comm is not None else group, num_bytes, 0, explicitly_destroy=explicitly_destroy,
            comm=comm, timeout_s=float(max(num_cpu_timeout_secs, num_gpu_timeout_secs)),
            ranks_per_node=rpn if rpn < size else 0)
        self.num_rdma_ranks = self.runtime.get_num_rdma_ranks()
        self.num_nvlink_ranks = size // self.num_rdma_ranks
        if self.num_rdma_ranks > 1 and not self.allow_hybrid_mode:
            _compat.warn_ignored_once(op, "allow_hybrid_mode",
                                      "has no effect on the transport: EPX's path across nodes "
                                      "always forwards through the destination node's rank; the "
                                      "logical domain is (1, R) as V2 reports it")
        if self.num_rdma_ranks > 1 and not self.allow_multiple_reduction:
            if self.explicitly_destroy:
                self.runtime.destroy()
            self.runtime = None
            _compat.unsupported(op, "allow_multiple_reduction",
                                "False across nodes: EPX's combine across nodes rounds each "
                                "node's partial sum to BF16 before adding the nodes (V2's "
                                "multiple reduction); within one NVLink domain it reduces once")
        self.num_scaleout_ranks, self.num_scaleup_ranks = (
            (self.num_rdma_ranks, self.num_nvlink_ranks) if self.allow_hybrid_mode
            else (1, size))
        self.scaleout_rank_idx = rank // self.num_scaleup_ranks
        self.scaleup_rank_idx = rank % self.num_scaleup_ranks

    # ---- lifetime and sizes ---------------------------------------------------------------------

    def destroy(self) -> None:
        """Frees the buffer (collective); needs explicitly_destroy=True, as in V2."""
        if not self.explicitly_destroy:
            raise RuntimeError("ElasticBuffer.destroy: explicitly_destroy: pass "
                               "explicitly_destroy=True to ElasticBuffer() to use destroy()")
        if self.runtime is not None:
            self.runtime.destroy()
            self.runtime = None

    @staticmethod
    def get_buffer_size_hint(group: "dist.ProcessGroup",
                             num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int = 0, use_fp8_dispatch: bool = False,
                             allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """EPX's num_nvl_bytes for these sizes (a multiple of 2 MiB): within one node
        the larger of the default dispatch and combine configs' hints, across nodes
        ``epx.Buffer.get_internode_nvl_size_hint``. use_fp8_dispatch,
        allow_hybrid_mode and allow_multiple_reduction do not change EPX's size (BF16
        combine rows bound both dispatch kinds; one path across nodes)."""
        _int("num_max_tokens_per_rank", num_max_tokens_per_rank, (1, 2**31 - 1))
        _int("hidden", hidden, (1, 2**31 - 1))
        _int("num_topk", num_topk, (0, 2**31 - 1))
        _, size = _group_size(group)
        return _size_hint(size, _ranks_per_node(group), num_max_tokens_per_rank, hidden,
                          num_topk)

    @staticmethod
    def get_engram_storage_size_hint(num_entries: int, hidden: int,
                                     num_max_tokens_per_rank: int,
                                     dtype: "torch.dtype" = None) -> Tuple[int, int]:
        # V2's default dtype is torch.bfloat16; None here keeps the import torch-free.
        _experimental("get_engram_storage_size_hint")

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int,
                                num_max_inflight_tensors: int) -> int:
        _experimental("get_pp_buffer_size_hint")

    @staticmethod
    def get_agrs_num_max_session_bytes(group: "dist.ProcessGroup", shapes: Any,
                                       dtype: "torch.dtype") -> int:
        _experimental("get_agrs_num_max_session_bytes")

    @staticmethod
    def get_agrs_buffer_size_hint(group: "dist.ProcessGroup",
                                  num_max_session_bytes: int) -> int:
        _experimental("get_agrs_buffer_size_hint")

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int,
                                num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0,
                                sm_read_gbs: float = 200, sm_write_gbs: float = 50) -> int:
        """EPX's default SM count for R ranks: ``epx.Buffer.get_dispatch_config(R).num_sms``
        (``epx.Buffer.num_sms``, 20 unless ``set_num_sms`` changed it), whatever the
        routing. V2 models bandwidth instead; its model's inputs other than the
        defaults warn once (EPX has no bandwidth model)."""
        op = "ElasticBuffer.get_theoretical_num_sms"
        _int("num_experts", num_experts, (1, 2**31 - 1))
        _int("num_topk", num_topk, (1, 2**31 - 1))
        _compat.unsupported_unless_default(op, "num_scaleout_topk", num_scaleout_topk, 0,
                                           "group-limited gates are not modelled (V2 requires "
                                           "0 too)")
        for name, value, default in (("rdma_gbs", rdma_gbs, 0), ("nvlink_gbs", nvlink_gbs, 0),
                                     ("sm_read_gbs", sm_read_gbs, 200),
                                     ("sm_write_gbs", sm_write_gbs, 50)):
            _compat.ignored_unless_default(op, name, value, default,
                                           "has no effect: EPX returns its default config's SM "
                                           "count, not a bandwidth model's")
        return _core.get_dispatch_config(self.num_ranks).num_sms

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """0 within one NVLink domain (EPX moves no data over queue pairs there); across
        nodes min(num_sms, num_allocated_qps), num_allocated_qps being EPX's network
        contexts per peer (4) unless given."""
        _int("num_sms", num_sms, (0, 2**31 - 1))
        if self.num_rdma_ranks == 1:
            return 0
        return min(num_sms, self.num_allocated_qps)

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """(nodes, ranks per NVLink node), as epx.Buffer split the group."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """(scale-out ranks, scale-up ranks): the physical domains with allow_hybrid_mode,
        else (1, R)."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    # ---- streams and synchronization ------------------------------------------------------------

    def _rt(self) -> Any:
        if self.runtime is None:
            raise RuntimeError("ElasticBuffer: used after destroy()")
        return self.runtime

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False,
                sequential: bool = True) -> None:
        """Every rank's work issued before the call has finished when any rank returns.
        EPX has no GPU-side barrier kernel: it waits for this rank's current and
        communication streams, then meets the other ranks on the host. That is V2's
        ``with_cpu_sync=True`` barrier, which satisfies every combination of the three
        flags (they select V2's kernel and stream, not what is guaranteed)."""
        rt = self._rt()
        torch = _torch()
        torch.cuda.current_stream(rt._device).synchronize()
        rt.get_comm_stream().synchronize()
        rt.communicator.barrier()

    @staticmethod
    def capture() -> EventHandle:
        """An event recorded on ``torch.cuda.current_stream()``."""
        return EventHandle()

    def get_comm_stream(self) -> "torch.cuda.Stream":
        """The communication stream (a torch.cuda.ExternalStream)."""
        return self._rt().get_comm_stream()

    # ---- dispatch and combine -------------------------------------------------------------------

    def _config(self, kind: str, num_sms: int) -> Config:
        """The default config of the op with ``num_sms`` SMs."""
        get = _core.get_dispatch_config if kind == "dispatch" else _core.get_combine_config
        cfg = Config._wrap(get(self.num_ranks))
        cfg.num_sms = num_sms
        return cfg

    def _check_qps(self, op: str, num_sms: int, num_qps: int) -> None:
        _int("num_qps", num_qps, (0, 2**31 - 1))
        if num_qps > self.num_allocated_qps:
            _value_error(f"{op}: num_qps: {num_qps} is more than num_allocated_qps "
                         f"({self.num_allocated_qps})")
        if num_qps != 0 and num_qps != self.get_theoretical_num_qps(num_sms):
            _compat.warn_ignored_once(op, "num_qps", "has no effect: EPX's network contexts "
                                      "per peer are set when the buffer is made")

    def dispatch(self,
                 x: Union["torch.Tensor", Tuple["torch.Tensor", "torch.Tensor"]],
                 topk_idx: Optional["torch.Tensor"] = None,
                 topk_weights: Optional["torch.Tensor"] = None,
                 cumulative_local_expert_recv_stats: Optional["torch.Tensor"] = None,
                 num_experts: Optional[int] = None,
                 num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None,
                 num_sms: int = 0, num_qps: int = 0,
                 previous_event: Optional[EventHandle] = None,
                 previous_event_before_epilogue: Optional[EventHandle] = None,
                 async_with_compute_stream: bool = False,
                 allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None,
                 do_handle_copy: bool = True,
                 do_cpu_sync: Optional[bool] = None,
                 do_expand: bool = False,
                 do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False) \
            -> Tuple[Any, Optional["torch.Tensor"], Optional["torch.Tensor"], EPHandle,
                     EventOverlap]:
        """Sends each token to every rank that hosts one of its experts.

        Arguments: V2's (docs/deepep_v2_api.md). x: [T, H] rows, or (x [T, H]
        float8_e4m3fn, scales [T, S] float32 or int32 packs); topk_idx: [T, K] int64;
        topk_weights: [T, K] float32 or None; num_experts: E (required).

        Returns:
            recv_x [N, H] (or the pair, scales [N, S], column-major padded to 4 rows with
            use_tma_aligned_col_major_sf), recv_topk_idx [N, K] int64 local expert ids
            (-1 elsewhere), recv_topk_weights [N, K] float32 (0 where the id is -1) or None,
            EPHandle, EventOverlap (its event set only with async_with_compute_stream).
            N is the rows received, or maxT x R without CPU sync (rows past
            handle.psum_num_recv_tokens_per_scaleup_rank[-1] are not data; their
            recv_topk_idx is -1).

            With do_expand: recv_x [S, H] (and scales [S, S_f]) one slot per (token,
            local expert), grouped by expert, each group starting at a multiple of
            expert_alignment (epx.expand); recv_topk_idx None; recv_topk_weights [S]
            float32 or None. S = handle.num_expanded_tokens (V2's worst case without
            CPU sync); padding slots are zero whether or not do_zero_padding is set.
            EPX makes this layout from the non-expanded one with PyTorch operations on
            the stream the dispatch's outputs are made on.
        """
        op = "ElasticBuffer.dispatch"
        if do_expand and not self.allow_multiple_reduction:
            _compat.unsupported(op, "do_expand", "with allow_multiple_reduction=False: EPX's "
                                "expanded combine sums each rank's slots in float32 and "
                                "rounds to BF16 before adding the ranks (V2's multiple "
                                "reduction), not once over every slot")
        if do_zero_padding and not do_expand:
            _value_error(f"{op}: do_zero_padding: applies to the expanded layout only "
                         f"(pass do_expand=True)")
        _compat.unsupported_unless_default(op, "previous_event_before_epilogue",
                                           previous_event_before_epilogue, None,
                                           "EPX's dispatch has no separate copy epilogue to "
                                           "order; pass the event as previous_event")
        if handle is not None:
            return self._cached_dispatch(
                op, x, handle, topk_idx, topk_weights, cumulative_local_expert_recv_stats,
                num_experts, num_max_tokens_per_rank, expert_alignment, num_sms, num_qps,
                previous_event, async_with_compute_stream, allocate_on_comm_stream,
                do_cpu_sync, do_expand, use_tma_aligned_col_major_sf)
        if topk_idx is None:
            _value_error(f"{op}: topk_idx: required (no cached handle)")
        if num_experts is None:
            _value_error(f"{op}: num_experts: required (no cached handle)")
        num_experts = _int("num_experts", num_experts, (1, 2**31 - 1))
        if num_experts % self.num_ranks:
            _value_error(f"{op}: num_experts: {num_experts} is not a multiple of the "
                         f"{self.num_ranks} ranks")
        max_tokens = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None \
            else num_max_tokens_per_rank
        max_tokens = _int("num_max_tokens_per_rank", max_tokens, (1, 2**31 - 1))
        alignment = _int("expert_alignment", 1 if expert_alignment is None else expert_alignment,
                         (1, 2**31 - 1))
        _int("num_sms", num_sms, (0, 2**31 - 1))
        sync = True if do_cpu_sync is None else bool(do_cpu_sync)
        if isinstance(x, tuple) and len(x) != 2:
            raise ValueError(f"x: expected a tensor or a pair (x, sf), got a tuple of {len(x)}")
        rows, sf = x if isinstance(x, tuple) else (x, None)
        num_tokens, num_topk = rows.shape[0], topk_idx.shape[1]
        if num_tokens > max_tokens:
            _value_error(f"{op}: num_max_tokens_per_rank: x has {num_tokens} rows, more than "
                         f"{max_tokens}")
        if num_sms == 0:
            num_sms = self.get_theoretical_num_sms(num_experts, num_topk)
        self._check_qps(op, num_sms, num_qps)

        rt = self._rt()
        R, E_local = self.num_ranks, num_experts // self.num_ranks
        per_rank, per_rdma, per_expert, in_rank, _ = rt.get_dispatch_layout(
            topk_idx, num_experts, previous_event=previous_event)
        recv, recv_idx, recv_w, counts, v1_handle, event = rt.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
            topk_weights=topk_weights, expert_alignment=alignment,
            num_worst_tokens=0 if sync else max_tokens * R,
            config=self._config("dispatch", num_sms), previous_event=previous_event,
            async_finish=async_with_compute_stream,
            allocate_on_comm_stream=allocate_on_comm_stream)
        recv_x, recv_sf = recv if sf is not None else (recv, None)
        num_recv = recv_x.shape[0]  # rows of the non-expanded layout
        num_slots = sum(counts) if sync else _expand.worst_case_slots(
            R * max_tokens, num_topk, E_local, alignment)
        torch = _torch()

        # What EPX derives for V2's handle runs after the dispatch: on the comm stream when
        # the dispatch is asynchronous (the event returned is then recorded after it).
        ctx = torch.cuda.stream(rt.get_comm_stream()) if async_with_compute_stream \
            else contextlib.nullcontext()
        with ctx:
            prefix = v1_handle._tensor("rank_prefix_matrix")[:, self.rank_idx]  # [R] inclusive
            if self.num_scaleout_ranks > 1:  # per scale-up peer: sources of the same local index
                per_src = torch.diff(prefix, prepend=prefix.new_zeros(1))
                psum_peer = per_src.view(self.num_scaleout_ranks, self.num_scaleup_ranks) \
                    .sum(0).cumsum(0).to(torch.int32)
            else:
                psum_peer = prefix.contiguous()
            # received (token, local expert) pairs per expert; rows past the data are -1
            per_exp = _expand.count_pairs(recv_idx, E_local)
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(
                    per_exp.to(cumulative_local_expert_recv_stats.dtype))
            slots = unaligned = None
            kept_idx = recv_idx
            if not do_expand:
                psum_exp = _expand.align_counts(per_exp, alignment).cumsum(0).to(torch.int32)
            else:
                slots, psum_exp = _expand.layout(recv_idx, per_exp, alignment)
                unaligned = per_exp.to(torch.int32)
                recv_x = _expand.expand_rows(recv_x, slots, num_slots)
                if recv_sf is not None:
                    recv_sf = _expand.expand_rows(recv_sf, slots, num_slots)
                if recv_w is not None:
                    recv_w = _expand.expand_weights(recv_w, slots, num_slots)
                recv_idx = None
            if recv_sf is not None and use_tma_aligned_col_major_sf:
                recv_sf = _tma_col_major(recv_sf)
            kept = topk_idx.clone() if do_handle_copy else topk_idx
            if async_with_compute_stream:
                event = _comm_stream_event(x, (topk_idx, topk_weights))
        if async_with_compute_stream and not allocate_on_comm_stream:
            _record_on_current(rt, (psum_peer, psum_exp, recv_sf, kept, slots, unaligned) +
                               ((recv_x, recv_w) if do_expand else ()))

        if not sync:
            counts = []
        rank_idx = self.rank_idx

        def make_meta() -> Any:
            src_idx = v1_handle._tensor("recv_src_idx")[:num_recv].to(torch.int64)
            rows_i = torch.arange(num_recv, device=src_idx.device, dtype=torch.int64)
            ends = v1_handle._tensor("rank_prefix_matrix")[:, rank_idx].to(torch.int64)
            src_rank = torch.searchsorted(ends, rows_i, right=True)
            glob = torch.where(rows_i < ends[-1], src_rank * max_tokens + src_idx,
                               torch.full_like(src_idx, -1))
            meta = torch.full((num_recv, num_topk + 2), -1, dtype=torch.int32,
                              device=src_idx.device)
            meta[:, 0] = glob.to(torch.int32)
            if slots is not None:
                meta[:, 2:] = slots
            return meta

        new_handle = EPHandle(v1_handle, num_experts, alignment, max_tokens, num_sms, kept,
                              num_recv, num_slots, list(counts), psum_peer, psum_exp, make_meta,
                              expand_slots=slots,
                              num_unaligned_recv_tokens_per_expert=unaligned,
                              recv_topk_idx=kept_idx)
        recv_out = (recv_x, recv_sf) if sf is not None else recv_x
        return recv_out, recv_idx, recv_w, new_handle, event

    def _cached_dispatch(self, op: str, x: Any, handle: EPHandle, topk_idx: Any,
                         topk_weights: Any, stats: Any, num_experts: Optional[int],
                         num_max_tokens_per_rank: Optional[int],
                         expert_alignment: Optional[int], num_sms: int, num_qps: int,
                         previous_event: Optional[EventHandle], async_with_compute_stream: bool,
                         allocate_on_comm_stream: bool, do_cpu_sync: Optional[bool],
                         do_expand: bool, use_tma_aligned_col_major_sf: bool) \
            -> Tuple[Any, Optional["torch.Tensor"], Optional["torch.Tensor"], EPHandle,
                     EventOverlap]:
        """V2's cached dispatch: the routing, the row order and the sizes of `handle`'s
        dispatch, x (and topk_weights when given) sent again. EPX runs its V1 cached
        dispatch on x, then, with topk_weights, a second one on the weights padded to
        16-byte rows; recv_topk_idx is the handle's dispatch's (a copy). Returns the same
        five entries as dispatch, the handle itself fourth (as V2)."""
        if not isinstance(handle, EPHandle):
            raise TypeError(f"{op}: handle: expected the EPHandle a dispatch returned, got "
                            f"{type(handle).__name__}")
        if topk_idx is not None:
            _value_error(f"{op}: topk_idx: must be None with a cached handle (the handle's "
                         f"routing is reused)")
        if do_cpu_sync:
            _value_error(f"{op}: do_cpu_sync: a cached dispatch does not sync with the CPU "
                         f"(pass None or False with handle)")
        if stats is not None:
            _value_error(f"{op}: cumulative_local_expert_recv_stats: a cached dispatch does "
                         f"not count expert tokens (as V2); pass None with handle")
        for name, given, want in (("num_experts", num_experts, handle.num_experts),
                                  ("expert_alignment", expert_alignment,
                                   handle.expert_alignment),
                                  ("num_max_tokens_per_rank", num_max_tokens_per_rank,
                                   handle.num_max_tokens_per_rank)):
            if given is not None and given != want:
                _value_error(f"{op}: {name}: {given} differs from the cached handle's {want}")
        if bool(do_expand) != handle.do_expand:
            _value_error(f"{op}: do_expand: {bool(do_expand)} differs from the cached "
                         f"handle's layout (do_expand={handle.do_expand})")
        if isinstance(x, tuple) and len(x) != 2:
            raise ValueError(f"x: expected a tensor or a pair (x, sf), got a tuple of {len(x)}")
        rows = x[0] if isinstance(x, tuple) else x
        num_tokens, num_topk = handle.topk_idx.shape
        if rows.shape[0] != num_tokens:
            _value_error(f"{op}: x: has {rows.shape[0]} rows; the cached handle's dispatch "
                         f"sent {num_tokens}")
        if topk_weights is not None and tuple(topk_weights.shape) != (num_tokens, num_topk):
            _value_error(f"{op}: topk_weights: must be [{num_tokens}, {num_topk}] as the "
                         f"cached handle's top-k, got {tuple(topk_weights.shape)}")
        _int("num_sms", num_sms, (0, 2**31 - 1))
        num_sms = handle.num_sms if num_sms == 0 else num_sms
        self._check_qps(op, num_sms, num_qps)

        rt = self._rt()
        torch = _torch()
        cfg = self._config("dispatch", num_sms)
        recv, _, _, _, _, event = rt.dispatch(
            x, handle=handle.epx_handle, config=cfg, previous_event=previous_event,
            async_finish=async_with_compute_stream,
            allocate_on_comm_stream=allocate_on_comm_stream)
        recv_x, recv_sf = recv if isinstance(x, tuple) else (recv, None)
        recv_w = None
        if topk_weights is not None:
            # rows of 16-byte multiples, as every dispatched row must be
            padded = topk_weights.new_zeros((num_tokens, _align(num_topk, 4)),
                                            dtype=torch.float32)
            padded[:, :num_topk] = topk_weights
            got, _, _, _, _, event = rt.dispatch(
                padded, handle=handle.epx_handle, config=cfg,
                async_finish=async_with_compute_stream,
                allocate_on_comm_stream=allocate_on_comm_stream)
        ctx = torch.cuda.stream(rt.get_comm_stream()) if async_with_compute_stream \
            else contextlib.nullcontext()
        with ctx:
            idx = handle._recv_topk_idx
            if topk_weights is not None:  # 0 where the expert is not this rank's (as dispatch)
                recv_w = torch.where(idx >= 0, got[:, :num_topk], got.new_zeros(()))
            recv_idx = None
            if handle.do_expand:
                slots, n_slots = handle.expand_slots, handle.num_expanded_tokens
                recv_x = _expand.expand_rows(recv_x, slots, n_slots)
                if recv_sf is not None:
                    recv_sf = _expand.expand_rows(recv_sf, slots, n_slots)
                if recv_w is not None:
                    recv_w = _expand.expand_weights(recv_w, slots, n_slots)
            else:
                recv_idx = idx.clone()
            if recv_sf is not None and use_tma_aligned_col_major_sf:
                recv_sf = _tma_col_major(recv_sf)
            if async_with_compute_stream:
                event = _comm_stream_event(x, (topk_weights,))
        if async_with_compute_stream and not allocate_on_comm_stream:
            _record_on_current(rt, (recv_x, recv_sf, recv_w, recv_idx))
        recv_out = (recv_x, recv_sf) if recv_sf is not None else recv_x
        return recv_out, recv_idx, recv_w, handle, event

    def combine(self,
                x: "torch.Tensor",
                handle: EPHandle,
                topk_weights: Optional["torch.Tensor"] = None,
                bias: Union["torch.Tensor", Tuple["torch.Tensor", "torch.Tensor"]] = None,
                num_sms: int = 0, num_qps: int = 0,
                previous_event: EventHandle = None,
                previous_event_before_epilogue: Optional[EventHandle] = None,
                async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False) \
            -> Tuple["torch.Tensor", Optional["torch.Tensor"], EventOverlap]:
        """Sums each token's rows (one per rank it went to) back on its rank, plus bias.

        Arguments: x [N, H] bfloat16 in the dispatch's row order; handle: the dispatch's
        EPHandle; topk_weights [N, K] float32, summed like x (the received weights give
        each token its own back); bias: a [T, H] bfloat16 tensor or a pair of them.
        After an expanded dispatch: x [S, H] in slot order and topk_weights [S]; each
        row's slots are first summed in float32 in top-k order and rounded to BF16
        (V2's reduction within a rank), on the calling stream after previous_event,
        then combined as above.

        Returns: combined_x [T, H] bfloat16, combined_topk_weights [T, K] float32 or None,
        EventOverlap.
        """
        op = "ElasticBuffer.combine"
        _compat.unsupported_unless_default(op, "previous_event_before_epilogue",
                                           previous_event_before_epilogue, None,
                                           "EPX's combine has no separate reduce epilogue to "
                                           "order; pass the event as previous_event")
        if not isinstance(handle, EPHandle):
            raise TypeError(f"{op}: handle: expected the EPHandle dispatch returned, got "
                            f"{type(handle).__name__}")
        _int("num_sms", num_sms, (0, 2**31 - 1))
        num_sms = handle.num_sms if num_sms == 0 else num_sms
        self._check_qps(op, num_sms, num_qps)
        rt = self._rt()
        if handle.do_expand:
            _expand.check_expanded(op, "x", x, handle.num_expanded_tokens)
            if topk_weights is not None:
                if len(topk_weights.shape) != 1:
                    _value_error(f"{op}: topk_weights: must be 1-D [num_expanded_tokens] "
                                 f"after an expanded dispatch, got {tuple(topk_weights.shape)}")
                _expand.check_expanded(op, "topk_weights", topk_weights,
                                       handle.num_expanded_tokens)
            ev = _event_of(previous_event)
            if ev is not None:  # the fold below runs after it, then the combine
                EventHandle(ev).current_stream_wait()
                previous_event = None
            x = _expand.fold_rows(x, handle.expand_slots)
            if topk_weights is not None:
                topk_weights = _expand.fold_weights(topk_weights, handle.expand_slots)
        return rt.combine(x, handle.epx_handle, topk_weights=topk_weights, bias=bias,
                          config=self._config("combine", num_sms),
                          previous_event=previous_event,
                          async_finish=async_with_compute_stream,
                          allocate_on_comm_stream=allocate_on_comm_stream)

    # ---- V2's experimental features: not provided -----------------------------------------------

    def engram_write(self, storage: "torch.Tensor", sf: Optional["torch.Tensor"] = None) -> None:
        _experimental("engram_write")

    def engram_fetch(self, indices: "torch.Tensor", num_qps: int = 0,
                     use_tma_aligned_col_major_sf: bool = False) -> Callable:
        _experimental("engram_fetch")

    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int):
        _experimental("pp_set_config")

    def pp_send(self, t: "torch.Tensor", dst_rank_idx: int, num_sms: int = 0) -> None:
        _experimental("pp_send")

    def pp_recv(self, t: "torch.Tensor", src_rank_idx: int, num_sms: int = 0) -> None:
        _experimental("pp_recv")

    def create_agrs_session(self) -> None:
        _experimental("create_agrs_session")

    def destroy_agrs_session(self) -> None:
        _experimental("destroy_agrs_session")

    def agrs_new_session(self, enabled: bool = True):
        _experimental("agrs_new_session")

    def agrs_set_config(self, num_max_session_bytes: int,
                        num_max_all_gathers_per_session: int) -> None:
        _experimental("agrs_set_config")

    def agrs_get_inplace_tensor(self, shapes: Any, dtype: "torch.dtype") -> Any:
        _experimental("agrs_get_inplace_tensor")

    def all_gather(self, t: Union["torch.Tensor", Sequence["torch.Tensor"]]):
        _experimental("all_gather")

"""epx.Buffer: DeepEP V1's ``deep_ep.Buffer`` on the EPX core.

Shapes in docstrings: T tokens on this rank, H hidden, K top-k, R ranks,
E experts (E_local = E / R), N tokens received, maxT =
num_max_dispatch_tokens_per_rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from . import _core
from . import compat as _compat
from .config import Config, _core_config
from .handles import (DispatchHandle, InternodeDispatchHandle, LowLatencyHandle,
                      core_dispatch_handle, core_low_latency_handle)
from .in_process import InProcessComm
from .torch_glue import _TorchGlue
from .utils import INT64, EventHandle, EventOverlap, _event_of, _int, _wrap_event

if TYPE_CHECKING:  # pragma: no cover
    import torch
    import torch.distributed as dist

    TensorOrPair = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def _set_algorithm_options(opts: "_core.BufferOptions", ht_rings: Optional[int],
                           net_split_puts: Optional[bool], ll_arrival_order: Optional[bool],
                           ll_context_ranges: Optional[bool], ll_sms: Optional[int],
                           proxy_cumem: Optional[bool],
                           max_ops_in_flight: Optional[int]) -> "_core.BufferOptions":
    """Copies ``Buffer``'s algorithm keywords into ``opts`` (None stays unset: the
    field's environment variable, else its default); the rules are the C++
    ``BufferOptions::validate``'s, which the Buffer runs before anything else."""
    def opt_bool(v: Optional[bool]) -> Optional[bool]:
        return None if v is None else bool(v)

    opts.ht_rings = None if ht_rings is None else _int("ht_rings", ht_rings)
    opts.net_split_puts = opt_bool(net_split_puts)
    opts.ll_arrival_order = opt_bool(ll_arrival_order)
    opts.ll_context_ranges = opt_bool(ll_context_ranges)
    opts.ll_sms = None if ll_sms is None else _int("ll_sms", ll_sms)
    opts.proxy_cumem = opt_bool(proxy_cumem)
    opts.max_ops_in_flight = (None if max_ops_in_flight is None
                              else _int("max_ops_in_flight", max_ops_in_flight))
    return opts


class Buffer:
    """Communication buffers for expert-parallel Mixture-of-Experts layers (DeepEP V1 API).

    Supports the high-throughput intranode dispatch/combine (over NVLink) and the
    low-latency dispatch/combine. One process per GPU; every rank of the group
    makes the same calls in the same order.

    Attributes:
        num_sms: SMs used by the high-throughput kernels (class-wide, see ``set_num_sms``).
        rank: this rank in the group.
        group_size: number of ranks R.
        group: the torch.distributed process group.
        num_nvl_bytes / num_rdma_bytes: sizes of the high-throughput / low-latency buffers.
        runtime: the ``epx._core.Buffer``.
    """

    num_sms: int = _core.Buffer.num_sms()

    def __init__(self, group: Optional["dist.ProcessGroup"] = None, num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Any = None, *, allow_nvlink_for_normal_mode: bool = True,
                 eager_support: bool = False, backend: str = "auto",
                 timeout_s: float = 0.0, ranks_per_node: int = 0, proxy_engine: str = "auto",
                 fabric_provider: str = "", fabric_domains: str = "",
                 ht_rings: Optional[int] = None, net_split_puts: Optional[bool] = None,
                 ll_arrival_order: Optional[bool] = None,
                 ll_context_ranges: Optional[bool] = None, ll_sms: Optional[int] = None,
                 proxy_cumem: Optional[bool] = None,
                 max_ops_in_flight: Optional[int] = None) -> None:
        """Allocates the buffers; collective over ``group`` (or the mpi4py ``comm``).

        Arguments:
            group: torch.distributed group of the R ranks (the default group when None
                and torch.distributed is initialized).
            num_nvl_bytes: high-throughput buffer bytes (``Config.get_nvl_buffer_size_hint``).
            num_rdma_bytes: low-latency buffer bytes (``get_low_latency_rdma_size_hint``).
            low_latency_mode: whether low-latency kernels will be used.
            num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric:
                DeepEP's RDMA and memory settings; a value other than DeepEP's default
                warns once (``EPXIgnoredArgumentWarning``). num_qps_per_rank must be
                >= 1; across nodes it sets the network contexts per peer (proxy
                channels, NCCL GIN contexts; capped by EPX_PROXY_CHANNELS and
                EPX_GIN_CONTEXTS, 4 unless set, and by MAX_CONTEXTS, 32), within one
                NVLink domain nothing. DeepEP's tests pass num_experts // num_ranks,
                which can exceed 32: such a value counts as 32.
            explicitly_destroy: ``destroy()`` must be called to free the buffers; otherwise
                they are freed when the Buffer is garbage collected.
            enable_shrink: low-latency ops leave out the ranks this rank masks
                (``low_latency_update_mask_buffer``), and a low-latency wait that passes
                ``timeout_s`` masks its peer instead of failing the op.
            comm: an mpi4py communicator, used when ``group`` is None; or an
                ``epx.InProcessComm`` (ranks as threads of this process, see
                ``epx.run_in_process``).
            allow_nvlink_for_normal_mode: (DeepEP's hybrid-ep branch) False raises
                EPXUnsupportedError: EPX's high-throughput kernels run over NVLink.
            eager_support: (DeepEP's eager-rdma branch) True warns once: no effect.
            backend: EPX transport ("auto", "nvlink", "proxy" or, for in-process
                ranks, "in_process"; EPX_BACKEND overrides "auto", which picks "proxy"
                when the ranks form several nodes).
            ranks_per_node: ranks per (virtual) node, 1..8, dividing the rank count
                (0: EPX_RANKS_PER_NODE, else the ranks of a host). Fewer than a host
                holds splits it into virtual nodes: peers of other nodes are reached
                through the backend's network path only.
            proxy_engine: what carries the proxy backend's puts to other nodes: "auto"
                (EPX_PROXY_ENGINE, else "cuda_ipc" on one host and "libfabric" across
                hosts), "cuda_ipc" or "libfabric".
            fabric_provider: the libfabric engine's provider ("tcp;ofi_rxm", "shm",
                "verbs;ofi_rxm", "efa"; "": EPX_FABRIC_PROVIDER, else "tcp;ofi_rxm").
            fabric_domains: the libfabric engine's rails, libfabric domain names as
                `fi_info -p <provider>` prints them, comma-separated ("mlx5_0,mlx5_1");
                proxy channel c uses domain c % n ("": EPX_FABRIC_DOMAINS, else the
                provider's first domain). Every rank must name as many domains.
            timeout_s: how long a rank waits for its peers (0: EPX_TIMEOUT_S, else 60 s).

        Algorithm choices (``BufferOptions``; None: the environment variable named,
        else the default given; a bad value raises EPXError naming the keyword):
            ht_rings: which kernels the high-throughput ops across nodes take: -1 the
                whole-call kernels where their areas fit num_nvl_bytes, else the rings
                (default); 0 the whole-call kernels only; 1 always the rings; N in
                [2, 2^20] always rings of N records (EPX_HT_RINGS).
            net_split_puts: across nodes, share each node slot's put among the blocks of
                a kernel of its own (True) or leave it to one block (False); default: the
                backend decides (EPX_NET_SPLIT_PUTS).
            ll_arrival_order: the low-latency dispatch packs each expert's rows by source
                in the order the sources' masks arrive (experimental; default False,
                rank order; EPX_LL_ARRIVAL_ORDER).
            ll_context_ranges: across nodes, the low-latency ops put a contiguous range of
                tokens on each context instead of token t on context t % contexts
                (default False; EPX_LL_CONTEXT_RANGES).
            ll_sms: SMs the low-latency kernels use at most, >= 1 (default every SM;
                EPX_LL_SMS).
            proxy_cumem: the proxy's CUDA IPC engine uses cuMem regions and a CUDA
                context of its own; False: cudaMalloc regions with legacy CUDA IPC in the
                primary context (EPX_PROXY_CUMEM; default True with a process per rank
                and with more than 4 in-process ranks on a GPU, else False;
                docs/limitations.md).
            max_ops_in_flight: the low-latency ops (and the high-throughput ones across
                nodes) queued on the GPU at most when another is called, >= 0 (0: no
                bound); at the bound the call waits for the oldest, with the deadline
                (EPX_MAX_OPS_IN_FLIGHT; default: the backend's, docs/api.md).
        """
        op = "Buffer"
        _compat.ignored_unless_default(op, "num_qps_per_rank", num_qps_per_rank, 24,
                                       "has no effect within one NVLink domain; across nodes it "
                                       "sets the network contexts per peer (proxy channels, NCCL "
                                       "GIN contexts), at most EPX_PROXY_CHANNELS / "
                                       "EPX_GIN_CONTEXTS (4 unless set) and "
                                       f"{_core.MAX_CONTEXTS}")
        _compat.ignored_unless_default(
            op, "allow_nvlink_for_low_latency_mode", allow_nvlink_for_low_latency_mode, True,
            "has no effect: EPX's low-latency kernels reach the ranks of an NVLink domain "
            "over NVLink")
        _compat.ignored_unless_default(op, "allow_mnnvl", allow_mnnvl, False,
                                       "has no effect: EPX does not switch multi-node NVLink "
                                       "detection on or off")
        _compat.ignored_unless_default(op, "use_fabric", use_fabric, False,
                                       "has no effect: EPX's buffers come from ncclMemAlloc, "
                                       "which picks its own memory handles")
        _compat.ignored_unless_default(op, "eager_support", eager_support, False,
                                       "has no effect: EPX has no RDMA transport to make eager")
        _compat.unsupported_unless_default(op, "allow_nvlink_for_normal_mode",
                                           allow_nvlink_for_normal_mode, True,
                                           "EPX's high-throughput kernels run over NVLink only")
        if isinstance(comm, InProcessComm) and not explicitly_destroy:
            # Destruction is collective; from the garbage collector it would wait for the
            # other ranks' threads while holding the GIL they need.
            raise ValueError("explicitly_destroy: must be True for in-process ranks "
                             "(comm=InProcessComm): call destroy() on every rank's thread")
        glue = _TorchGlue.get()
        torch = glue.torch
        if group is None and comm is None:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise ValueError("Buffer: either 'group' or 'comm' must be provided")
            group = dist.group.WORLD
        if group is not None:
            import torch.distributed as dist

            self.rank, self.group_size = group.rank(), group.size()

            def all_gather_object(obj):
                objs = [None] * self.group_size
                dist.all_gather_object(objs, obj, group)
                return objs
        else:
            self.rank, self.group_size = comm.Get_rank(), comm.Get_size()
            all_gather_object = comm.allgather
        self.group = group
        self.num_nvl_bytes = _int("num_nvl_bytes", num_nvl_bytes, INT64)
        self.num_rdma_bytes = _int("num_rdma_bytes", num_rdma_bytes, INT64)
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.enable_shrink = bool(enable_shrink)

        self._glue = glue
        self._device = torch.device("cuda", torch.cuda.current_device())
        _core.cuda_set_device(self._device.index)  # EPX's CUDA runtime follows torch's device
        self._in_process = isinstance(comm, InProcessComm)
        if self._in_process:
            self.communicator = comm.communicator  # the ranks exist already
        else:
            unique_id = _core.new_unique_id() if self.rank == 0 else None
            unique_id = all_gather_object(unique_id)[0]
            self.communicator = _core.Communicator.create(unique_id, self.rank, self.group_size)

        opts = _core.BufferOptions()
        opts.num_nvl_bytes = self.num_nvl_bytes
        opts.num_rdma_bytes = self.num_rdma_bytes
        opts.low_latency_mode = self.low_latency_mode
        # A count of queue pairs to DeepEP (num_experts // num_ranks in its tests): EPX
        # makes at most MAX_CONTEXTS contexts per peer, whatever more is asked for.
        opts.num_qps_per_rank = min(_int("num_qps_per_rank", num_qps_per_rank),
                                    _core.MAX_CONTEXTS)
        opts.allow_nvlink_for_low_latency_mode = bool(allow_nvlink_for_low_latency_mode)
        opts.allow_mnnvl = bool(allow_mnnvl)
        opts.backend = backend
        opts.ranks_per_node = _int("ranks_per_node", ranks_per_node)
        opts.timeout_s = float(timeout_s)
        opts.enable_shrink = bool(enable_shrink)
        opts.proxy_engine = str(proxy_engine)
        opts.fabric_provider = str(fabric_provider)
        opts.fabric_domains = str(fabric_domains)
        _set_algorithm_options(opts, ht_rings, net_split_puts, ll_arrival_order,
                               ll_context_ranges, ll_sms, proxy_cumem, max_ops_in_flight)
        opts.allocator = glue.allocator(self._device)
        self.runtime: Optional[_core.Buffer] = _core.Buffer(self.communicator, opts)
        self._comm_stream = None

    # ---- lifetime and static helpers ------------------------------------------------------------

    def destroy(self) -> None:
        """Frees the buffers (collective). Needs ``explicitly_destroy=True``."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy: pass explicitly_destroy=True to Buffer() to use destroy()")
        if self.runtime is not None:
            self.runtime.destroy()
            self.runtime = None

    @staticmethod
    def is_sm90_compiled() -> bool:
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Sets the SMs the default high-throughput configs use (an even number)."""
        _core.Buffer.set_num_sms(_int("new_num_sms", new_num_sms))
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on ``torch.cuda.current_stream()``."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """Bytes of low-latency buffer (``num_rdma_bytes``) for these sizes (BF16 payloads)."""
        return _core.Buffer.get_low_latency_rdma_size_hint(
            _int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
            _int("hidden", hidden), _int("num_ranks", num_ranks), _int("num_experts", num_experts))

    @staticmethod
    def get_internode_nvl_size_hint(num_max_tokens: int, hidden: int, num_ranks: int,
                                    ranks_per_node: int, num_topk: int, *,
                                    ht_rings: Optional[int] = None) -> int:
        """``num_nvl_bytes`` that holds any high-throughput dispatch and combine across
        nodes of up to ``num_max_tokens`` tokens per rank (the first internode version
        sizes its areas for the whole call; this is its worst case). ``ht_rings``: the
        Buffer's (None: EPX_HT_RINGS, else -1), which decides whether the rings count."""
        return _core.Buffer.get_internode_nvl_size_hint(
            _int("num_max_tokens", num_max_tokens), _int("hidden", hidden),
            _int("num_ranks", num_ranks), _int("ranks_per_node", ranks_per_node),
            _int("num_topk", num_topk),
            None if ht_rings is None else _int("ht_rings", ht_rings))

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """The default dispatch Config for ``num_ranks`` ranks."""
        return Config._wrap(_core.get_dispatch_config(_int("num_ranks", num_ranks)))

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """The default combine Config for ``num_ranks`` ranks."""
        return Config._wrap(_core.get_combine_config(_int("num_ranks", num_ranks)))

    def get_local_device_id(self) -> int:
        """The CUDA device of this rank."""
        return self._rt().get_local_device_id()

    def get_num_rdma_ranks(self) -> int:
        """The number of (virtual) nodes, as DeepEP counts them: 1 within one NVLink
        domain, more when ``ranks_per_node`` splits the ranks."""
        return self._rt().get_num_rdma_ranks()

    @property
    def backend(self) -> str:
        """The transport this buffer runs on: "nvlink", "proxy", "nccl", "nvshmem" or
        "in_process" (what ``backend="auto"`` and ``EPX_BACKEND`` resolved to)."""
        return self._rt().backend_name

    def get_rdma_rank(self) -> int:
        """0: the index of this rank's node among the RDMA ranks (one)."""
        return self._rt().get_rdma_rank()

    def get_root_rdma_rank(self, global_: bool) -> int:
        """The rank that roots this rank's RDMA rank: this rank itself (``global_``),
        or index 0 within the node."""
        return self._rt().get_root_rdma_rank(bool(global_))

    def get_comm_stream(self) -> "torch.cuda.Stream":
        """The communication stream, as a ``torch.cuda.ExternalStream``."""
        if self._comm_stream is None:
            self._comm_stream = self._glue.torch.cuda.ExternalStream(
                self._rt().comm_stream, device=self._device)
        return self._comm_stream

    def get_local_buffer_tensor(self, dtype: "torch.dtype", size: Optional[Sequence[int]] = None,
                                offset: int = 0, use_rdma_buffer: bool = False) -> "torch.Tensor":
        """This rank's raw buffer as a tensor of ``dtype``, from byte ``offset``.

        ``size`` (a shape) takes the first ``prod(size)`` elements; ``use_rdma_buffer``
        selects the low-latency buffer instead of the high-throughput one.
        """
        torch = self._glue.torch
        raw = torch.from_dlpack(self._rt().local_buffer(bool(use_rdma_buffer)))
        raw = raw[_int("offset", offset, INT64):]
        n = raw.numel() // dtype.itemsize
        t = raw[: n * dtype.itemsize].view(dtype)
        if size is None:
            return t
        size = torch.Size(size)
        if size.numel() > t.numel():
            raise ValueError(f"size: {tuple(size)} needs {size.numel()} elements, the buffer "
                             f"holds {t.numel()} from offset {offset}")
        return t[: size.numel()].view(size)

    # ---- helpers --------------------------------------------------------------------------------

    def _settle(self, async_finish: bool) -> None:
        """In-process ranks: returns once this rank's op has finished, waiting with the
        GIL released. Otherwise a torch call that waits for the GPU while holding the
        GIL (``.cpu()``) could keep a peer's thread from launching its part of the op
        this rank's kernels wait for, until the deadline."""
        if not self._in_process:
            return
        torch = self._glue.torch
        if torch.cuda.is_current_stream_capturing():
            return  # captured work runs at replay; nothing to wait for here
        torch.cuda.current_stream(self._device).synchronize()
        if async_finish:
            self.get_comm_stream().synchronize()

    def _settled(self, hook: Optional[Callable[[], None]],
                 keep: Tuple[Any, ...] = ()) -> Optional[Callable[[], None]]:
        """The hook, holding `keep` (tensors its receive kernel writes, such as the
        statistics) alive as long as it lives. In-process ranks: it also waits (GIL
        released) for the receive it launches on the caller's stream, as _settle does
        for the ops."""
        if hook is None:
            return None
        keep = tuple(t for t in keep if t is not None)
        if not self._in_process and not keep:
            return hook
        torch = self._glue.torch
        stream = torch.cuda.current_stream(self._device) if self._in_process else None

        def run_and_settle(_keep: Tuple[Any, ...] = keep) -> None:
            hook()
            if stream is not None and not torch.cuda.is_current_stream_capturing():
                stream.synchronize()

        return run_and_settle

    def _rt(self) -> _core.Buffer:
        if self.runtime is None:
            raise RuntimeError("Buffer: used after destroy()")
        return self.runtime

    def _streams(self, previous_event, async_finish, allocate_on_comm_stream) -> _core.StreamArgs:
        s = _core.StreamArgs()
        s.stream = self._glue.current_stream(self._device)
        s.previous_event = _event_of(previous_event)
        s.async_finish = bool(async_finish)
        s.allocate_on_comm_stream = bool(allocate_on_comm_stream)
        return s

    def _record(self, async_finish: bool, allocate_on_comm_stream: bool, inputs, outputs) -> None:
        """record_stream for async ops: the comm stream may still use these tensors."""
        if not async_finish:
            return
        comm = self.get_comm_stream()
        # outputs made on the comm stream are used on the caller's stream, others on the comm stream
        target = comm
        if allocate_on_comm_stream:
            target = self._glue.torch.cuda.current_stream(self._device)
        for t in inputs:
            if t is not None:
                t.record_stream(comm)
        for t in outputs:
            if t is not None:
                t.record_stream(target)

    # ---- high-throughput ------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: "torch.Tensor", num_experts: int,
                            previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False
                            ) -> Tuple["torch.Tensor", None, "torch.Tensor", "torch.Tensor",
                                       EventOverlap]:
        """Counts what each rank and expert receives.

        Arguments:
            topk_idx: [T, K] int64 expert ids, -1 = no expert.
            num_experts: E, divisible by R.

        Returns:
            num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank ([nodes] int32: tokens
            with an expert in each node; None when the group is one node),
            num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, event.
        """
        g = self._glue
        streams = self._streams(previous_event, async_finish, allocate_on_comm_stream)
        r = self._rt().get_dispatch_layout(g.view("topk_idx", topk_idx),
                                           _int("num_experts", num_experts), streams)
        self._settle(async_finish)
        per_rank, per_expert = g.out(r.num_tokens_per_rank), g.out(r.num_tokens_per_expert)
        # per (virtual) node when the group spans several, as DeepEP's internode layout
        per_rdma = g.out(r.num_tokens_per_rdma_rank)
        in_rank = g.out(r.is_token_in_rank)
        self._record(async_finish, allocate_on_comm_stream, [topk_idx],
                     [per_rank, per_rdma, per_expert, in_rank])
        return per_rank, per_rdma, per_expert, in_rank, _wrap_event(r.event)

    def dispatch(self, x: "TensorOrPair", handle: Optional[DispatchHandle] = None,
                 num_tokens_per_rank: Optional["torch.Tensor"] = None,
                 num_tokens_per_rdma_rank: Optional["torch.Tensor"] = None,
                 is_token_in_rank: Optional["torch.Tensor"] = None,
                 num_tokens_per_expert: Optional["torch.Tensor"] = None,
                 topk_idx: Optional["torch.Tensor"] = None,
                 topk_weights: Optional["torch.Tensor"] = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False
                 ) -> Tuple["TensorOrPair", Optional["torch.Tensor"], Optional["torch.Tensor"],
                            Optional[List[int]], Optional[DispatchHandle], EventOverlap]:
        """Sends each token to every rank that hosts one of its experts.

        Arguments:
            x: [T, H] rows of any dtype, each a multiple of 16 bytes, or a pair ([T, H]
                float8_e4m3fn, [T, S] float32 or int32 scales, S >= 1: per 128 channels,
                per token, ...); recv_x comes back in x's dtype (scales in theirs).
            handle: a previous dispatch's handle: reuse its routing (cached dispatch;
                topk_idx/topk_weights and the layout tensors are then not needed).
            num_tokens_per_rank [R] int32, is_token_in_rank [T, R] bool,
            num_tokens_per_expert [E] int32: from ``get_dispatch_layout``.
            num_tokens_per_rdma_rank: across nodes, get_dispatch_layout's per-node counts
                (EPX derives them again from is_token_in_rank); within one node None (a
                tensor warns once and is ignored).
            topk_idx: [T, K] int64; topk_weights: [T, K] float32.
            expert_alignment: round each local expert's count up to a multiple of this.
            num_worst_tokens: > 0: no host synchronization; outputs have this many rows
                and ``num_recv_tokens_per_expert_list`` is empty.
            config: a Config, or None for ``get_dispatch_config(R)``.

        Returns:
            recv_x ([N, H], or the pair with [N, H/128] scales), recv_topk_idx [N, K]
            int64 (local expert ids, -1 for experts of other ranks), recv_topk_weights
            [N, K] float32, num_recv_tokens_per_expert_list (E_local ints), handle, event.
            A cached dispatch returns None for the four middle entries.
        """
        if num_tokens_per_rdma_rank is not None and self.get_num_rdma_ranks() == 1:
            _compat.warn_ignored_once("dispatch", "num_tokens_per_rdma_rank",
                                      "ignored: the ranks form one node "
                                      "(get_dispatch_layout returns None here)")
        g = self._glue
        if isinstance(x, tuple) and len(x) != 2:
            raise ValueError(f"x: expected a tensor or a pair (x, x_scales), got a tuple of "
                             f"{len(x)}")
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        core_handle = core_dispatch_handle("dispatch", handle) if handle is not None else None
        a = _core.DispatchArgs()
        a.x = g.rows("x", x)
        a.x_scales = g.opt_view("x_scales", x_scales)
        a.topk_idx = g.opt_view("topk_idx", topk_idx)
        a.topk_weights = g.opt_view("topk_weights", topk_weights)
        a.num_tokens_per_rank = g.opt_view("num_tokens_per_rank", num_tokens_per_rank)
        a.is_token_in_rank = g.opt_view("is_token_in_rank", is_token_in_rank)
        a.num_tokens_per_expert = g.opt_view("num_tokens_per_expert", num_tokens_per_expert)
        a.handle = core_handle
        a.expert_alignment = _int("expert_alignment", expert_alignment)
        a.num_worst_tokens = _int("num_worst_tokens", num_worst_tokens)
        a.config = _core_config(config)
        a.streams = self._streams(previous_event, async_finish, allocate_on_comm_stream)
        r = self._rt().dispatch(a)
        self._settle(async_finish)

        recv_x, recv_scales = g.restore(g.out(r.recv_x), x), g.out(r.recv_x_scales)
        recv_topk_idx, recv_topk_weights = g.out(r.recv_topk_idx), g.out(r.recv_topk_weights)
        if async_finish:
            made = r.handle
            extra = [g.out(t) for t in made.tensors] if made is not None else []
            self._record(True, allocate_on_comm_stream,
                         [x, x_scales, topk_idx, topk_weights, num_tokens_per_rank,
                          is_token_in_rank, num_tokens_per_expert],
                         [recv_x, recv_scales, recv_topk_idx, recv_topk_weights] + extra)
        recv = (recv_x, recv_scales) if x_scales is not None else recv_x
        event = _wrap_event(r.event)
        if handle is not None:
            return recv, None, None, None, None, event
        # DeepEP's tuple (its internode one across nodes); its channel elements count
        # config.num_sms // 2 channels.
        kind = InternodeDispatchHandle if r.handle.ranks_per_node > 0 else DispatchHandle
        new_handle = kind(
            r.handle, self.rank,
            lambda: max(1, (config if config is not None
                            else self.get_dispatch_config(self.group_size)).num_sms // 2),
            g.out)
        return (recv, recv_topk_idx, recv_topk_weights, list(r.num_recv_tokens_per_expert),
                new_handle, event)

    def combine(self, x: "torch.Tensor", handle: DispatchHandle,
                topk_weights: Optional["torch.Tensor"] = None,
                bias: Union["torch.Tensor", Tuple["torch.Tensor", "torch.Tensor"], None] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False
                ) -> Tuple["torch.Tensor", Optional["torch.Tensor"], EventOverlap]:
        """Sums each token's rows back on the rank that dispatched it (no weighting).

        Arguments:
            x: [N, H] bfloat16, rows in the order dispatch received them.
            handle: the handle returned by ``dispatch``.
            topk_weights: [N, K] float32, summed like x.
            bias: [T, H] bfloat16, or a pair of them, added to the result.
            config: a Config, or None for ``get_combine_config(R)``.

        Returns:
            combined_x [T, H] bfloat16, combined_topk_weights [T, K] float32 (None without
            topk_weights), event.
        """
        g = self._glue
        core_handle = core_dispatch_handle("combine", handle)
        if isinstance(bias, tuple):
            if len(bias) != 2:
                raise ValueError(f"bias: expected a tensor or a pair of tensors, got {len(bias)}")
            bias_0, bias_1 = bias
        else:
            bias_0, bias_1 = bias, None
        a = _core.CombineArgs()
        a.x = g.view("x", x)
        a.handle = core_handle
        a.topk_weights = g.opt_view("topk_weights", topk_weights)
        a.bias_0 = g.opt_view("bias_0", bias_0)
        a.bias_1 = g.opt_view("bias_1", bias_1)
        a.config = _core_config(config)
        a.streams = self._streams(previous_event, async_finish, allocate_on_comm_stream)
        r = self._rt().combine(a)
        self._settle(async_finish)
        combined_x, combined_w = g.out(r.combined_x), g.out(r.combined_topk_weights)
        self._record(async_finish, allocate_on_comm_stream, [x, topk_weights, bias_0, bias_1],
                     [combined_x, combined_w])
        return combined_x, combined_w, _wrap_event(r.event)

    def internode_dispatch(self, x: "TensorOrPair", handle: Optional[Any] = None,
                           num_tokens_per_rank: Optional["torch.Tensor"] = None,
                           num_tokens_per_rdma_rank: Optional["torch.Tensor"] = None,
                           is_token_in_rank: Optional["torch.Tensor"] = None,
                           num_tokens_per_expert: Optional["torch.Tensor"] = None,
                           topk_idx: Optional["torch.Tensor"] = None,
                           topk_weights: Optional["torch.Tensor"] = None, expert_alignment: int = 1,
                           num_worst_tokens: int = 0, config: Optional[Config] = None,
                           previous_event: Optional[EventOverlap] = None,
                           async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's internode dispatch (its ``dispatch`` calls it across nodes): the
        same as ``dispatch``, which serves groups across nodes itself; within one node
        raises EPXUnsupportedError, as DeepEP asserts."""
        if self.get_num_rdma_ranks() == 1:
            _compat.unsupported("internode_dispatch", "group",
                                "the ranks form one node; use dispatch()")
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                             is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                             expert_alignment, num_worst_tokens, config, previous_event,
                             async_finish, allocate_on_comm_stream)

    def internode_combine(self, x: "torch.Tensor", handle: Any,
                          topk_weights: Optional["torch.Tensor"] = None,
                          bias: Union["torch.Tensor", Tuple["torch.Tensor", "torch.Tensor"],
                                      None] = None,
                          config: Optional[Config] = None,
                          previous_event: Optional[EventOverlap] = None,
                          async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's internode combine: the same as ``combine`` across nodes; within one
        node raises EPXUnsupportedError (see ``internode_dispatch``)."""
        if self.get_num_rdma_ranks() == 1:
            _compat.unsupported("internode_combine", "group",
                                "the ranks form one node; use combine()")
        return self.combine(x, handle, topk_weights, bias, config, previous_event,
                            async_finish, allocate_on_comm_stream)

    # ---- low-latency ----------------------------------------------------------------------------

    def check(self) -> None:
        """Raises now what the next op would raise for the ops already run (a wait past
        its deadline, a peer with other shapes, a dead proxy channel). Reads host
        memory only: synchronize the ops' streams first to cover all of them."""
        self._rt().check()

    def network_traffic(self) -> Optional[Dict[str, int]]:
        """What the backend's network engine carried for this rank since the Buffer was
        made, as running totals: ``commands`` (requests its kernels posted), ``puts`` and
        ``put_bytes``, ``signals``, and ``writes`` (the engine's writes after merging
        neighbouring puts, what a NIC sees). None where the backend has no such engine
        (nvlink, in_process; today only the proxy counts). An op's figures are the
        difference around it, read with no op in flight."""
        t = self._rt().network_traffic()
        if t is None:
            return None
        return {k: int(getattr(t, k)) for k in ("commands", "puts", "put_bytes", "signals",
                                                "writes")}

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Resets the low-latency buffer (needed after high-throughput ops used it)."""
        self._rt().clean_low_latency_buffer(
            _int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
            _int("hidden", hidden), _int("num_experts", num_experts))

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Masks (mask=True) or unmasks a rank in this rank's mask (needs enable_shrink):
        low-latency ops store nothing to a masked rank and wait for nothing from it."""
        self._rt().low_latency_update_mask_buffer(_int("rank_to_mask", rank_to_mask), bool(mask),
                                                  self._glue.current_stream(self._device))

    def low_latency_query_mask_buffer(self, mask_status: "torch.Tensor") -> None:
        """Copies this rank's mask into ``mask_status`` ([R] int32 on this GPU; 1 = masked),
        in the current stream's order (needs enable_shrink)."""
        g = self._glue
        self._rt().low_latency_query_mask_buffer(g.view("mask_status", mask_status),
                                                 g.current_stream(self._device))

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmasks every rank (needs enable_shrink)."""
        self._rt().low_latency_clean_mask_buffer(self._glue.current_stream(self._device))

    def low_latency_dispatch(self, x: "torch.Tensor", topk_idx: "torch.Tensor",
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional["torch.Tensor"] = None,
                             dispatch_wait_recv_cost_stats: Optional["torch.Tensor"] = None,
                             use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False, *,
                             topk_weights: Optional["torch.Tensor"] = None,
                             x_global_scale: Optional["torch.Tensor"] = None,
                             use_nvfp4: bool = False, use_ue8m0_for_sf: bool = False,
                             use_eager: bool = False
                             ) -> Tuple["TensorOrPair", "torch.Tensor", LowLatencyHandle,
                                        EventOverlap, Optional[Callable[[], None]]]:
        """Sends tokens to their experts, packed per local expert (CUDA-graph friendly).

        Arguments:
            x: [T, H] bfloat16, T <= maxT; topk_idx: [T, K] int64, -1 = no expert.
            num_max_dispatch_tokens_per_rank: maxT, the same on every rank.
            num_experts: E.
            cumulative_local_expert_recv_stats: [E_local] int32, incremented by the counts.
            dispatch_wait_recv_cost_stats: [R] int64; entry s gets the nanoseconds the
                receive waited for rank s's token masks, summed over the local experts.
            use_fp8: quantize to float8_e4m3fn with per-128-channel scales.
            round_scale: power-of-two scales; use_ue8m0: pack them as UE8M0 (int32).
            return_recv_hook: send only; call the returned hook to receive.
            topk_weights, x_global_scale, use_nvfp4, use_ue8m0_for_sf: (DeepEP's hybrid-ep
                branch: NVFP4 dispatch, received weights) anything but the default raises
                EPXUnsupportedError naming the argument.
            use_eager: (DeepEP's eager-rdma branch) True warns once: no effect.

        Returns:
            recv_x: [E_local, R*maxT, H] bfloat16, or with use_fp8 the pair (float8 data,
                scales [E_local, R*maxT, H/128] float32 or [.., H/512] int32 with use_ue8m0;
                column-major in the last two dims); recv_count: [E_local] int32 valid rows
                per expert; handle: DeepEP's tuple (src_info, layout_range, maxT, hidden,
                E; ``epx.LowLatencyHandle``); event; hook (None without return_recv_hook).
        """
        op = "low_latency_dispatch"
        _compat.unsupported_unless_default(op, "topk_weights", topk_weights, None,
                                           "EPX's low-latency dispatch does not return "
                                           "received weights (DeepEP hybrid-ep's 7-tuple)")
        _compat.unsupported_unless_default(op, "x_global_scale", x_global_scale, None,
                                           "NVFP4 dispatch is not supported by EPX")
        _compat.unsupported_unless_default(op, "use_nvfp4", use_nvfp4, False,
                                           "NVFP4 dispatch is not supported by EPX")
        _compat.unsupported_unless_default(op, "use_ue8m0_for_sf", use_ue8m0_for_sf, False,
                                           "NVFP4 dispatch is not supported by EPX")
        _compat.ignored_unless_default(op, "use_eager", use_eager, False,
                                       "has no effect: EPX has no RDMA transport to make eager")
        g = self._glue
        a = _core.LowLatencyDispatchArgs()
        a.x = g.view("x", x)
        a.topk_idx = g.view("topk_idx", topk_idx)
        a.num_max_dispatch_tokens_per_rank = _int("num_max_dispatch_tokens_per_rank",
                                                  num_max_dispatch_tokens_per_rank)
        a.num_experts = _int("num_experts", num_experts)
        a.cumulative_local_expert_recv_stats = g.opt_view("cumulative_local_expert_recv_stats",
                                                          cumulative_local_expert_recv_stats)
        a.dispatch_wait_recv_cost_stats = g.opt_view("dispatch_wait_recv_cost_stats",
                                                     dispatch_wait_recv_cost_stats)
        a.use_fp8, a.round_scale, a.use_ue8m0 = bool(use_fp8), bool(round_scale), bool(use_ue8m0)
        a.async_finish, a.return_recv_hook = bool(async_finish), bool(return_recv_hook)
        a.stream = g.current_stream(self._device)
        r = self._rt().low_latency_dispatch(a)
        self._settle(async_finish)
        recv_x, recv_scales = g.out(r.recv_x), g.out(r.recv_x_scales)
        recv_count = g.out(r.recv_count)
        core = r.handle
        handle = LowLatencyHandle(core, g.out(core.src_info), g.out(core.layout_range))
        extra = None
        if async_finish:
            extra = (x, topk_idx, recv_x, recv_scales, recv_count,
                     cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                     *[g.out(t) for t in core.tensors])
        recv = (recv_x, recv_scales) if use_fp8 else recv_x
        hook = self._settled(r.hook, (cumulative_local_expert_recv_stats,
                                      dispatch_wait_recv_cost_stats))
        return recv, recv_count, handle, _wrap_event(r.event, extra), hook

    def low_latency_combine(self, x: "torch.Tensor", topk_idx: "torch.Tensor",
                            topk_weights: "torch.Tensor", handle: LowLatencyHandle,
                            use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional["torch.Tensor"] = None,
                            combine_wait_recv_cost_stats: Optional["torch.Tensor"] = None, *,
                            overlap: bool = False,
                            packed_recv_count: Optional["torch.Tensor"] = None,
                            comp_signal: Optional["torch.Tensor"] = None, block_m: int = 64,
                            threshold: int = 0, num_sms: int = 3,
                            src_signals: Optional["torch.Tensor"] = None,
                            src_signal_expect_value: int = 0, use_eager: bool = False
                            ) -> Tuple["torch.Tensor", EventOverlap, Optional[Callable[[], None]]]:
        """Returns each token's experts' outputs, weighted and summed, to its rank.

        Arguments:
            x: [E_local, R*maxT, H] bfloat16 expert outputs in the packed dispatch order.
            topk_idx: [T, K] int64 and topk_weights: [T, K] float32 of the dispatch.
            handle: the handle returned by ``low_latency_dispatch``.
            use_logfmt: send what crosses from each rank in EPX's LogFMT (10-bit
                log-domain codes in groups of 128, 168 bytes per group instead of 256,
                ``epx.reference``, docs/reference.md): a raw expert row, or the rank's
                float32 weighted sum of several experts, coded once; not bit-compatible
                with DeepEP's LogFMT (groups of 64, each expert row coded).
            zero_copy: x was written into ``get_next_low_latency_combine_buffer(handle)``.
            out: [T, H] bfloat16 to write the result into.
            combine_wait_recv_cost_stats: [R] int64; entry s gets, once per call, the
                nanoseconds until rank s was seen to begin its combine.
            overlap: (DeepEP's antgroup-opt and hybrid-ep branches: the combine's send
                overlapped with the expert GEMM through signals) True raises
                EPXUnsupportedError. packed_recv_count, comp_signal, block_m, threshold,
                num_sms, src_signals, src_signal_expect_value configure that overlap and,
                as in DeepEP, have no effect without it.
            use_eager: (DeepEP's eager-rdma branch) True warns once: no effect.

        Returns:
            combined_x [T, H] bfloat16 (``out`` when given), event, hook.
        """
        op = "low_latency_combine"
        _compat.unsupported_unless_default(op, "overlap", overlap, False,
                                           "a combine overlapped with the expert GEMM is not "
                                           "supported by EPX")
        _compat.ignored_unless_default(op, "use_eager", use_eager, False,
                                       "has no effect: EPX has no RDMA transport to make eager")
        g = self._glue
        core = core_low_latency_handle(op, handle)
        a = _core.LowLatencyCombineArgs()
        a.x = g.view("x", x)
        a.topk_idx = g.view("topk_idx", topk_idx)
        a.topk_weights = g.view("topk_weights", topk_weights)
        a.handle = core
        a.use_logfmt, a.zero_copy = bool(use_logfmt), bool(zero_copy)
        a.async_finish, a.return_recv_hook = bool(async_finish), bool(return_recv_hook)
        a.out = g.opt_view("out", out)
        a.combine_wait_recv_cost_stats = g.opt_view("combine_wait_recv_cost_stats",
                                                    combine_wait_recv_cost_stats)
        a.stream = g.current_stream(self._device)
        r = self._rt().low_latency_combine(a)
        self._settle(async_finish)
        combined_x = out if out is not None else g.out(r.combined_x)
        extra = ((x, topk_idx, topk_weights, combined_x, combine_wait_recv_cost_stats)
                 if async_finish else None)
        return (combined_x, _wrap_event(r.event, extra),
                self._settled(r.hook, (combine_wait_recv_cost_stats,)))

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> "torch.Tensor":
        """[E_local, R*maxT, H] bfloat16 view of the buffer the next zero-copy combine reads."""
        core = core_low_latency_handle("get_next_low_latency_combine_buffer", handle)
        return self._glue.out(self._rt().get_next_low_latency_combine_buffer(core))

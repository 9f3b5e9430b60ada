"""DeepEP V2's API (deep_ep.ElasticBuffer, EPHandle) on EPX, without a GPU or PyTorch.

The names are importable from deep_ep and epx; every signature equals DeepEP V2's
(deepseek-ai/DeepEP deep_ep/buffers/elastic.py, 2.1.0), written down below from
reading it (docs/deepep_v2_api.md); each argument EPX cannot honour raises
EPXUnsupportedError naming it, and the experimental methods raise naming
themselves. An ElasticBuffer is driven without a GPU as tests/python/test_fuzz.py
drives epx.Buffer: made with object.__new__, with a runtime stand-in that stops
the call where EPX's kernels would start (so an accepted call is seen to get
there, a refused one to stop before).
"""

import inspect
import types
import warnings

import pytest

import deep_ep
import epx
from epx import compat, elastic

# ---- DeepEP V2's signatures, as read in its source (parameters only; annotations left out) ----
# "BF16" stands for V2's default torch.bfloat16 (see test_signatures_are_v2s).
V2_SIGNATURES = {
    "__init__": "self, group, num_bytes=None, num_cpu_bytes=0, num_max_tokens_per_rank=0, "
                "hidden=0, num_topk=0, use_fp8_dispatch=False, deterministic=False, "
                "allow_hybrid_mode=True, allow_multiple_reduction=True, "
                "prefer_overlap_with_compute=True, sl_idx=3, num_allocated_qps=0, "
                "num_cpu_timeout_secs=300, num_gpu_timeout_secs=100, explicitly_destroy=False",
    "destroy": "self",
    "get_buffer_size_hint": "group, num_max_tokens_per_rank, hidden, num_topk=0, "
                            "use_fp8_dispatch=False, allow_hybrid_mode=True, "
                            "allow_multiple_reduction=True",
    "get_engram_storage_size_hint": "num_entries, hidden, num_max_tokens_per_rank, dtype=BF16",
    "get_pp_buffer_size_hint": "num_max_tensor_bytes, num_max_inflight_tensors",
    "get_agrs_num_max_session_bytes": "group, shapes, dtype",
    "get_agrs_buffer_size_hint": "group, num_max_session_bytes",
    "barrier": "self, use_comm_stream=True, with_cpu_sync=False, sequential=True",
    "capture": "",
    "get_comm_stream": "self",
    "get_physical_domain_size": "self",
    "get_logical_domain_size": "self",
    "engram_write": "self, storage, sf=None",
    "engram_fetch": "self, indices, num_qps=0, use_tma_aligned_col_major_sf=False",
    "pp_set_config": "self, num_max_tensor_bytes, num_max_inflight_tensors",
    "pp_send": "self, t, dst_rank_idx, num_sms=0",
    "pp_recv": "self, t, src_rank_idx, num_sms=0",
    "create_agrs_session": "self",
    "destroy_agrs_session": "self",
    "agrs_new_session": "self, enabled=True",
    "agrs_set_config": "self, num_max_session_bytes, num_max_all_gathers_per_session",
    "agrs_get_inplace_tensor": "self, shapes, dtype",
    "all_gather": "self, t",
    "get_theoretical_num_sms": "self, num_experts, num_topk, num_scaleout_topk=0, rdma_gbs=0, "
                               "nvlink_gbs=0, sm_read_gbs=200, sm_write_gbs=50",
    "get_theoretical_num_qps": "self, num_sms",
    "dispatch": "self, x, topk_idx=None, topk_weights=None, "
                "cumulative_local_expert_recv_stats=None, num_experts=None, "
                "num_max_tokens_per_rank=None, expert_alignment=None, num_sms=0, num_qps=0, "
                "previous_event=None, previous_event_before_epilogue=None, "
                "async_with_compute_stream=False, allocate_on_comm_stream=False, handle=None, "
                "do_handle_copy=True, do_cpu_sync=None, do_expand=False, do_zero_padding=False, "
                "use_tma_aligned_col_major_sf=False",
    "combine": "self, x, handle, topk_weights=None, bias=None, num_sms=0, num_qps=0, "
               "previous_event=None, previous_event_before_epilogue=None, "
               "async_with_compute_stream=False, allocate_on_comm_stream=False",
}
V2_STATIC = {"get_buffer_size_hint", "get_engram_storage_size_hint", "get_pp_buffer_size_hint",
             "get_agrs_num_max_session_bytes", "get_agrs_buffer_size_hint", "capture"}
V2_MODULE_FUNCTIONS = {
    "get_physical_domain_size": "group",
    "get_logical_domain_size": "group, allow_hybrid_mode=True",
}
EXPERIMENTAL = ["engram_write", "engram_fetch", "pp_set_config", "pp_send", "pp_recv",
                "create_agrs_session", "destroy_agrs_session", "agrs_new_session",
                "agrs_set_config", "agrs_get_inplace_tensor", "all_gather"]
EXPERIMENTAL_STATIC = ["get_engram_storage_size_hint", "get_pp_buffer_size_hint",
                       "get_agrs_num_max_session_bytes", "get_agrs_buffer_size_hint"]


def _params(text):
    """[(name, kind, default)] of a parameter list written as Python source."""
    ns = {"BF16": "BF16"}
    exec(f"def f({text}): pass", ns)
    return [(p.name, p.kind, p.default) for p in inspect.signature(ns["f"]).parameters.values()]


def _actual(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_names_import_from_deep_ep_and_epx():
    from deep_ep import (EPHandle, Buffer, Config, ElasticBuffer, EventHandle,  # noqa: F401
                         EventOverlap, get_logical_domain_size, get_physical_domain_size)

    assert deep_ep.ElasticBuffer is epx.ElasticBuffer is elastic.ElasticBuffer
    assert deep_ep.EPHandle is epx.EPHandle is elastic.EPHandle
    assert deep_ep.get_physical_domain_size is epx.get_physical_domain_size
    assert deep_ep.get_logical_domain_size is epx.get_logical_domain_size
    assert deep_ep.EventOverlap is epx.EventOverlap and deep_ep.EventHandle is epx.EventHandle
    for name in ("ElasticBuffer", "EPHandle", "get_physical_domain_size",
                 "get_logical_domain_size"):
        assert hasattr(deep_ep, name) and name in deep_ep.__all__ and name in epx.__all__
    # vLLM's has_deep_ep_v2() and SGLang's import probe
    assert hasattr(deep_ep, "ElasticBuffer")
    # V1's Buffer stays beside it
    assert deep_ep.Buffer is epx.Buffer and deep_ep.Buffer is not deep_ep.ElasticBuffer


def test_signatures_are_v2s():
    for name, text in V2_SIGNATURES.items():
        fn = getattr(epx.ElasticBuffer, name)
        want = _params(text)
        got = _actual(fn)
        if name == "get_engram_storage_size_hint":
            # EPX's default is None (epx imports without torch), standing for torch.bfloat16;
            # the method raises anyway (experimental).
            assert got[-1][:2] == want[-1][:2] and got[-1][2] is None
            got, want = got[:-1], want[:-1]
        assert got == want, name
        is_static = isinstance(inspect.getattr_static(epx.ElasticBuffer, name), staticmethod)
        assert is_static == (name in V2_STATIC), name
    for name, text in V2_MODULE_FUNCTIONS.items():
        assert _actual(getattr(deep_ep, name)) == _params(text), name
    # every public method of EPX's ElasticBuffer is one of V2's
    public = {n for n in vars(epx.ElasticBuffer) if not n.startswith("_")}
    assert public <= set(V2_SIGNATURES), public - set(V2_SIGNATURES)
    assert set(V2_SIGNATURES) - {"__init__"} <= public


# ---- a buffer without a GPU ---------------------------------------------------------------------

class Launched(Exception):
    """The call passed every check and reached EPX's epx.Buffer."""


class T:
    """A tensor stand-in: what the checks read before any kernel (the shape)."""

    def __init__(self, *shape):
        self.shape = shape


class StopRuntime:
    """epx.Buffer's part ElasticBuffer calls: stops where EPX's kernels would start."""

    def get_dispatch_layout(self, *a, **k):
        raise Launched("dispatch")

    def dispatch(self, *a, **k):  # a cached dispatch skips the layout
        raise Launched("dispatch")

    def combine(self, *a, **k):
        raise Launched("combine")


def bare(num_ranks=4, nodes=1, max_tokens=64):
    buf = object.__new__(epx.ElasticBuffer)
    buf.num_ranks, buf.rank_idx = num_ranks, 0
    buf.num_max_tokens_per_rank = max_tokens
    buf.num_allocated_qps = 4
    buf.num_rdma_ranks, buf.num_nvlink_ranks = nodes, num_ranks // nodes
    buf.num_scaleout_ranks, buf.num_scaleup_ranks = nodes, num_ranks // nodes
    buf.allow_multiple_reduction = True
    buf.runtime = StopRuntime()
    return buf


def dispatch_args(**over):
    a = dict(x=T(16, 128), topk_idx=T(16, 4), topk_weights=T(16, 4), num_experts=16)
    a.update(over)
    return a


def test_accepted_dispatch_and_combine_reach_epx():
    buf = bare()
    with pytest.raises(Launched, match="dispatch"):
        buf.dispatch(**dispatch_args())
    # what vLLM's decode path and SGLang pass (num_qps from get_theoretical_num_qps)
    with pytest.raises(Launched, match="dispatch"):
        buf.dispatch(**dispatch_args(do_cpu_sync=False, do_expand=False,
                                     async_with_compute_stream=False,
                                     num_max_tokens_per_rank=16))
    sms = buf.get_theoretical_num_sms(16, 4)
    with pytest.raises(Launched, match="dispatch"):
        buf.dispatch(**dispatch_args(expert_alignment=128, num_sms=sms,
                                     num_qps=buf.get_theoretical_num_qps(sms),
                                     use_tma_aligned_col_major_sf=True))
    # the expanded layout (SGLang's decode), with and without CPU sync
    for sync in (True, False):
        with pytest.raises(Launched, match="dispatch"):
            buf.dispatch(**dispatch_args(do_expand=True, do_zero_padding=True,
                                         do_cpu_sync=sync, expert_alignment=128))
    handle = bare_handle()
    with pytest.raises(Launched, match="combine"):
        buf.combine(T(8, 128), handle, topk_weights=None)


def bare_handle(num_expanded_tokens=None):
    """An EPHandle with what combine reads before EPX runs (expanded with a slot count)."""
    handle = object.__new__(epx.EPHandle)
    handle.num_sms, handle.epx_handle = 20, None
    handle.do_expand = num_expanded_tokens is not None
    handle.num_expanded_tokens = num_expanded_tokens
    return handle


def test_expanded_combine_inputs_are_checked_against_the_handle():
    buf = bare()
    with pytest.raises(epx.EPXValueError, match=r"combine: x: has 8 rows; .* 12 slots"):
        buf.combine(T(8, 128), bare_handle(12))
    with pytest.raises(epx.EPXValueError, match=r"combine: topk_weights: must be 1-D"):
        buf.combine(T(12, 128), bare_handle(12), topk_weights=T(12, 4))
    with pytest.raises(epx.EPXValueError, match=r"combine: topk_weights: has 11 rows"):
        buf.combine(T(12, 128), bare_handle(12), topk_weights=T(11))


def test_expanding_without_multiple_reduction_is_refused():
    buf = bare()
    buf.allow_multiple_reduction = False
    with pytest.raises(epx.EPXUnsupportedError,
                       match=r"dispatch: do_expand: with allow_multiple_reduction=False"):
        buf.dispatch(**dispatch_args(do_expand=True))
    with pytest.raises(Launched):  # the non-expanded layout reduces once within a node
        buf.dispatch(**dispatch_args())


def test_zero_padding_without_the_expanded_layout_is_refused():
    with pytest.raises(epx.EPXValueError, match=r"dispatch: do_zero_padding: .*do_expand=True"):
        bare().dispatch(**dispatch_args(do_zero_padding=True))


@pytest.mark.parametrize("arg, value, words", [
    ("previous_event_before_epilogue", object(), "no separate copy epilogue"),
])
def test_unsupported_dispatch_arguments_raise_naming_them(arg, value, words):
    with pytest.raises(epx.EPXUnsupportedError, match=rf"dispatch: {arg}: .*{words}"):
        bare().dispatch(**dispatch_args(**{arg: value}))


def cached_handle(do_expand=False, tokens=16, topk=4):
    """An EPHandle with what a cached dispatch checks before EPX runs."""
    handle = bare_handle(12 if do_expand else None)
    handle.topk_idx = T(tokens, topk)
    handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank = 16, 1, 64
    return handle


@pytest.mark.parametrize("over, match", [
    (dict(topk_idx=T(16, 4)), r"topk_idx: must be None with a cached handle"),
    (dict(do_cpu_sync=True), r"do_cpu_sync: a cached dispatch does not sync"),
    (dict(cumulative_local_expert_recv_stats=T(4)),
     r"cumulative_local_expert_recv_stats: a cached dispatch does not count"),
    (dict(num_experts=32), r"num_experts: 32 differs from the cached handle's 16"),
    (dict(expert_alignment=4), r"expert_alignment: 4 differs from the cached handle's 1"),
    (dict(num_max_tokens_per_rank=32),
     r"num_max_tokens_per_rank: 32 differs from the cached handle's 64"),
    (dict(do_expand=True), r"do_expand: True differs from the cached handle's layout"),
    (dict(x=T(15, 128)), r"x: has 15 rows; the cached handle's dispatch sent 16"),
    (dict(topk_weights=T(16, 3)), r"topk_weights: must be \[16, 4\] as the cached handle's"),
])
def test_cached_dispatch_refusals_name_the_argument(over, match):
    a = dict(x=T(16, 128), handle=cached_handle())
    a.update(over)
    with pytest.raises(epx.EPXValueError, match=rf"dispatch: {match}"):
        bare().dispatch(**a)


def test_cached_dispatch_reaches_epx():
    buf = bare()
    with pytest.raises(TypeError, match="dispatch: handle: expected the EPHandle"):
        buf.dispatch(T(16, 128), handle=("a V1 handle",))
    with pytest.raises(Launched, match="dispatch"):
        buf.dispatch(T(16, 128), handle=cached_handle(), do_cpu_sync=False, num_experts=16)
    with pytest.raises(Launched, match="dispatch"):
        buf.dispatch(T(16, 128), handle=cached_handle(do_expand=True), do_expand=True,
                     topk_weights=T(16, 4))


def test_combine_refusals_name_the_argument():
    handle = bare_handle()
    with pytest.raises(epx.EPXUnsupportedError,
                       match="combine: previous_event_before_epilogue: .*reduce epilogue"):
        bare().combine(T(8, 128), handle, previous_event_before_epilogue=object())
    with pytest.raises(TypeError, match="combine: handle: expected the EPHandle"):
        bare().combine(T(8, 128), ("a V1 handle",))


@pytest.mark.parametrize("over, name", [
    (dict(topk_idx=None), "topk_idx"),
    (dict(num_experts=None), "num_experts"),
    (dict(num_experts=18), "num_experts"),
    (dict(num_max_tokens_per_rank=8), "num_max_tokens_per_rank"),
    (dict(expert_alignment=0), "expert_alignment"),
    (dict(num_sms=-2), "num_sms"),
    (dict(num_qps=5), "num_qps"),
])
def test_bad_dispatch_values_name_the_argument(over, name):
    with pytest.raises(epx.EPXValueError, match=name):
        bare().dispatch(**dispatch_args(**over))


def test_num_qps_other_than_epxs_warns_once_and_proceeds():
    compat._reset_for_tests()
    buf = bare(num_ranks=8, nodes=2)
    assert buf.get_theoretical_num_qps(20) == 4 and bare().get_theoretical_num_qps(20) == 0
    with pytest.warns(epx.EPXIgnoredArgumentWarning, match="dispatch: num_qps: has no effect"):
        with pytest.raises(Launched):
            buf.dispatch(**dispatch_args(num_qps=2))


def test_theoretical_num_sms_is_epxs_default_and_refuses_a_scaleout_topk():
    buf = bare()
    assert buf.get_theoretical_num_sms(256, 8) == epx.Buffer.get_dispatch_config(4).num_sms
    with pytest.raises(epx.EPXUnsupportedError, match="num_scaleout_topk"):
        buf.get_theoretical_num_sms(256, 8, num_scaleout_topk=2)
    compat._reset_for_tests()
    with pytest.warns(epx.EPXIgnoredArgumentWarning, match="nvlink_gbs: has no effect"):
        buf.get_theoretical_num_sms(256, 8, nvlink_gbs=450)


@pytest.mark.parametrize("name", EXPERIMENTAL)
def test_experimental_methods_raise_naming_themselves(name):
    fn = getattr(bare(), name)
    n = sum(1 for p in inspect.signature(fn).parameters.values()
            if p.default is inspect.Parameter.empty)
    with pytest.raises(epx.EPXUnsupportedError, match=rf"ElasticBuffer\.{name}: {name}: "):
        fn(*([None] * n))


@pytest.mark.parametrize("name", EXPERIMENTAL_STATIC)
def test_experimental_size_hints_raise_naming_themselves(name):
    fn = getattr(epx.ElasticBuffer, name)
    n = sum(1 for p in inspect.signature(fn).parameters.values()
            if p.default is inspect.Parameter.empty)
    with pytest.raises(epx.EPXUnsupportedError, match=rf"ElasticBuffer\.{name}: {name}: "):
        fn(*([None] * n))


# ---- construction -------------------------------------------------------------------------------

class Group:
    """What ElasticBuffer reads from a torch ProcessGroup before it needs torch."""

    def __init__(self, size, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def _no_torch():
    raise ImportError("No module named 'torch'")


def test_construction_without_torch_or_gpu_fails_clearly(monkeypatch):
    monkeypatch.setenv("EPX_RANKS_PER_NODE", "4")
    monkeypatch.setattr(elastic, "_torch", _no_torch)
    with pytest.raises(ImportError, match="ElasticBuffer: needs PyTorch"):
        epx.ElasticBuffer(Group(4), num_max_tokens_per_rank=128, hidden=7168, num_topk=8)
    no_gpu = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: False))
    monkeypatch.setattr(elastic, "_torch", lambda: no_gpu)
    with pytest.raises(RuntimeError, match="ElasticBuffer: needs a CUDA GPU"):
        epx.ElasticBuffer(Group(4), num_max_tokens_per_rank=128, hidden=7168, num_topk=8)


def test_construction_refusals_name_the_argument(monkeypatch):
    monkeypatch.setattr(elastic, "_torch", _no_torch)
    with pytest.raises(epx.EPXUnsupportedError, match="ElasticBuffer: num_cpu_bytes: .*GPU"):
        epx.ElasticBuffer(Group(4), num_bytes=4 << 20, num_cpu_bytes=2 << 20)
    with pytest.raises(epx.EPXValueError, match="num_max_tokens_per_rank and hidden"):
        epx.ElasticBuffer(Group(4))  # neither num_bytes nor the MoE sizes
    with pytest.raises(epx.EPXValueError, match="num_gpu_timeout_secs"):
        epx.ElasticBuffer(Group(4), num_bytes=2 << 20, num_gpu_timeout_secs=0)
    with pytest.raises(TypeError, match="group: expected a torch.distributed ProcessGroup"):
        epx.ElasticBuffer(object(), num_bytes=2 << 20)


@pytest.mark.parametrize("arg, value", [("sl_idx", 0), ("num_allocated_qps", 64),
                                        ("prefer_overlap_with_compute", False)])
def test_knobs_that_only_change_how_warn_once(monkeypatch, arg, value):
    # SGLang passes sl_idx=0 and prefer_overlap_with_compute=False: warned, not refused.
    compat._reset_for_tests()
    monkeypatch.setenv("EPX_RANKS_PER_NODE", "4")
    monkeypatch.setattr(elastic, "_torch", _no_torch)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with pytest.raises(ImportError):
            epx.ElasticBuffer(Group(4), num_bytes=2 << 20, **{arg: value})
    msgs = [str(w.message) for w in rec if issubclass(w.category, epx.EPXIgnoredArgumentWarning)]
    assert len(msgs) == 1 and f"ElasticBuffer: {arg}: has no effect" in msgs[0], msgs


# ---- sizes and domains --------------------------------------------------------------------------

def test_buffer_size_hint_is_epxs_hint_rounded_to_2_mib(monkeypatch):
    monkeypatch.setenv("EPX_RANKS_PER_NODE", "8")
    n = epx.ElasticBuffer.get_buffer_size_hint(Group(8), 4096, 7168, num_topk=8)
    want = max(cfg.get_nvl_buffer_size_hint(7168 * 2, 8, 8)
               for cfg in (epx.Buffer.get_dispatch_config(8), epx.Buffer.get_combine_config(8)))
    assert n % (2 << 20) == 0 and want <= n < want + (2 << 20)
    # FP8 dispatch needs no more than the BF16 combine's rows
    assert epx.ElasticBuffer.get_buffer_size_hint(Group(8), 4096, 7168, 8, True) == n
    # across nodes (2 nodes of 4): the internode hint for these sizes
    monkeypatch.setenv("EPX_RANKS_PER_NODE", "4")
    m = epx.ElasticBuffer.get_buffer_size_hint(Group(8), 1024, 7168, num_topk=8)
    want = epx.Buffer.get_internode_nvl_size_hint(1024, 7168, 8, 4, 8)
    assert m % (2 << 20) == 0 and want <= m < want + (2 << 20)
    with pytest.raises(epx.EPXValueError, match="hidden"):
        epx.ElasticBuffer.get_buffer_size_hint(Group(8), 1024, 0)


def test_domain_sizes_follow_the_nodes_and_hybrid_mode(monkeypatch):
    monkeypatch.setenv("EPX_RANKS_PER_NODE", "4")
    assert deep_ep.get_physical_domain_size(Group(8)) == (2, 4)
    assert deep_ep.get_logical_domain_size(Group(8)) == (2, 4)
    assert deep_ep.get_logical_domain_size(Group(8), allow_hybrid_mode=False) == (1, 8)
    monkeypatch.setenv("EPX_RANKS_PER_NODE", "3")
    with pytest.raises(epx.EPXValueError, match="group: 8 ranks do not split into nodes of 3"):
        deep_ep.get_physical_domain_size(Group(8))
    buf = bare(num_ranks=8, nodes=2)
    assert buf.get_physical_domain_size() == (2, 4) and buf.get_logical_domain_size() == (2, 4)


def test_destroy_needs_explicitly_destroy_and_use_after_destroy_is_named():
    buf = bare()
    buf.explicitly_destroy = False
    with pytest.raises(RuntimeError, match="destroy: explicitly_destroy"):
        buf.destroy()
    buf.explicitly_destroy, buf.runtime = True, None
    buf.destroy()  # a second destroy is a no-op, as in V2
    with pytest.raises(RuntimeError, match="used after destroy"):
        buf.get_comm_stream()

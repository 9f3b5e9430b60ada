"""CPU tests of the epx package: imports and errors, binding conversions and the
allocator, configs, events, the pure-Python parts of the DeepEP API, the example
MoE layer's reference (examples/) and in-process ranks. Need NumPy, not PyTorch or
a GPU; the tests that use PyTorch on the CPU (the example's expert steps, the torch
baseline of epx.bench over gloo) skip without it. The validators, the reference
model and epx.bench have files of their own (test_validators.py,
test_reference_models.py, test_bench_cpu.py)."""

import inspect
import sys
import textwrap

import numpy as np
import pytest

import epx
from epx import _core
from epx import reference as ref
from cpu_helpers import RNG, _run_clean, np_bf16_bits, np_bf16_float, random_topk


def _testing():
    """epx._testing (handles with fake routing tensors), which scripts/test.sh builds."""
    return pytest.importorskip(
        "epx._testing", reason="epx built without EPX_PYTHON_TESTING=ON (scripts/test.sh builds it)")

D = _core.DType


# ---- import, errors ------------------------------------------------------------------------------

def test_import_does_not_need_torch():
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # makes `import torch` fail
        import epx
        assert epx.Buffer.num_sms > 0 and epx.Config().num_sms == 20
        try:
            epx.Buffer(None)
        except ImportError as e:
            assert "PyTorch" in str(e), e
        else:
            raise AssertionError("Buffer() without torch must raise ImportError")
    """)
    _run_clean(code)


@pytest.mark.parametrize("code, cls, builtin", [
    (_core.ErrorCode.invalid_argument, epx.EPXValueError, ValueError),
    (_core.ErrorCode.timeout, epx.EPXTimeoutError, TimeoutError),
    (_core.ErrorCode.unsupported, epx.EPXUnsupportedError, NotImplementedError),
    (_core.ErrorCode.cuda, epx.EPXError, RuntimeError),
    (_core.ErrorCode.nccl, epx.EPXError, RuntimeError),
    (_core.ErrorCode.buffer_too_small, epx.EPXError, RuntimeError),
    (_core.ErrorCode.internal, epx.EPXError, RuntimeError),
])
def test_error_mapping(code, cls, builtin):
    with pytest.raises(cls) as info:
        _core._raise(code, "dispatch: x: some rule")
    e = info.value
    assert isinstance(e, epx.EPXError) and isinstance(e, builtin)
    assert e.code == code
    assert "dispatch: x: some rule" in str(e)
    if cls is epx.EPXError:  # only the specific codes map to the specific classes
        assert not isinstance(e, (ValueError, TimeoutError, NotImplementedError))


def test_deep_ep_aliases():
    assert epx.EventOverlap is epx.utils.EventOverlap
    assert epx.EventHandle is epx.utils.EventHandle
    for name in ["get_dispatch_layout", "dispatch", "combine", "low_latency_dispatch",
                 "low_latency_combine", "get_next_low_latency_combine_buffer",
                 "clean_low_latency_buffer", "get_low_latency_rdma_size_hint",
                 "get_dispatch_config", "get_combine_config", "set_num_sms", "capture",
                 "get_comm_stream", "get_local_buffer_tensor", "destroy",
                 "low_latency_update_mask_buffer", "low_latency_query_mask_buffer",
                 "low_latency_clean_mask_buffer"]:
        assert callable(getattr(epx.Buffer, name)), name
    saved = {k: sys.modules.get(k) for k in ("deep_ep", "deep_ep.utils", "deep_ep.buffer")}
    try:
        for k in saved:
            sys.modules.pop(k, None)
        epx.alias_deep_ep()
        from deep_ep.utils import EventOverlap
        import deep_ep
        assert deep_ep is epx and EventOverlap is epx.EventOverlap
    finally:
        for k, v in saved.items():
            sys.modules.pop(k, None)
            if v is not None:
                sys.modules[k] = v


# ---- tensors through DLPack ----------------------------------------------------------------------

@pytest.mark.parametrize("np_dtype, dtype", [
    (np.float32, D.float32), (np.int32, D.int32), (np.int64, D.int64), (np.bool_, D.bool),
    (np.uint8, D.float8_e4m3fn),  # FP8 bits travel as uint8 where DLPack lacks float8
])
def test_view_dtypes(np_dtype, dtype):
    a = np.zeros((3, 5), np_dtype)
    v = _core.TensorView.from_dlpack(a, "x")
    assert v.dtype == dtype
    assert v.shape == (3, 5) and v.strides == (5, 1) and v.ndim == 2
    assert v.device == _core.CPU and v.data == a.ctypes.data
    assert v.nbytes() == a.nbytes and v.is_contiguous()


def test_view_strides_and_offset():
    a = np.arange(48, dtype=np.int64).reshape(6, 8)
    v = _core.TensorView.from_dlpack(a[1:, ::2], "x")
    assert v.shape == (5, 4) and v.strides == (8, 2)
    assert v.data == a.ctypes.data + 8 * 8
    assert not v.is_contiguous()
    t = _core.TensorView.from_dlpack(a.T, "x")
    assert t.shape == (8, 6) and t.strides == (1, 8)
    assert "non-contiguous" in t.describe()


def test_view_errors_name_the_argument():
    with pytest.raises(TypeError, match=r"^topk_idx: unsupported dtype .*float64|topk_idx: "):
        _core.TensorView.from_dlpack(np.zeros(3, np.float64), "topk_idx")
    with pytest.raises(TypeError, match=r"topk_weights: expected a tensor .* got list"):
        _core.TensorView.from_dlpack([1.0, 2.0], "topk_weights")
    with pytest.raises(epx.EPXValueError, match=r"x: has 5 dimensions; at most 4"):
        _core.TensorView.from_dlpack(np.zeros((1, 1, 1, 1, 1), np.float32), "x")
    # uint16 is not a dtype EPX knows; BF16 bits need an explicit reinterpretation
    with pytest.raises(TypeError, match="x: unsupported dtype"):
        _core.TensorView.from_dlpack(np.zeros(4, np.uint16), "x")
    v = _core.TensorView.from_dlpack(np.zeros(4, np.uint16), "x", D.bfloat16)
    assert v.dtype == D.bfloat16
    with pytest.raises(epx.EPXValueError, match="x: cannot view elements .* as bfloat16"):
        _core.TensorView.from_dlpack(np.zeros(4, np.float32), "x", D.bfloat16)


def test_raw_view_describe():
    v = _core.TensorView(0x1000, D.bfloat16, [4096, 7168], device=0)
    assert v.describe() == "[4096, 7168] bfloat16 cuda:0"
    assert v.strides == (7168, 1) and v.numel() == 4096 * 7168
    assert v.nbytes() == 4096 * 7168 * 2
    w = _core.TensorView(0x1000, D.float32, [2, 3], strides=[1, 2])
    assert w.describe() == "[2, 3] float32 cpu (non-contiguous)"


# ---- the Python allocator: outputs come back as the objects it returned ----------------------

NP_OF = {D.float8_e4m3fn: np.uint8, D.float32: np.float32, D.int32: np.int32,
         D.int64: np.int64, D.bool: np.bool_}  # numpy has no bfloat16


def numpy_allocator(calls):
    def alloc(dtype, shape, stream):
        calls.append((dtype, shape, stream))
        return np.zeros(shape, NP_OF[_core.DType(dtype)])
    return alloc


def test_buffer_options_enable_shrink():
    opts = _core.BufferOptions()
    assert opts.enable_shrink is False  # DeepEP's default
    opts.enable_shrink = True
    assert opts.enable_shrink is True


ALGORITHM_FIELDS = ("ht_rings", "net_split_puts", "ll_arrival_order", "ll_context_ranges",
                    "ll_sms", "proxy_cumem", "max_ops_in_flight")


def test_buffer_options_algorithm_fields_default_unset():
    opts = _core.BufferOptions()
    for name in ALGORITHM_FIELDS:
        assert getattr(opts, name) is None, name  # unset: the variable, else the default
    opts.ht_rings, opts.ll_sms, opts.proxy_cumem = 4, 16, False
    assert (opts.ht_rings, opts.ll_sms, opts.proxy_cumem) == (4, 16, False)
    opts.ht_rings = None
    assert opts.ht_rings is None


@pytest.mark.parametrize("field, value, rule", [
    ("ht_rings", -2, r"ht_rings: must be -1 .* ring records in \[2, 2\^20\] .*got -2"),
    ("ht_rings", (1 << 20) + 1, r"ht_rings: .*got 1048577"),
    ("ll_sms", 0, r"ll_sms: must be in \[1, 2\^20\].*got 0"),
    ("max_ops_in_flight", -1, r"max_ops_in_flight: must be in \[0, 2\^20\].*got -1"),
])
def test_buffer_options_validate_names_the_field(field, value, rule):
    opts = _core.BufferOptions()
    opts.num_rdma_bytes = 1
    opts.validate()
    setattr(opts, field, value)
    with pytest.raises(epx.EPXError, match=rule) as info:
        opts.validate()
    assert info.value.code == _core.ErrorCode.invalid_argument


def test_buffer_keywords_reach_the_algorithm_fields():
    from epx.buffer import _set_algorithm_options

    params = inspect.signature(epx.Buffer.__init__).parameters
    for name in ALGORITHM_FIELDS:
        assert params[name].kind == inspect.Parameter.KEYWORD_ONLY and params[name].default is None
    opts = _set_algorithm_options(_core.BufferOptions(), ht_rings=0, net_split_puts=True,
                                  ll_arrival_order=1, ll_context_ranges=False, ll_sms=8,
                                  proxy_cumem=None, max_ops_in_flight=0)
    assert (opts.ht_rings, opts.net_split_puts, opts.ll_arrival_order, opts.ll_context_ranges,
            opts.ll_sms, opts.proxy_cumem, opts.max_ops_in_flight) == (0, True, True, False, 8,
                                                                      None, 0)
    with pytest.raises(TypeError, match="ht_rings: expected an int"):
        _set_algorithm_options(_core.BufferOptions(), "4", None, None, None, None, None, None)
    with pytest.raises(epx.EPXError, match="ll_sms: must be an integer in"):
        _set_algorithm_options(_core.BufferOptions(), None, None, None, None, 1 << 40, None, None)
    with pytest.raises(TypeError, match="max_ops_in_flight: expected an int"):
        _set_algorithm_options(_core.BufferOptions(), None, None, None, None, None, None, "16")


def test_internode_size_hint_takes_the_rings_field(monkeypatch):
    monkeypatch.delenv("EPX_HT_RINGS", raising=False)
    auto = epx.Buffer.get_internode_nvl_size_hint(128, 7168, 4, 2, 8)
    off = epx.Buffer.get_internode_nvl_size_hint(128, 7168, 4, 2, 8, ht_rings=0)
    assert off < auto
    monkeypatch.setenv("EPX_HT_RINGS", "0")
    assert epx.Buffer.get_internode_nvl_size_hint(128, 7168, 4, 2, 8, ht_rings=-1) == auto
    with pytest.raises(epx.EPXError, match="ht_rings: must be -1"):
        epx.Buffer.get_internode_nvl_size_hint(128, 7168, 4, 2, 8, ht_rings=-5)


def test_allocator_round_trip():
    calls = []
    opts = _core.BufferOptions()
    assert opts.allocator is None
    alloc = numpy_allocator(calls)
    opts.allocator = alloc
    assert opts.allocator is alloc
    whole, rest = _core._test_allocator(opts, D.int64, [4, 3], 1234)
    assert calls == [(D.int64.value, (4, 3), 1234)]
    assert isinstance(whole, np.ndarray) and whole.shape == (4, 3) and whole.dtype == np.int64
    base, shape, strides, offset = rest  # a part of `whole`, rebuilt by epx.buffer with as_strided
    assert base is whole and shape == (3, 3) and strides == (3, 1) and offset == 3
    before = sys.getrefcount(whole)
    del rest, base
    assert sys.getrefcount(whole) == before - 2  # the core held it only through the results
    # (object to return, DLPack source): results are the first, memory comes from the second
    holder = {}

    def alloc_pair(dtype, shape, stream):
        a = np.zeros(shape, np.bool_)
        holder["obj"] = ("mine", a)
        return holder["obj"], a
    opts.allocator = alloc_pair
    whole, _ = _core._test_allocator(opts, D.bool, [2, 2])
    assert whole is holder["obj"]
    opts.allocator = None
    assert opts.allocator is None


def test_allocator_errors():
    opts = _core.BufferOptions()
    opts.allocator = lambda dtype, shape, stream: np.zeros(shape, np.float32)
    with pytest.raises(epx.EPXError, match=r"allocator returned \[2\] float32 cpu, expected a "
                                           r"contiguous int32"):
        _core._test_allocator(opts, D.int32, [2])
    opts.allocator = lambda dtype, shape, stream: "not a tensor"
    with pytest.raises(TypeError, match="allocator result: expected a tensor"):
        _core._test_allocator(opts, D.int32, [2])
    # (tensor, data pointer) is trusted only for CUDA device memory
    host = np.zeros(2, np.int32)
    opts.allocator = lambda dtype, shape, stream: (host, host.ctypes.data)
    with pytest.raises(epx.EPXError, match="not CUDA device memory"):
        _core._test_allocator(opts, D.int32, [2])
    opts.allocator = lambda dtype, shape, stream: (host, 0)
    with pytest.raises(epx.EPXError, match="not CUDA device memory"):
        _core._test_allocator(opts, D.int32, [2])
    # a bare pointer keeps nothing alive: refused like any non-tensor
    opts.allocator = lambda dtype, shape, stream: host.ctypes.data
    with pytest.raises(TypeError, match="allocator result: expected a tensor"):
        _core._test_allocator(opts, D.int32, [2])

    def boom(dtype, shape, stream):
        raise MemoryError("out of memory in the allocator")
    opts.allocator = boom
    with pytest.raises(MemoryError, match="out of memory in the allocator"):
        _core._test_allocator(opts, D.int32, [2])


# ---- config and static helpers -------------------------------------------------------------------

def test_config_maps_deep_ep_arguments():
    from epx import compat

    compat._reset_for_tests()  # the RDMA value warns once per process
    with pytest.warns(epx.EPXIgnoredArgumentWarning, match="num_max_rdma_chunked_recv_tokens"):
        c = epx.Config(24, 6, 256, 6, 128)
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens) == \
        (24, 6, 256)
    assert (c._cfg.num_sms, c._cfg.num_max_send_tokens, c._cfg.num_max_recv_tokens) == (24, 6, 256)
    assert c.num_max_rdma_chunked_recv_tokens == 128
    c.num_max_nvl_chunked_recv_tokens = 512
    assert c._cfg.num_max_recv_tokens == 512
    with pytest.raises(TypeError, match="num_max_nvl_chunked_send_tokens: expected an int"):
        epx.Config(24, "6")
    hint = c.get_nvl_buffer_size_hint(7168 * 2, 8)
    assert hint > 0 and hint % 16 == 0
    assert c.get_nvl_buffer_size_hint(2 * 7168 * 2, 8) > hint
    c.num_max_nvl_chunked_recv_tokens = 1024
    assert c.get_nvl_buffer_size_hint(7168 * 2, 8) > hint
    assert c.get_rdma_buffer_size_hint(7168 * 2, 8) == 0


def test_config_pull_dispatch(monkeypatch):
    c = epx.Config(24, 6, 256)
    assert c.pull_dispatch is False and c._cfg.send_sms() == 8
    c.pull_dispatch = True
    assert c._cfg.pull_dispatch and c._cfg.send_sms() == 4  # the pull's default share
    assert "pull_dispatch=True" in repr(c._cfg)
    with pytest.raises(TypeError, match="pull_dispatch: expected a bool"):
        c.pull_dispatch = 1
    monkeypatch.setenv("EPX_HT_PULL", "1")
    assert epx.Buffer.get_dispatch_config(4).pull_dispatch is True
    assert epx.Buffer.get_combine_config(4).pull_dispatch is False
    monkeypatch.setenv("EPX_HT_PULL", "yes")
    with pytest.raises(epx.EPXValueError, match="EPX_HT_PULL"):
        epx.Buffer.get_dispatch_config(4)


def test_default_configs_follow_set_num_sms():
    old = epx.Buffer.num_sms
    try:
        epx.Buffer.set_num_sms(20)
        assert epx.Buffer.num_sms == 20 and _core.Buffer.num_sms() == 20
        for cfg in (epx.Buffer.get_dispatch_config(8), epx.Buffer.get_combine_config(4)):
            assert isinstance(cfg, epx.Config) and cfg.num_sms == 20
        with pytest.raises(epx.EPXValueError, match="num_sms: must be an even number"):
            epx.Buffer.set_num_sms(21)
        with pytest.raises(TypeError, match="new_num_sms: expected an int"):
            epx.Buffer.set_num_sms(20.0)
    finally:
        epx.Buffer.set_num_sms(old)


def test_low_latency_rdma_size_hint():
    a = epx.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    assert a > 0
    assert epx.Buffer.get_low_latency_rdma_size_hint(256, 7168, 8, 256) > a
    assert epx.Buffer.get_low_latency_rdma_size_hint(128, 2 * 7168, 8, 256) > a


# ---- events (with a stand-in for the CUDA event) -------------------------------------------------

class FakeEvent:
    def __init__(self):
        self.waits = 0

    def current_stream_wait(self):
        self.waits += 1


def test_event_overlap_semantics():
    ev = FakeEvent()
    keep = [object()]
    o = epx.EventOverlap(ev, keep)
    assert o.extra_tensors == tuple(keep)
    with o as same:
        assert same is o and ev.waits == 0
    assert ev.waits == 1 and o.extra_tensors is None
    o.current_stream_wait()
    assert ev.waits == 2
    empty = epx.EventOverlap()
    empty.current_stream_wait()  # nothing to wait for: no error
    with empty:
        pass


def test_previous_event_type_error():
    from epx.utils import _event_of

    assert _event_of(None) is None and _event_of(epx.EventOverlap()) is None
    with pytest.raises(TypeError, match="previous_event: expected an EventOverlap"):
        _event_of(42)


# ---- torch conversions on the CPU (skipped without torch) --------------------------------------

def test_torch_views():
    torch = pytest.importorskip("torch")
    from epx.buffer import _TorchGlue

    g = _TorchGlue.get()
    x = torch.zeros(6, 8, dtype=torch.bfloat16)[1:, ::2]
    v = g.view("x", x)
    assert v.dtype == D.bfloat16 and v.shape == (5, 4) and v.strides == (8, 2)
    assert v.data == x.data_ptr() and v.device == _core.CPU
    w = g.view("topk_weights", torch.ones(3, 2, requires_grad=True) * 2)  # needs a detach
    assert w.dtype == D.float32 and w.shape == (3, 2)
    q = g.view("x", torch.zeros(2, 128, dtype=torch.float8_e4m3fn))
    assert q.dtype == D.float8_e4m3fn
    assert g.view("is_token_in_rank", torch.zeros(2, 2, dtype=torch.bool)).dtype == D.bool
    with pytest.raises(TypeError, match="^x: expected a torch.Tensor, got ndarray"):
        g.view("x", np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="x: unsupported dtype"):
        g.view("x", torch.zeros(3, dtype=torch.float16))


def test_torch_outputs():
    torch = pytest.importorskip("torch")
    from epx.buffer import _TorchGlue

    g = _TorchGlue.get()
    base = torch.arange(24, dtype=torch.float32)
    part = g.out((base, (3, 4), (1, 3), 2))  # a view the core made of an allocated tensor
    assert part.data_ptr() == base.data_ptr() + 2 * 4
    assert torch.equal(part, base[2:14].view(4, 3).t())
    bits = torch.tensor([0x38, 0xC0], dtype=torch.uint8)
    assert g.out(bits).dtype == torch.float8_e4m3fn  # EPX makes no uint8 outputs
    assert g.out(None) is None
    assert g.out(base) is base


# ---- examples/moe_reference.py: the single-process MoE reference -------------------------------

def _moe_reference():
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
    if path not in sys.path:
        sys.path.insert(0, path)
    import moe_reference

    return moe_reference


def test_moe_reference_bf16_rounding():
    m = _moe_reference()
    x = (RNG.standard_normal(4096) * 10).astype(np.float32)
    x[:4] = [1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), 0.0]  # ties to even
    got = m.round_bf16(x)
    np.testing.assert_array_equal(got, np_bf16_float(np_bf16_bits(x)))
    assert list(got[:4]) == [1.0, 1.0 + 4 * 2 ** -8, -1.0, 0.0]
    gate, w1, w2 = m.expert_weights(3, 8, 256, 64)
    assert gate.shape == (256, 8) and w1.shape == (8, 256, 64) and w2.shape == (8, 64, 256)
    for w in (gate, w1, w2):
        np.testing.assert_array_equal(w, m.round_bf16(w))  # BF16 copies are exact
    np.testing.assert_array_equal(w1, m.expert_weights(3, 8, 256, 64)[1])  # seeded
    assert not np.array_equal(w1, m.expert_weights(4, 8, 256, 64)[1])


def test_moe_reference_forward_matches_per_token_loop():
    m = _moe_reference()
    T, H, I, E, K = 24, 128, 32, 6, 3
    _, w1, w2 = m.expert_weights(5, E, H, I)
    x = m.random_tokens(6, T, H)
    idx = random_topk(T, K, E, drop=0.2)
    w = RNG.random((T, K)).astype(np.float32)
    got = m.moe_forward(x, idx, w, w1, w2)
    want = np.zeros((T, H))
    for t in range(T):
        for k in range(K):
            e = idx[t, k]
            if e >= 0:
                h = x[t].astype(np.float64) @ w1[e]
                want[t] += w[t, k] * ((h / (1 + np.exp(-h))) @ w2[e])
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    assert np.abs(got).max() > 0.1  # not a test on zeros
    with pytest.raises(ValueError, match="expert ids"):
        m.moe_forward(x, np.full((T, K), E), w, w1, w2)


def test_moe_reference_compare_can_fail():
    m = _moe_reference()
    T, H, I, E, K = 32, 128, 64, 8, 4
    _, w1, w2 = m.expert_weights(7, E, H, I)
    x = m.random_tokens(8, T, H)
    idx = random_topk(T, K, E, drop=0.0)
    w = RNG.random((T, K)).astype(np.float32)
    w /= w.sum(1, keepdims=True)
    want = m.moe_forward(x, idx, w, w1, w2)
    assert m.compare(want, want) is None
    assert m.compare(m.round_bf16(want), want) is None  # BF16 output rounding passes
    # one token missing one of its experts
    idx2 = idx.copy()
    idx2[5, 1] = -1
    assert "out of tolerance" in m.compare(m.moe_forward(x, idx2, w, w1, w2), want)
    # two tokens swapped
    swapped = want.copy()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert m.compare(swapped, want) is not None
    # weights not applied (sum of the experts' outputs)
    assert m.compare(m.moe_forward(x, idx, np.ones_like(w), w1, w2), want) is not None
    # a poisoned value, a wrong shape, a reference of zeros
    bad = want.copy()
    bad[1, 2] = np.nan
    assert "non-finite" in m.compare(bad, want)
    assert "shape" in m.compare(want[:-1], want)
    assert "zeros" in m.compare(np.zeros_like(want), np.zeros_like(want))
    # a small bias everywhere breaks the whole-tensor bound
    assert m.compare(want + 0.02 * np.sqrt(np.mean(want ** 2)), want) is not None


def test_moe_reference_fp8_roundtrip():
    m = _moe_reference()
    x = m.random_tokens(9, 8, 256)
    q, s = ref.quantize_fp8(x)
    np.testing.assert_array_equal(m.fp8_roundtrip(x), ref.dequantize_fp8(q, s))
    err = np.abs(m.fp8_roundtrip(x) - x)
    assert err.max() > 0 and err.max() <= np.abs(x).max() / 8  # e4m3: 3 mantissa bits


# ---- PyTorch on the CPU (skipped without torch): example experts, torch baseline ---------------

def _moe_layer():
    pytest.importorskip("torch")
    _moe_reference()
    import moe_layer

    return moe_layer


def test_example_grouped_experts_cpu():
    """The example's prefill expert step on one simulated rank (every expert local) against
    the dense reference, in BF16 as on the GPU: checks the grouping and the tolerance."""
    ml, m = _moe_layer(), _moe_reference()
    import torch

    T, H, I, E, K = 48, 256, 128, 8, 4
    _, w1, w2 = m.expert_weights(11, E, H, I)
    x = m.random_tokens(12, T, H)
    idx = random_topk(T, K, E, drop=0.1)
    w = RNG.random((T, K)).astype(np.float32)
    counts = [int((idx == e).sum()) for e in range(E)]
    got = ml.grouped_experts(torch.from_numpy(x).bfloat16(), torch.from_numpy(idx),
                             torch.from_numpy(w), counts, torch.from_numpy(w1).bfloat16(),
                             torch.from_numpy(w2).bfloat16())
    assert got.dtype == torch.bfloat16 and got.shape == (T, H)
    want = m.moe_forward(x, idx, w, w1, w2)
    assert m.compare(got.float().numpy(), want) is None
    # counts that disagree with recv_topk_idx are caught
    with pytest.raises(RuntimeError, match="adds up to"):
        ml.grouped_experts(torch.from_numpy(x).bfloat16(), torch.from_numpy(idx),
                           torch.from_numpy(w), [c + 1 for c in counts],
                           torch.from_numpy(w1).bfloat16(), torch.from_numpy(w2).bfloat16())
    # per-expert counts shifted between two experts (same total): the output is wrong
    shifted = list(counts)
    shifted[0] += 1
    shifted[1] -= 1
    bad = ml.grouped_experts(torch.from_numpy(x).bfloat16(), torch.from_numpy(idx),
                             torch.from_numpy(w), shifted, torch.from_numpy(w1).bfloat16(),
                             torch.from_numpy(w2).bfloat16())
    assert m.compare(bad.float().numpy(), want) is not None


@pytest.mark.parametrize("use_fp8", [False, True])
def test_example_masked_experts_cpu(use_fp8):
    """The example's decode expert step on the packed layout of the reference model's
    low-latency dispatch (2 simulated ranks), combined by the reference model, against
    the dense reference."""
    ml, m = _moe_layer(), _moe_reference()
    import torch

    R, H, I, E, K, maxT = 2, 256, 64, 8, 3, 16
    El = E // R
    _, w1, w2 = m.expert_weights(13, E, H, I)
    xs = [m.random_tokens(14 + r, 10 + 3 * r, H) for r in range(R)]
    idxs = [random_topk(a.shape[0], K, E, drop=0.1) for a in xs]
    ws = [RNG.random((a.shape[0], K)).astype(np.float32) for a in xs]
    bits = [ref.bf16_from_float(a) for a in xs]
    disp = ref.ll_dispatch(bits, idxs, E, maxT, use_fp8=use_fp8)
    outs = []
    for r in range(R):
        d = disp[r]
        if use_fp8:
            q = torch.from_numpy(d["recv_x"]).view(torch.float8_e4m3fn)
            recv = (q, torch.from_numpy(d["recv_x_scales"]))
        else:
            recv = torch.from_numpy(d["recv_x"].view(np.int16)).view(torch.bfloat16).clone()
            # rows past recv_count are stale in a real buffer: poison them
            for e in range(El):
                recv[e, int(d["recv_count"][e]):] = float("nan")
        y = ml.masked_experts(recv, torch.from_numpy(d["recv_count"]),
                              torch.from_numpy(w1[r * El:(r + 1) * El]).bfloat16(),
                              torch.from_numpy(w2[r * El:(r + 1) * El]).bfloat16())
        assert y.shape == (El, R * maxT, H) and torch.isfinite(y).all()
        outs.append(y.contiguous().view(torch.int16).numpy().view(np.uint16))
    combined = ref.ll_combine(outs, idxs, ws, E, maxT)
    for r in range(R):
        x_in = m.fp8_roundtrip(xs[r]) if use_fp8 else xs[r]
        want = m.moe_forward(x_in, idxs[r], ws[r], w1, w2)
        assert m.compare(ref.bf16_to_float(combined[r]), want) is None
        if use_fp8:  # FP8 inputs are not the BF16 tokens: the check tells them apart
            assert m.compare(ref.bf16_to_float(combined[r]),
                             m.moe_forward(xs[r], idxs[r], ws[r], w1, w2)) is not None


def _gloo_worker(rank, world, init, case):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        globals()[case](rank, world, dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def _spawn_gloo(case, world):
    """Runs ``case`` in ``world`` CPU processes (gloo); a rank's exception fails the test
    with its traceback."""
    pytest.importorskip("torch")
    import os
    import tempfile

    import torch.multiprocessing as mp

    init = "file://" + os.path.join(tempfile.mkdtemp(prefix="epx-rdv-"), "store")
    mp.spawn(_gloo_worker, args=(world, init, case), nprocs=world, join=True)


def _case_torch_baseline(rank, world, group):
    import torch_baseline_check

    torch_baseline_check.check(rank, world, group, "cpu")


@pytest.mark.parametrize("world", [2, 3])
def test_torch_baseline_gloo(world):
    _spawn_gloo("_case_torch_baseline", world)


# ---- in-process ranks ----------------------------------------------------------------------------

class _FakeCoreComm:
    """The part of _core.Communicator that epx.InProcessComm uses, over Python threads:
    all-gather of equal-size byte strings (refused otherwise, like the C++ group)."""

    def __init__(self, rank, shared):
        self.rank, self.num_ranks, self.device = rank, shared["n"], 0
        self._shared = shared

    def allgather(self, data):
        sh = self._shared
        sh["slots"][self.rank] = bytes(data)
        sh["barrier"].wait()
        slots = list(sh["slots"])
        sh["barrier"].wait()
        assert len({len(s) for s in slots}) == 1, "sizes differ"
        return b"".join(slots)

    def barrier(self):
        self._shared["barrier"].wait()


def test_in_process_allgather_is_in_rank_order_for_objects_of_any_size():
    import threading

    n = 3
    shared = {"n": n, "slots": [b""] * n, "barrier": threading.Barrier(n, timeout=30)}
    comms = [epx.InProcessComm(_FakeCoreComm(r, shared)) for r in range(n)]
    got = [None] * n

    def run(r):
        objs = {"rank": r, "payload": np.arange(10 * r + 1)}  # pickles differ in size
        got[r] = [comms[r].allgather(objs), comms[r].allgather("x" * (100 * r))]

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(n):
        first, second = got[r]
        assert [o["rank"] for o in first] == [0, 1, 2]
        for s in range(n):
            np.testing.assert_array_equal(first[s]["payload"], np.arange(10 * s + 1))
        assert second == ["", "x" * 100, "x" * 200]
        assert comms[r].Get_rank() == r and comms[r].Get_size() == n


@pytest.mark.parametrize("kwargs, arg", [({"num_ranks": 0}, "num_ranks"),
                                         ({"num_ranks": 161}, "num_ranks"),
                                         ({"num_ranks": 2, "devices": [0]}, "devices"),
                                         ({"num_ranks": 2, "timeout_s": 0}, "timeout_s")])
def test_in_process_comms_refuse_bad_arguments_before_any_cuda_call(kwargs, arg):
    with pytest.raises(epx.EPXValueError, match=arg):
        epx.in_process_comms(**kwargs)


def test_in_process_buffer_needs_explicit_destroy():
    """Destruction is collective: from the garbage collector it would wait for the other
    ranks' threads while holding the GIL, so in-process ranks must destroy() explicitly."""
    comm = epx.InProcessComm(_FakeCoreComm(0, {"n": 2}))
    with pytest.raises(ValueError, match="explicitly_destroy"):
        epx.Buffer(comm=comm, num_nvl_bytes=1 << 20)


def test_nvshmem_module_is_found_or_its_absence_named():
    """The nvshmem backend's module: beside epx._core when the build made one
    (it then loads without a GPU and reports its NVSHMEM), else an
    EPXUnsupportedError that names the build option."""
    import os
    here = os.path.dirname(_core.__file__)
    if os.path.exists(os.path.join(here, "libepx_nvshmem.so")) and \
            "EPX_NVSHMEM_MODULE" not in os.environ:
        assert _core.nvshmem_module_version() == "3.4.5"
    else:
        with pytest.raises(epx.EPXUnsupportedError, match="EPX_WITH_NVSHMEM|could not be loaded"):
            _core.nvshmem_module_version()

"""CPU tests of the epx package: binding conversions, validation messages, the
reference model against independent NumPy computations, and the pure-Python
parts of the DeepEP API, epx.bench's command line, byte counts and report, and the
example MoE layer's reference (examples/). Need NumPy, not PyTorch or a GPU; the
tests that use PyTorch on the CPU (the example's expert steps, the torch baseline of
epx.bench over gloo) or matplotlib skip without them."""

import inspect
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import epx
from epx import _core
from epx import reference as ref


def _testing():
    """epx._testing (handles with fake routing tensors), which scripts/test.sh builds."""
    return pytest.importorskip(
        "epx._testing", reason="epx built without EPX_PYTHON_TESTING=ON (scripts/test.sh builds it)")

D = _core.DType
RNG = np.random.default_rng(1234)


# ---- independent NumPy models --------------------------------------------------------------------

def np_bf16_bits(x):
    """float32 -> bf16 bits with round-to-nearest-even, via float64 arithmetic."""
    x = np.asarray(x, np.float32)
    u = x.view(np.uint32).astype(np.int64)
    upper, lower = u >> 16, u & 0xFFFF
    up = (lower > 0x8000) | ((lower == 0x8000) & (upper & 1 == 1))
    return (upper + up).astype(np.uint16)


def np_bf16_float(bits):
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def _fp8_values():
    """The finite FP8 e4m3fn values of bytes 0..255 (NaN at 0x7F and 0xFF)."""
    vals = np.empty(256, np.float64)
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 15, b & 7
        v = m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        vals[b] = -v if s else v
    vals[0x7F] = vals[0xFF] = np.nan
    return vals


FP8 = _fp8_values()


def np_fp8_bits(x):
    """Round to nearest e4m3fn (ties to even mantissa), saturating at +-448."""
    out = np.empty(np.shape(x), np.uint8)
    pos = FP8[:0x7F]  # 0x00..0x7E, increasing
    for i, v in np.ndenumerate(np.asarray(x, np.float64)):
        a = min(abs(v), 448.0)
        j = int(np.searchsorted(pos, a))
        if j < len(pos) and pos[j] == a:
            b = j
        else:
            lo, hi = j - 1, j
            dl, dh = a - pos[lo], pos[hi] - a
            b = lo if dl < dh or (dl == dh and lo % 2 == 0) else hi
        out[i] = b | (0x80 if v < 0 or (v == 0 and np.signbit(v)) else 0)
    return out


def np_quantize(x, round_scale=False):
    x = np.asarray(x, np.float32)
    T, H = x.shape
    g = x.reshape(T, H // 128, 128)
    amax = np.maximum(np.abs(g).max(-1), np.float32(1e-4))
    scale = (amax / np.float32(448.0)).astype(np.float32)
    if round_scale:
        scale = (2.0 ** np.ceil(np.log2(scale.astype(np.float64)))).astype(np.float32)
    q = np_fp8_bits((g / scale[..., None]).astype(np.float32)).reshape(T, H)
    return q, scale


def np_layout(topk_idx, E, R):
    T = topk_idx.shape[0]
    per_expert = np.zeros(E, np.int32)
    in_rank = np.zeros((T, R), bool)
    for t in range(T):
        for e in set(int(e) for e in topk_idx[t] if e >= 0):
            per_expert[e] += 1
            in_rank[t, e // (E // R)] = True
    return in_rank.sum(0).astype(np.int32), per_expert, in_rank


def random_topk(T, K, E, drop=0.1):
    idx = np.stack([RNG.choice(E, K, replace=False) for _ in range(T)]) if T else np.zeros((0, K))
    idx = idx.astype(np.int64)
    idx[RNG.random(idx.shape) < drop] = -1
    return idx


def random_bf16(shape, scale=1.0):
    return np_bf16_bits((RNG.standard_normal(shape) * scale).astype(np.float32))


# ---- import, errors ------------------------------------------------------------------------------

def _run_clean(code):
    """Runs `code` in a fresh interpreter with this one's sys.path and a minimal
    environment; fails the test with the child's stderr when it exits non-zero."""
    env_path = [p for p in sys.path if p]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"PYTHONPATH": ":".join(env_path), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr


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
        from deep_ep.utils import EventOverlap  # noqa: F401
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


# ---- validators ----------------------------------------------------------------------------------

ADDR = 0x7F0000000000


def cuda(dtype, shape, device=0, strides=None):
    return _core.TensorView(ADDR, dtype, list(shape), strides=strides, device=device)


def test_validate_tensor():
    ok = cuda(D.int64, (8, 4))
    _core.validate_tensor("op", "topk_idx", ok, D.int64, [8, _core.ANY], 0)
    with pytest.raises(epx.EPXValueError, match=r"op: topk_idx: must be int64 \(got \[8, 4\] "
                                                r"int64|op: topk_idx: must be int32"):
        _core.validate_tensor("op", "topk_idx", ok, D.int32, [8, 4], 0)
    with pytest.raises(epx.EPXValueError, match=r"op: topk_idx: must have shape \[9, \*\]"):
        _core.validate_tensor("op", "topk_idx", ok, D.int64, [9, _core.ANY], 0)
    with pytest.raises(epx.EPXValueError, match=r"op: topk_idx: must have shape \[8\]"):
        _core.validate_tensor("op", "topk_idx", ok, D.int64, [8], 0)
    with pytest.raises(epx.EPXValueError, match=r"op: topk_idx: must be on cuda:1"):
        _core.validate_tensor("op", "topk_idx", ok, D.int64, [8, 4], 1)
    with pytest.raises(epx.EPXValueError, match=r"op: topk_idx: must be in host memory"):
        _core.validate_tensor("op", "topk_idx", ok, D.int64, [8, 4], _core.CPU)
    nc = cuda(D.int64, (8, 4), strides=[1, 8])
    with pytest.raises(epx.EPXValueError, match=r"op: topk_idx: must be contiguous"):
        _core.validate_tensor("op", "topk_idx", nc, D.int64, [8, 4], 0)
    _core.validate_tensor("op", "topk_idx", nc, D.int64, [8, 4], 0, contiguous=False)
    null = _core.TensorView(0, D.int64, [8, 4], device=0)
    with pytest.raises(epx.EPXValueError, match=r"op: topk_idx: is null"):
        _core.validate_tensor("op", "topk_idx", null, D.int64, [8, 4], 0)


def test_validate_tensor_any_device():
    assert _core.ANY_DEVICE != _core.CPU
    _core.validate_tensor("op", "topk_idx", cuda(D.int64, (8, 4)), D.int64, [8, 4], _core.ANY_DEVICE)
    host = _core.TensorView(8, D.int64, [8, 4], device=_core.CPU)
    with pytest.raises(epx.EPXValueError, match=r"op: topk_idx: must be on a CUDA device"):
        _core.validate_tensor("op", "topk_idx", host, D.int64, [8, 4], _core.ANY_DEVICE)


def test_validate_scalars():
    _core.validate_num_experts("op", 64, 8)
    with pytest.raises(epx.EPXValueError, match=r"op: num_experts: must be > 0"):
        _core.validate_num_experts("op", 0, 8)
    with pytest.raises(epx.EPXValueError, match=r"op: num_experts: must be divisible .* 8 "
                                                r"\(got 60\)"):
        _core.validate_num_experts("op", 60, 8)
    _core.validate_hidden("op", 7168, D.bfloat16, True)
    with pytest.raises(epx.EPXValueError, match=r"op: hidden: must be > 0"):
        _core.validate_hidden("op", 0, D.bfloat16, False)
    with pytest.raises(epx.EPXValueError, match=r"op: hidden: a row must be a multiple of 16"):
        _core.validate_hidden("op", 100, D.bfloat16, False)
    with pytest.raises(epx.EPXValueError, match=r"op: hidden: FP8 needs a multiple of 128"):
        _core.validate_hidden("op", 144, D.float8_e4m3fn, True)
    for k in (1, _core.MAX_TOPK):
        _core.validate_num_topk("op", k)
    for k in (0, _core.MAX_TOPK + 1):
        with pytest.raises(epx.EPXValueError, match=r"op: topk_idx: top-k must be in \[1, 16\]"):
            _core.validate_num_topk("op", k)


def test_validate_topk_idx_values_host():
    idx = np.array([[0, 5, -1], [7, 300, 2]], np.int64)
    v = _core.TensorView.from_dlpack(idx, "topk_idx")
    _core.validate_topk_idx_values("op", v, 301)
    with pytest.raises(epx.EPXValueError,
                       match=r"op: topk_idx: values must be -1 or in \[0, num_experts=64\) "
                             r"\(element 4 is 300\)"):
        _core.validate_topk_idx_values("op", v, 64)
    idx[0, 0] = -2
    with pytest.raises(epx.EPXValueError, match=r"element 0 is -2"):
        _core.validate_topk_idx_values("op", v, 301)


T, H, R, K, E = 8, 256, 2, 4, 16


def dispatch_args(x_dtype=D.bfloat16, **over):
    a = _core.DispatchArgs()
    a.x = over.pop("x", cuda(x_dtype, (T, H)))
    a.x_scales = over.pop("x_scales", cuda(D.float32, (T, H // 128))
                          if x_dtype == D.float8_e4m3fn else None)
    a.topk_idx = over.pop("topk_idx", cuda(D.int64, (T, K)))
    a.topk_weights = over.pop("topk_weights", cuda(D.float32, (T, K)))
    a.num_tokens_per_rank = over.pop("num_tokens_per_rank", cuda(D.int32, (R,)))
    a.is_token_in_rank = over.pop("is_token_in_rank", cuda(D.bool, (T, R)))
    a.num_tokens_per_expert = over.pop("num_tokens_per_expert", cuda(D.int32, (E,)))
    for k, v in over.items():
        setattr(a, k, v)
    return a


def test_validate_dispatch_accepts_good_args():
    _core.validate_dispatch(dispatch_args(), R, 0)
    _core.validate_dispatch(dispatch_args(D.float8_e4m3fn), R, 0)
    _core.validate_dispatch(dispatch_args(topk_idx=None, topk_weights=None), R, 0)
    h = _testing().dispatch_handle(R, T, 5, H)
    _core.validate_dispatch(dispatch_args(topk_idx=None, topk_weights=None, handle=h,
                                          num_tokens_per_rank=None, is_token_in_rank=None,
                                          num_tokens_per_expert=None), R, 0)


def test_validate_dispatch_rows_and_scales_as_deepep():
    # rows of any dtype (a multiple of 16 bytes); FP8 with or without scales,
    # float32 or int32, per group or per token
    for dt in (D.float32, D.int32, D.int64, D.bool):
        _core.validate_dispatch(dispatch_args(x=cuda(dt, (T, H))), R, 0)
    _core.validate_dispatch(dispatch_args(D.float8_e4m3fn, x_scales=None), R, 0)
    for sd, s in ((D.int32, 2), (D.float32, 1), (D.int32, 1), (D.float32, 3)):
        _core.validate_dispatch(dispatch_args(D.float8_e4m3fn, x_scales=cuda(sd, (T, s))), R, 0)
    _core.validate_dispatch(dispatch_args(x=cuda(D.float8_e4m3fn, (T, 144))), R, 0)


@pytest.mark.parametrize("over, pattern", [
    (dict(x=cuda(D.bfloat16, (T, H, 1))), r"dispatch: x: must be \[num_tokens, hidden\]"),
    (dict(x=cuda(D.bfloat16, (T, H), device=1)), r"dispatch: x: must be on cuda:0"),
    (dict(x=cuda(D.bfloat16, (T, H), strides=[1, T])), r"dispatch: x: rows must be contiguous"),
    (dict(x=cuda(D.float8_e4m3fn, (T, 8))), r"dispatch: hidden: a row must be a multiple of 16"),
    (dict(x_scales=cuda(D.float32, (T, 2))), r"dispatch: x_scales: needs x of 1-byte elements"),
    (dict(x=cuda(D.float8_e4m3fn, (T, H)), x_scales=cuda(D.int64, (T, 2))),
     r"dispatch: x_scales: must be float32"),
    (dict(x=cuda(D.float8_e4m3fn, (T, H)), x_scales=cuda(D.float32, (T, 0))),
     r"dispatch: x_scales: must have at least one scale per token"),
    (dict(x=cuda(D.float8_e4m3fn, (T, H)), x_scales=cuda(D.float32, (T + 1, 2))),
     r"dispatch: x_scales: must have shape \[8, \*\]"),
    (dict(num_tokens_per_rank=None), r"dispatch: num_tokens_per_rank: .* required without"),
    (dict(num_tokens_per_rank=cuda(D.int64, (R,))),
     r"dispatch: num_tokens_per_rank: must be int32"),
    (dict(is_token_in_rank=cuda(D.bool, (T, 3))), r"dispatch: is_token_in_rank: must have shape "
                                                  r"\[8, 2\]"),
    (dict(num_tokens_per_expert=cuda(D.int32, (15,))), r"dispatch: num_experts: must be divisible"),
    (dict(topk_idx=cuda(D.int64, (T, 17)), topk_weights=None), r"dispatch: topk_idx: top-k must "
                                                                r"be in \[1, 16\]"),
    (dict(topk_idx=cuda(D.int32, (T, K))), r"dispatch: topk_idx: must be int64"),
    (dict(topk_weights=cuda(D.float32, (T, K + 1))), r"dispatch: topk_weights: must have shape "
                                                     r"\[8, 4\]"),
    (dict(topk_idx=None), r"dispatch: topk_weights: needs topk_idx"),
    (dict(expert_alignment=0), r"dispatch: expert_alignment: must be >= 1 \(got 0\)"),
    (dict(num_worst_tokens=-1), r"dispatch: num_worst_tokens: must be >= 0"),
    (dict(handle="a cached handle"),
     r"dispatch: topk_idx: must be None for a cached dispatch"),
])
def test_validate_dispatch_rejects(over, pattern):
    if over.get("handle") == "a cached handle":
        over = dict(over, handle=_testing().dispatch_handle(R, T, 5, H))
    with pytest.raises(epx.EPXValueError, match=pattern):
        _core.validate_dispatch(dispatch_args(**over), R, 0)


def test_validate_combine():
    N = 5
    h = _testing().dispatch_handle(R, T, N, H)
    a = _core.CombineArgs()
    a.x = cuda(D.bfloat16, (N, H))
    with pytest.raises(epx.EPXValueError, match=r"combine: handle: is required"):
        _core.validate_combine(a, R, 0)
    a.handle = h
    _core.validate_combine(a, R, 0)
    a.bias_0 = cuda(D.bfloat16, (T, H))
    a.topk_weights = cuda(D.float32, (N, K))
    _core.validate_combine(a, R, 0)
    with pytest.raises(epx.EPXValueError, match=r"combine: handle: was made by a buffer of"):
        _core.validate_combine(a, 4, 0)
    a.bias_1 = cuda(D.bfloat16, (N, H))
    with pytest.raises(epx.EPXValueError, match=r"combine: bias_1: must have shape \[8, 256\]"):
        _core.validate_combine(a, R, 0)
    a.bias_1 = None
    a.x = cuda(D.bfloat16, (N + 1, H))
    with pytest.raises(epx.EPXValueError, match=r"combine: x: must have shape \[5, \*\]"):
        _core.validate_combine(a, R, 0)
    a.x = cuda(D.bfloat16, (N, 2 * H))
    with pytest.raises(epx.EPXValueError, match=r"combine: x: hidden must match the dispatch"):
        _core.validate_combine(a, R, 0)


def test_handles_without_their_routing_tensors_are_refused():
    """A handle rebuilt by hand used to reach the kernels with null pointers."""
    N = 5
    a = _core.CombineArgs()
    a.x = cuda(D.bfloat16, (N, H))
    for rpn, name in ((0, "send_slot"), (0, "recv_offsets"), (1, "net_recv_meta")):
        a.handle = _testing().dispatch_handle(R, T, N, H, ranks_per_node=rpn, drop=name)
        with pytest.raises(epx.EPXValueError,
                           match=rf"combine: handle: lacks its routing tensor {name}"):
            _core.validate_combine(a, R, 0)
        a.handle = _testing().dispatch_handle(R, T, N, H, ranks_per_node=rpn)
        _core.validate_combine(a, R, 0)
    cached = dict(topk_idx=None, topk_weights=None, num_tokens_per_rank=None,
                  is_token_in_rank=None, num_tokens_per_expert=None)
    with pytest.raises(epx.EPXValueError,
                       match=r"dispatch: handle: lacks its routing tensor is_token_in_rank"):
        _core.validate_dispatch(dispatch_args(
            handle=_testing().dispatch_handle(R, T, 5, H, drop="all"), **cached), R, 0)


def test_misaligned_views_are_refused_by_name():
    """x[:, 4:4 + H] of a [T, H + 8] bf16 tensor starts 8 bytes past a multiple of
    16: the kernels' 16-byte loads fault on it (a crash before this check)."""
    row = H + 8
    view = _core.TensorView(ADDR + 8, D.bfloat16, [T, H], strides=[row, 1], device=0)
    with pytest.raises(epx.EPXValueError,
                       match=r"dispatch: x: must start at a 16-byte aligned address.*8 bytes "
                             r"past a multiple of 16"):
        _core.validate_dispatch(dispatch_args(x=view), R, 0)
    view = _core.TensorView(ADDR + 16, D.bfloat16, [T, H], strides=[row, 1], device=0)
    _core.validate_dispatch(dispatch_args(x=view), R, 0)
    flat = _core.TensorView(ADDR + 2, D.bfloat16, [T, H], device=0)  # a flat slice 2 bytes off
    with pytest.raises(epx.EPXValueError, match=r"low_latency_dispatch: x: must start at a 16-byte"):
        _core.validate_low_latency_dispatch(ll_args(x=flat), R, 0)
    a = _core.CombineArgs()
    a.handle = _testing().dispatch_handle(R, T, 5, H)
    a.x = cuda(D.bfloat16, (5, H))
    a.bias_0 = _core.TensorView(ADDR + 4, D.bfloat16, [T, H], device=0)
    with pytest.raises(epx.EPXValueError, match=r"combine: bias_0: must start at a 16-byte"):
        _core.validate_combine(a, R, 0)
    a.bias_0 = None
    a.topk_weights = _core.TensorView(ADDR + 2, D.float32, [5, K], device=0)
    with pytest.raises(epx.EPXValueError,
                       match=r"combine: topk_weights: must be aligned to its element size"):
        _core.validate_combine(a, R, 0)


def test_low_latency_size_hint_refuses_what_the_ops_refuse():
    with pytest.raises(epx.EPXValueError, match=r"num_max_dispatch_tokens_per_rank.*24576"):
        epx.Buffer.get_low_latency_rdma_size_hint(1024, 7168, 32, 256)
    assert epx.Buffer.get_low_latency_rdma_size_hint(768, 7168, 32, 256) > 0


def ll_args(**over):
    a = _core.LowLatencyDispatchArgs()
    a.x = cuda(D.bfloat16, (T, H))
    a.topk_idx = cuda(D.int64, (T, K))
    a.num_max_dispatch_tokens_per_rank = 16
    a.num_experts = E
    for k, v in over.items():
        setattr(a, k, v)
    return a


def test_validate_low_latency_dispatch():
    _core.validate_low_latency_dispatch(ll_args(), R, 0)
    _core.validate_low_latency_dispatch(ll_args(round_scale=True, use_ue8m0=True), R, 0)
    cases = [
        (dict(num_max_dispatch_tokens_per_rank=0),
         r"low_latency_dispatch: num_max_dispatch_tokens_per_rank: must be in \[1, 1024\]"),
        (dict(num_max_dispatch_tokens_per_rank=4),
         r"low_latency_dispatch: x: has 8 tokens, more than num_max_dispatch_tokens_per_rank=4"),
        (dict(x=cuda(D.bfloat16, (T, 192))), r"low_latency_dispatch: hidden: must be a multiple "
                                             r"of 128"),
        (dict(num_experts=15), r"low_latency_dispatch: num_experts: must be divisible"),
        (dict(use_ue8m0=True), r"low_latency_dispatch: use_ue8m0: needs round_scale=True"),
        (dict(use_fp8=False, round_scale=True), r"low_latency_dispatch: use_fp8: round_scale and"),
        (dict(cumulative_local_expert_recv_stats=cuda(D.int32, (E,))),
         r"low_latency_dispatch: cumulative_local_expert_recv_stats: must have shape \[8\]"),
        (dict(dispatch_wait_recv_cost_stats=cuda(D.int32, (R,))),
         r"low_latency_dispatch: dispatch_wait_recv_cost_stats: must be int64"),
        (dict(dispatch_wait_recv_cost_stats=cuda(D.int64, (R + 1,))),
         r"low_latency_dispatch: dispatch_wait_recv_cost_stats: must have shape \[2\]"),
    ]
    _core.validate_low_latency_dispatch(
        ll_args(dispatch_wait_recv_cost_stats=cuda(D.int64, (R,))), R, 0)
    for over, pattern in cases:
        with pytest.raises(epx.EPXValueError, match=pattern):
            _core.validate_low_latency_dispatch(ll_args(**over), R, 0)


def test_low_latency_handle_is_deep_eps_tuple():
    """DeepEP code indexes the handle: (src_info, layout_range, maxT, hidden,
    num_experts); EPX's state rides along and the calls unwrap it."""
    from epx.handles import LowLatencyHandle, core_low_latency_handle

    maxT = 16
    core = _testing().low_latency_handle(R, E, maxT, H, T, K)
    src_info, layout_range = object(), object()
    h = LowLatencyHandle(core, src_info, layout_range)
    assert isinstance(h, tuple) and len(h) == 5
    assert h[0] is src_info and h[1] is layout_range
    assert tuple(h[2:]) == (maxT, H, E)
    a, b, m, hid, e = h  # DeepEP's unpacking
    assert (m, hid, e) == (maxT, H, E)
    assert h.core is core
    assert h.num_tokens == T and h.num_topk == K and h.num_ranks == R  # EPX's attributes
    assert core_low_latency_handle("op", h) is core
    assert core_low_latency_handle("op", core) is core
    with pytest.raises(TypeError, match=r"op: handle: expected the handle returned by "
                                        r"low_latency_dispatch, got a plain tuple"):
        core_low_latency_handle("op", tuple(h))
    with pytest.raises(TypeError, match=r"got int"):
        core_low_latency_handle("op", 7)
    with pytest.raises(TypeError, match=r"core: expected an epx._core.LowLatencyHandle"):
        LowLatencyHandle((1, 2), src_info, layout_range)
    with pytest.raises(AttributeError):
        h.no_such_attribute
    with pytest.raises(TypeError, match="cannot be pickled"):
        import pickle
        pickle.dumps(h)
    assert "num_max_dispatch_tokens_per_rank=16" in repr(h)
    assert epx.LowLatencyHandle is LowLatencyHandle


def test_validate_low_latency_combine():
    maxT = 16
    h = _testing().low_latency_handle(R, E, maxT, H, T, K)
    a = _core.LowLatencyCombineArgs()
    a.x = cuda(D.bfloat16, (E // R, R * maxT, H))
    a.topk_idx = cuda(D.int64, (T, K))
    a.topk_weights = cuda(D.float32, (T, K))
    with pytest.raises(epx.EPXValueError, match=r"low_latency_combine: handle: is required"):
        _core.validate_low_latency_combine(a, R, 0)
    a.handle = h
    _core.validate_low_latency_combine(a, R, 0)
    a.out = cuda(D.bfloat16, (T + 1, H))
    with pytest.raises(epx.EPXValueError, match=r"low_latency_combine: out: must have shape "
                                                r"\[8, 256\]"):
        _core.validate_low_latency_combine(a, R, 0)
    a.out = None
    a.combine_wait_recv_cost_stats = cuda(D.int64, (R,))
    _core.validate_low_latency_combine(a, R, 0)
    a.combine_wait_recv_cost_stats = cuda(D.int64, (R, 1))
    with pytest.raises(epx.EPXValueError, match=r"low_latency_combine: "
                                                r"combine_wait_recv_cost_stats: must have shape "
                                                r"\[2\]"):
        _core.validate_low_latency_combine(a, R, 0)
    a.combine_wait_recv_cost_stats = None
    a.x = cuda(D.bfloat16, (E // R, maxT, H))
    with pytest.raises(epx.EPXValueError, match=r"low_latency_combine: x: must have shape "
                                                r"\[8, 32, 256\]"):
        _core.validate_low_latency_combine(a, R, 0)


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


# ---- reference model -----------------------------------------------------------------------------

def test_bf16_conversions():
    x = np.concatenate([RNG.standard_normal(2000).astype(np.float32) * 100,
                        np.array([0.0, -0.0, 1.0, 3.0e38, -3.4e38, 1e-40, np.inf, -np.inf],
                                 np.float32),
                        # exact ties: round half to even
                        np_bf16_float([0x3F80, 0x3F81]) + np.float32(2.0 ** -8)])
    expect = np_bf16_bits(x)
    got_scalar = np.array([_core.ref.float_to_bf16(float(v)) for v in x], np.uint16)
    np.testing.assert_array_equal(got_scalar, expect)
    np.testing.assert_array_equal(ref.bf16_from_float(x), expect)
    np.testing.assert_array_equal(ref.bf16_to_float(expect), np_bf16_float(expect))
    assert _core.ref.bf16_to_float(0x3FC0) == 1.5
    assert np.isnan(_core.ref.bf16_to_float(_core.ref.float_to_bf16(float("nan"))))
    assert np.isnan(ref.bf16_to_float(ref.bf16_from_float(np.array([np.nan], np.float32))))[0]


def test_fp8_conversions():
    for b in range(256):
        if b in (0x7F, 0xFF):
            assert np.isnan(_core.ref.fp8_e4m3_to_float(b))
        else:
            assert _core.ref.fp8_e4m3_to_float(b) == FP8[b], hex(b)
    x = np.concatenate([RNG.standard_normal(3000) * 50, RNG.standard_normal(500) * 0.01,
                        [0.0, 448.0, 480.0, 1e6, -1e6, 2.0 ** -9, 2.0 ** -10, 1.0625, 1.1875]])
    x = x.astype(np.float32)
    got = np.array([_core.ref.float_to_fp8_e4m3(float(v)) for v in x], np.uint8)
    np.testing.assert_array_equal(got, np_fp8_bits(x))
    assert _core.ref.float_to_fp8_e4m3(1.0) == 0x38 and _core.ref.float_to_fp8_e4m3(-2.0) == 0xC0


@pytest.mark.parametrize("round_scale", [False, True])
def test_quantize_fp8(round_scale):
    magnitude = np.array([1e-6, 1.0, 300.0]).repeat(128)  # one group below the amax floor
    x = (RNG.standard_normal((5, 384)) * magnitude).astype(np.float32)
    q, s = ref.quantize_fp8(x, round_scale)
    eq, es = np_quantize(x, round_scale)
    np.testing.assert_array_equal(s, es)
    np.testing.assert_array_equal(q, eq)
    if round_scale:
        assert np.all(np.log2(s) == np.round(np.log2(s)))
    back = ref.dequantize_fp8(q, s)
    big = np.abs(x) > 1e-3
    np.testing.assert_allclose(back[big], x[big], rtol=2 ** -3)
    with pytest.raises(ValueError):
        _core.ref.quantize_row_fp8(np.zeros(100, np.float32))
    # The batched call is the per-row one, row by row.
    for t in range(x.shape[0]):
        rq, rs = _core.ref.quantize_row_fp8(x[t], round_scale)
        np.testing.assert_array_equal(q[t], rq)
        np.testing.assert_array_equal(s[t], rs)
    with pytest.raises(ValueError, match="hidden"):
        _core.ref.quantize_rows_fp8(np.zeros(256, np.float32), 100)
    with pytest.raises(ValueError, match="rows x hidden"):
        _core.ref.quantize_rows_fp8(np.zeros(300, np.float32), 128)
    assert ref.quantize_fp8(np.zeros((0, 256), np.float32))[0].shape == (0, 256)


def test_ue8m0():
    for k in range(-20, 20):
        assert _core.ref.scale_to_ue8m0(2.0 ** k) == k + 127
        assert _core.ref.ue8m0_to_scale(k + 127) == 2.0 ** k


def test_logfmt_roundtrip_bound():
    H = 256
    row = (RNG.standard_normal(H) * np.exp(RNG.uniform(-3, 3, H))).astype(np.float32)
    code = _core.ref.logfmt_encode(row)
    assert code.dtype == np.uint8 and code.size == _core.ref.logfmt_bytes(H)
    back = _core.ref.logfmt_decode(code, H)
    bound = _core.ref.logfmt_max_rel_error()
    assert 0 < bound < 0.1
    nonzero = back != 0
    assert nonzero.mean() > 0.9
    rel = np.abs(back[nonzero] - row[nonzero]) / np.abs(row[nonzero])
    assert rel.max() <= bound * (1 + 1e-6)
    # A header no encoder writes (lmax far past 128 here) is refused, not decoded.
    bad = code.copy()
    bad[0:4] = np.frombuffer(np.float32(1000.0).tobytes(), dtype=np.uint8)
    with pytest.raises(ValueError, match="header no encoder writes"):
        _core.ref.logfmt_decode(bad, H)


def test_dispatch_layout():
    Tn, Kn, En, Rn = 50, 6, 32, 4
    idx = random_topk(Tn, Kn, En, drop=0.2)
    per_rank, per_expert, in_rank = ref.dispatch_layout(idx, En, Rn)
    e_rank, e_expert, e_in = np_layout(idx, En, Rn)
    np.testing.assert_array_equal(per_rank, e_rank)
    np.testing.assert_array_equal(per_expert, e_expert)
    np.testing.assert_array_equal(in_rank, e_in)


def np_ht_dispatch(xs, idxs, ws, En, align):
    """Rank r receives, source by source and in token order, every token with an expert on r."""
    Rn = len(xs)
    El = En // Rn
    outs = []
    for r in range(Rn):
        rows, ridx, rw, src = [], [], [], []
        counts = np.zeros(El, np.int64)
        for s in range(Rn):
            for t in range(idxs[s].shape[0]):
                owners = {int(e) // El for e in idxs[s][t] if e >= 0}
                if r not in owners:
                    continue
                local = np.where((idxs[s][t] >= r * El) & (idxs[s][t] < (r + 1) * El),
                                 idxs[s][t] - r * El, -1)
                for e in local[local >= 0]:
                    counts[e] += 1
                rows.append(xs[s][t])
                ridx.append(local)
                # DeepEP's meaning: a pick of another rank's expert arrives with weight 0.
                rw.append(np.where(local >= 0, ws[s][t], 0) if ws is not None else None)
                src.append((s, t))
        outs.append(dict(rows=rows, idx=np.array(ridx).reshape(-1, idxs[0].shape[1]),
                         w=rw, src=src, counts=((counts + align - 1) // align * align).tolist()))
    return outs


@pytest.mark.parametrize("fp8", [False, True])
def test_ht_dispatch(fp8):
    Rn, Hn, Kn, En, align = 3, 256, 4, 12, 4
    Ts = [7, 0, 11]
    idxs = [random_topk(t, Kn, En) for t in Ts]
    ws = [RNG.random((t, Kn)).astype(np.float32) for t in Ts]
    if fp8:
        xs = [ref.quantize_fp8(RNG.standard_normal((t, Hn)).astype(np.float32)) for t in Ts]
        rows_of = [np.concatenate([q, s.view(np.uint8)], axis=1) for q, s in xs]
    else:
        xs = [random_bf16((t, Hn)) for t in Ts]
        rows_of = xs
    got = ref.ht_dispatch(xs, idxs, En, topk_weights=ws, expert_alignment=align)
    want = np_ht_dispatch(rows_of, idxs, ws, En, align)
    for r in range(Rn):
        g, w = got[r], want[r]
        N = len(w["rows"])
        if fp8:
            q, s = g["recv_x"]
            assert q.shape == (N, Hn) and s.shape == (N, Hn // 128)
            flat = np.concatenate([q, s.view(np.uint8)], axis=1)
        else:
            flat = g["recv_x"]
            assert flat.shape == (N, Hn)
        np.testing.assert_array_equal(flat, np.array(w["rows"]).reshape(N, -1))
        np.testing.assert_array_equal(g["recv_topk_idx"], w["idx"])
        np.testing.assert_array_equal(g["recv_topk_weights"], np.array(w["w"]).reshape(N, Kn))
        assert g["num_recv_tokens_per_expert"] == w["counts"]
        np.testing.assert_array_equal(g["recv_src_rank"], [s for s, _ in w["src"]])
        np.testing.assert_array_equal(g["recv_src_idx"], [t for _, t in w["src"]])


def test_ht_combine():
    Rn, Hn, Kn, En = 3, 128, 3, 9
    Ts = [6, 4, 9]
    idxs = [random_topk(t, Kn, En) for t in Ts]
    disp = ref.ht_dispatch([random_bf16((t, Hn)) for t in Ts], idxs, En)
    ys = [random_bf16((len(d["recv_src_idx"]), Hn)) for d in disp]
    wts = [RNG.random((len(d["recv_src_idx"]), Kn)).astype(np.float32) for d in disp]
    bias = [(random_bf16((t, Hn)), None) for t in Ts]
    got = ref.ht_combine(idxs, ys, En, topk_weights=wts, bias=bias)
    for s in range(Rn):
        acc = np.zeros((Ts[s], Hn), np.float32)
        wacc = np.zeros((Ts[s], Kn), np.float32)
        for r in range(Rn):  # rows of rank r that came from source s, summed in rank order
            for row in np.nonzero(disp[r]["recv_src_rank"] == s)[0]:
                t = disp[r]["recv_src_idx"][row]
                acc[t] += np_bf16_float(ys[r][row])
                wacc[t] += wts[r][row]
        acc += np_bf16_float(bias[s][0])
        cx, cw = got[s]
        np.testing.assert_array_equal(cx, np_bf16_bits(acc))
        np.testing.assert_allclose(cw, wacc, rtol=1e-6)


def test_ht_combine_across_nodes():
    """ranks_per_node: each node's rows summed (float32, rank order) and rounded to BF16,
    then the nodes' rows in node order, then the bias, rounded once more."""
    Rn, Ln, Hn, Kn, En = 4, 2, 128, 4, 16
    Ts = [9, 0, 14, 5]
    idxs = [random_topk(t, Kn, En) for t in Ts]
    disp = ref.ht_dispatch([random_bf16((t, Hn)) for t in Ts], idxs, En)
    ys = [random_bf16((len(d["recv_src_idx"]), Hn)) for d in disp]
    wts = [RNG.random((len(d["recv_src_idx"]), Kn)).astype(np.float32) for d in disp]
    bias = [(random_bf16((t, Hn)), None) for t in Ts]
    got = ref.ht_combine(idxs, ys, En, topk_weights=wts, bias=bias, ranks_per_node=Ln)
    flat = ref.ht_combine(idxs, ys, En, topk_weights=wts, bias=bias)
    differs = False
    for s in range(Rn):
        acc = np.zeros((Ts[s], Hn), np.float32)
        wacc = np.zeros((Ts[s], Kn), np.float32)
        for n in range(Rn // Ln):
            node = np.zeros((Ts[s], Hn), np.float32)
            wnode = np.zeros((Ts[s], Kn), np.float32)
            reached = np.zeros(Ts[s], bool)
            for r in range(n * Ln, (n + 1) * Ln):
                for row in np.nonzero(disp[r]["recv_src_rank"] == s)[0]:
                    t = disp[r]["recv_src_idx"][row]
                    node[t] += np_bf16_float(ys[r][row])
                    wnode[t] += wts[r][row]
                    reached[t] = True
            acc[reached] += np_bf16_float(np_bf16_bits(node[reached]))
            wacc[reached] += wnode[reached]
        acc += np_bf16_float(bias[s][0])
        cx, cw = got[s]
        np.testing.assert_array_equal(cx, np_bf16_bits(acc))
        np.testing.assert_array_equal(cw, wacc)
        differs = differs or not np.array_equal(cx, flat[s][0])
    assert differs, "grouping by node changed no sum: the test shows nothing"
    one_node = ref.ht_combine(idxs, ys, En, topk_weights=wts, bias=bias, ranks_per_node=Rn)
    for s in range(Rn):
        np.testing.assert_array_equal(one_node[s][0], flat[s][0])
    with pytest.raises(ValueError, match="ranks_per_node"):
        ref.ht_combine(idxs, ys, En, ranks_per_node=3)


def np_ll_dispatch(xs, idxs, En, maxT):
    """Expert e's rows: source 0's tokens (token order), then source 1's, ...; once per token."""
    Rn = len(xs)
    El, rows = En // Rn, Rn * maxT
    Hn = xs[0].shape[1]
    outs = [dict(x=np.zeros((El, rows, Hn), np.uint16), count=np.zeros(El, np.int64),
                 src=np.full((El, rows), -1), rank=np.full((El, rows), -1),
                 rng=np.zeros((El, Rn), np.int64)) for _ in range(Rn)]
    for e in range(En):
        o, le = outs[e // El], e % El
        for s in range(Rn):
            begin = o["count"][le]
            for t in range(xs[s].shape[0]):
                if e in idxs[s][t]:
                    slot = o["count"][le]
                    o["x"][le, slot], o["src"][le, slot], o["rank"][le, slot] = xs[s][t], t, s
                    o["count"][le] += 1
            o["rng"][le, s] = (begin << 32) | (o["count"][le] - begin)
    return outs


def test_ll_dispatch_and_combine():
    Rn, Hn, Kn, En, maxT = 2, 128, 3, 6, 8
    Ts = [8, 5]
    idxs = [random_topk(t, Kn, En, drop=0.2) for t in Ts]
    idxs[0][0] = [1, 1, -1]  # a repeated expert is sent once and weighted twice
    xs = [random_bf16((t, Hn)) for t in Ts]
    got = ref.ll_dispatch(xs, idxs, En, maxT)
    want = np_ll_dispatch(xs, idxs, En, maxT)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g["recv_count"], w["count"])
        np.testing.assert_array_equal(g["src_info"], w["src"])
        np.testing.assert_array_equal(g["recv_src_rank"], w["rank"])
        np.testing.assert_array_equal(g["layout_range"], w["rng"])
        for le in range(En // Rn):
            n = w["count"][le]
            np.testing.assert_array_equal(g["recv_x"][le, :n], w["x"][le, :n])

    # combine the received rows (expert output = input) with weights
    ws = [RNG.random((t, Kn)).astype(np.float32) for t in Ts]
    outs = ref.ll_combine([g["recv_x"] for g in got], idxs, ws, En, maxT)
    for s in range(Rn):
        expect = np.zeros((Ts[s], Hn), np.float32)
        for t in range(Ts[s]):
            for k in range(Kn):
                if idxs[s][t, k] >= 0:
                    expect[t] += ws[s][t, k] * np_bf16_float(xs[s][t])
        assert outs[s].shape == (Ts[s], Hn)
        np.testing.assert_allclose(np_bf16_float(outs[s]), expect, rtol=2 ** -7, atol=1e-30)

    # FP8: the received rows are the quantized source rows
    got8 = ref.ll_dispatch(xs, idxs, En, maxT, use_fp8=True)
    for g, w in zip(got8, want):
        for le in range(En // Rn):
            n = w["count"][le]
            q, sc = np_quantize(np_bf16_float(w["x"][le, :n]).reshape(n, Hn))
            np.testing.assert_array_equal(g["recv_x"][le, :n], q)
            np.testing.assert_array_equal(g["recv_x_scales"][le, :n], sc)


def test_reference_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_experts"):
        ref.ht_dispatch([random_bf16((2, 128))], [random_topk(2, 2, 4)], num_experts=0)


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


# ---- epx.bench: command line, byte counts, statistics, report, plot ------------------------------

def _bench():
    from epx import bench

    return bench


def test_bench_args_defaults():
    args = _bench().parse_args([])
    assert (args.mode, args.tokens, args.ll_tokens, args.hidden, args.topk, args.experts) == \
        ("all", 4096, 128, 7168, 8, 256)
    assert args.warmup == 10 and args.iters == 50  # DESIGN.md: median of >= 50 runs
    assert not args.sweep and not args.compare_torch and args.plot == "" and args.json == ""
    assert args.sweep_tokens == [256, 512, 1024, 2048, 4096]
    assert args.sweep_ll_tokens == [1, 8, 32, 64, 128]
    assert args.command == "python -m epx.bench"
    assert args.hold_us == _bench().HOLD_US and _bench().parse_args(["--hold-us", "0"]).hold_us == 0


def test_bench_args_sweep_and_plot():
    b = _bench()
    args = b.parse_args(["--compare-torch", "--plot", "out.png", "--json", "r.json",
                         "--ranks", "4"])
    assert args.sweep and args.compare_torch and args.plot == "out.png" and args.ranks == 4
    args = b.parse_args(["--sweep-tokens", "128,1024", "--mode", "ht"])
    assert args.sweep and args.sweep_tokens == [128, 1024] and args.sweep_ll_tokens == [1, 8, 32,
                                                                                          64, 128]
    args = b.parse_args(["--sweep-ll-tokens=4,16"])
    assert args.sweep and args.sweep_ll_tokens == [4, 16]
    args = b.parse_args(["--sweep"])
    assert args.sweep and args.sweep_tokens == list(b.HT_SWEEP)
    assert b._points(b.parse_args(["--tokens", "300", "--sweep-tokens", "256,512", "--mode",
                                   "ht"])) == {"ht": [256, 300, 512]}
    assert b._points(b.parse_args(["--ll-tokens", "64"])) == {"ht": [4096], "ll": [64]}


@pytest.mark.parametrize("argv, message", [
    (["--sweep-tokens", "256,x"], "comma-separated"),
    (["--sweep-tokens", "0,8"], "positive token counts"),
    (["--tokens", "0"], "positive integer"),
    (["--sms", "23"], "even number"),
    (["--hidden", "1000"], "multiple of 128"),
    (["--topk", "9", "--experts", "8"], "more than --experts"),
    (["--replot", "r.json"], "--replot needs --plot"),
    (["--mode", "xx"], "invalid choice"),
    (["--hold-us", "-1"], "non-negative integer"),
])
def test_bench_args_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        _bench().parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_byte_counts():
    b = _bench()
    H = 7168
    assert b.ht_bytes(10, H) == 10 * H * 2
    assert b.ht_bytes(10, H, fp8=True) == 10 * H + 10 * 56 * 4
    assert b.ll_bytes(3, H) == 3 * 2 * H
    assert b.ll_bytes(3, H, fp8=True) == 3 * (H + 56 * 4 + 16)
    assert b.ll_bytes(0, H, fp8=True) == 0
    assert b.op_bytes("ht", "fp8", 5, 256) == 5 * 256 + 5 * 2 * 4
    assert b.op_bytes("ll", "bf16", 5, 256) == 5 * 512
    assert b.op_bytes("ll", None, 5, 256) is None


def test_bench_byte_counts_reproduce_cpp_figures():
    """The formulas give the GB/s the C++ epx-bench published (bench/results), from its own
    times and counts (GB/s there is the mean over ranks of bytes / time, so allow 2%)."""
    import json
    import os

    b = _bench()
    root = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "results")
    ll_path, ht_path = os.path.join(root, "h200x4-ll.json"), os.path.join(root, "h200x4-ht.json")
    if not (os.path.exists(ll_path) and os.path.exists(ht_path)):
        pytest.skip("bench/results/h200x4-{ll,ht}.json not present")
    ll, ht = json.load(open(ll_path)), json.load(open(ht_path))
    sel, H = int(ll["num_valid_selections"]), 7168
    assert ll["num_valid_selections"] == 128 * 8
    assert b.ll_bytes(sel, H, True) / ll["dispatch_us"] / 1e3 == \
        pytest.approx(ll["dispatch_gbps"], rel=0.02)
    assert b.ll_bytes(sel, H) / ll["dispatch_bf16_us"] / 1e3 == \
        pytest.approx(ll["dispatch_bf16_gbps"], rel=0.02)
    assert b.ll_bytes(sel, H) / ll["combine_us"] / 1e3 == pytest.approx(ll["combine_gbps"],
                                                                        rel=0.02)
    N = ht["recv_tokens_rank0"]  # rank 0's count; the other ranks' differ by a few %
    assert b.ht_bytes(N, H) / ht["dispatch_bf16_us"] / 1e3 == \
        pytest.approx(ht["dispatch_bf16_gbps"], rel=0.02)
    assert b.ht_bytes(N, H, True) / ht["dispatch_fp8_us"] / 1e3 == \
        pytest.approx(ht["dispatch_fp8_gbps"], rel=0.02)


def test_bench_statistics():
    b = _bench()
    assert b.median([5.0, 1.0, 3.0]) == 3.0
    assert b.median([4.0, 1.0, 3.0, 2.0]) == 3.0  # element n/2 of the sorted runs, as C++
    assert b.spread([1.0, 2.0, 6.0]) == {"mean": 3.0, "min": 1.0, "max": 6.0}
    with pytest.raises(ValueError):
        b.median([])
    s = b.summarize_op([{"us": 100.0, "bytes": 1_000_000}, {"us": 200.0, "bytes": 3_000_000}])
    assert s["us"] == {"mean": 150.0, "min": 100.0, "max": 200.0}
    # GB/s per rank first (10 and 15), then over ranks; not total bytes / mean time
    assert s["gbps"] == {"mean": 12.5, "min": 10.0, "max": 15.0}
    assert s["bytes"]["mean"] == 2_000_000
    t = b.summarize_op([{"us": 7.0, "bytes": None}, {"us": 9.0, "bytes": None}])
    assert t["gbps"] is None and t["us"]["mean"] == 8.0
    assert "host_us" not in t
    h = b.summarize_op([{"us": 7.0, "host_us": 3.0, "bytes": None},
                        {"us": 9.0, "host_us": 5.0, "bytes": None}])
    assert h["host_us"] == {"mean": 4.0, "min": 3.0, "max": 5.0}


def _fake_ranks(world=2, sweep=True):
    """Per-rank measurements as _measure_ht/_measure_ll return them, with made-up times."""
    ranks = []
    for r in range(world):
        ht, ll = [], []
        for T in ((256, 4096) if sweep else (4096,)):
            N = 3 * T + 100 * r
            ops = {k: {"us": (100.0 + r) * T / 256, "host_us": 20.0 + r, "bytes": None
                       if kind is None else _bench().op_bytes("ht", kind, N, 7168)}
                   for k, _, kind in _bench().HT_OPS}
            torch_ops = {k: {"us": ops[k]["us"] * 2, "bytes": ops[k]["bytes"]}
                         for k in ("dispatch_bf16", "dispatch_fp8", "combine",
                                   "dispatch_bf16_full")}
            ht.append({"tokens": T, "num_recv_tokens": N, "ops": ops, "torch": torch_ops})
        for T in ((8, 128) if sweep else (128,)):
            sel = T * 8
            ops = {k: {"us": 10.0 + r + T / 8, "bytes": None if kind is None else
                       _bench().op_bytes("ll", kind, sel, 7168)}
                   for k, _, kind in _bench().LL_OPS}
            torch_ops = {k: {"us": ops[k]["us"] * 4, "bytes": ops[k]["bytes"]}
                         for k in ("dispatch_fp8", "dispatch_bf16", "combine")}
            ll.append({"tokens": T, "num_selections": sel, "ops": ops, "torch": torch_ops})
        ranks.append({"ht": ht, "ll": ll})
    return ranks


def test_bench_result_and_report(monkeypatch):
    b = _bench()
    args = b.parse_args(["--compare-torch", "--sweep-tokens", "256,4096", "--sweep-ll-tokens",
                         "8,128"])
    res = b.build_result(args, 2, _fake_ranks(), device="Fake GPU x2")
    ht, ll = res["ht"], res["ll"]
    assert res["num_ranks"] == 2 and res["device"] == "Fake GPU x2"
    assert ht["tokens"] == 4096 and ll["tokens"] == 128
    # headline names of the C++ bench, from the 4096-token point: rank 0 100*16 us, rank 1 101*16
    us0, us1 = 100.0 * 16, 101.0 * 16
    assert ht["dispatch_bf16_us"] == pytest.approx((us0 + us1) / 2)
    g0 = b.ht_bytes(3 * 4096, 7168) / us0 / 1e3
    g1 = b.ht_bytes(3 * 4096 + 100, 7168) / us1 / 1e3
    assert ht["dispatch_bf16_gbps"] == pytest.approx((g0 + g1) / 2)
    assert ht["min_rank_gbps"]["dispatch_bf16"] == pytest.approx(min(g0, g1))
    assert ht["ops"]["dispatch_bf16"]["gbps"]["max"] == pytest.approx(max(g0, g1))
    assert ht["epx_over_torch"]["dispatch_bf16"] == pytest.approx(2.0)
    assert ht["epx_over_torch"]["combine"] == pytest.approx(2.0)
    assert "layout" not in ht["epx_over_torch"]
    assert ll["dispatch_us"] == pytest.approx((10 + 16 + 11 + 16) / 2)  # FP8 is the headline
    assert ll["dispatch_send_us"] == pytest.approx(26.5) and ll["combine_recv_us"] > 0
    assert ll["epx_over_torch"]["dispatch_fp8"] == pytest.approx(4.0, rel=1e-9)
    assert ll["max_rank_us"]["dispatch"] == pytest.approx(27.0)
    assert [p["tokens"] for p in res["sweep"]["ht"]] == [256, 4096]
    assert [p["tokens"] for p in res["sweep"]["ll"]] == [8, 128]
    json.dumps(res)  # serializable

    text = b.format_report(res)
    assert "EPX high-throughput: 4096 tokens per rank" in text
    assert "EPX low-latency: 128 tokens per rank" in text
    assert "EPX/torch" in text and "2.00x" in text and "4.00x" in text
    line = next(s for s in text.splitlines() if s.startswith("dispatch BF16 (cached)"))
    assert f"{(us0 + us1) / 2:.1f}" in line and f"{(g0 + g1) / 2:.1f}" in line
    assert "host us" in text and line.split()[9] == "20.5"  # mean host us over the ranks
    assert "sweep, high-throughput" in text and "sweep, low-latency" in text

    # without --compare-torch and --sweep: no torch columns, no sweep
    plain = b.parse_args([])
    res2 = b.build_result(plain, 2, _fake_ranks(sweep=False))
    assert res2["sweep"] == {} and "EPX/torch" not in b.format_report(res2)
    assert "profiled" not in res2 and "PROFILED" not in b.format_report(res2)
    monkeypatch.setenv("EPX_BENCH_PROFILE", "/tmp/profile.txt")
    res3 = b.build_result(plain, 2, _fake_ranks(sweep=False))
    assert "cProfile" in res3["profiled"] and "PROFILED" in b.format_report(res3)


def test_bench_plot_and_replot(tmp_path):
    pytest.importorskip("matplotlib")
    b = _bench()
    args = b.parse_args(["--compare-torch", "--sweep-tokens", "256,4096", "--sweep-ll-tokens",
                         "8,128"])
    res = b.build_result(args, 2, _fake_ranks())
    png = tmp_path / "a.png"
    b.plot_sweep(res, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    path = tmp_path / "r.json"
    path.write_text(json.dumps(res))
    png2 = tmp_path / "b.png"
    assert b.main(["--replot", str(path), "--plot", str(png2)]) == 0
    assert png2.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no sweep"):
        b.plot_sweep(b.build_result(b.parse_args([]), 2, _fake_ranks(sweep=False)),
                     str(tmp_path / "c.png"))


def test_bench_plot_without_matplotlib():
    code = textwrap.dedent("""
        import sys
        sys.modules["matplotlib"] = None
        from epx import bench
        try:
            bench.main(["--plot", "x.png"])
        except SystemExit as e:
            assert "needs matplotlib" in str(e), e
        else:
            raise AssertionError("--plot without matplotlib must stop with a message")
    """)
    _run_clean(code)


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

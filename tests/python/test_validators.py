"""CPU tests of the argument validators the binding exposes: tensors, scalars, the
dispatch, combine and low-latency arguments, and handles, each refusal naming the
argument and the rule. Need NumPy, not PyTorch or a GPU."""


import numpy as np
import pytest

import epx
from epx import _core


def _testing():
    """epx._testing (handles with fake routing tensors), which scripts/test.sh builds."""
    return pytest.importorskip(
        "epx._testing", reason="epx built without EPX_PYTHON_TESTING=ON (scripts/test.sh builds it)")

D = _core.DType


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

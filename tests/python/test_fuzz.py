"""Fuzzed bad input, Python side (hypothesis; no GPU, no PyTorch): DLPack conversion, the
layout, and the high-throughput dispatch and combine. What is fuzzed and how each set is
judged: fuzz_harness.py; the low-latency ops, the small ops and Config: test_fuzz_ll.py.
EPX_FUZZ_SEED=N repeats a run.
"""

from collections import Counter

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from epx import _core
from fuzz_harness import (
    N_COMBINE,
    N_DISPATCH,
    N_DLPACK,
    N_LAYOUT,
    ANY,
    CPU,
    D,
    Dev,
    ELEMENT,
    Launched,
    Verdict,
    _testing,
    check_tally,
    configs,
    describe,
    devices,
    events,
    faults,
    fuzz_settings,
    hidden_ok,
    int_arg,
    judge,
    make_buffer,
    ranks,
    rule_config,
    rule_event,
    rule_int,
    tensor_arg,
    tensor_ok,
    vectors_ok,
)


NP_DTYPES = {np.float32: D.float32, np.int32: D.int32, np.int64: D.int64, np.bool_: D.bool,
             np.uint8: D.float8_e4m3fn}  # uint8 carries FP8 bits
NP_UNSUPPORTED = [np.float16, np.float64, np.int8, np.int16, np.uint16, np.uint32, np.complex64]


def test_fuzz_dlpack_conversion():
    tally = Counter()

    @fuzz_settings(N_DLPACK)
    @given(st.data())
    def run(data):
        name = data.draw(st.sampled_from(["x", "topk_idx", "mask_status", "bias_0"]))
        v = Verdict()
        if data.draw(st.floats(0, 1)) < 0.1:
            obj = data.draw(st.sampled_from([None, 3, "x", [1.0, 2.0], (1, 2), object()]))
            v.flag(True, name)
        else:
            dtype = data.draw(st.sampled_from(list(NP_DTYPES) + NP_UNSUPPORTED))
            shape = data.draw(st.lists(st.integers(0, 6), min_size=0, max_size=6))
            obj = np.zeros(shape, dtype)
            if obj.ndim and data.draw(st.booleans()):  # a strided view: every other, or reversed
                d = data.draw(st.integers(0, obj.ndim - 1))
                step = data.draw(st.sampled_from([2, -1, 3]))
                obj = obj[(slice(None),) * d + (slice(None, None, step),)]
            if obj.ndim >= 2 and data.draw(st.booleans()):
                obj = obj.T
            v.flag(dtype not in NP_DTYPES or obj.ndim > _core.MAX_DIMS, name)

        def call():
            t = _core.TensorView.from_dlpack(obj, name)
            assert t.dtype == NP_DTYPES[obj.dtype.type] and t.device == CPU
            assert t.shape == obj.shape and t.data == obj.ctypes.data
            assert t.strides == tuple(s // obj.itemsize for s in obj.strides) or obj.size == 0
            raise Launched

        judge(tally, v, call, describe(name=name, obj=obj if not isinstance(obj, np.ndarray)
                                       else (obj.dtype, obj.shape, obj.strides)))

    run()
    check_tally("from_dlpack", tally, N_DLPACK, [])


# ---- the ops -------------------------------------------------------------------------------------



def test_fuzz_get_dispatch_layout():
    tally = Counter()
    args = ["num_experts", "topk_idx", "previous_event"]

    @fuzz_settings(N_LAYOUT)
    @given(st.data())
    def run(data):
        _, pb = data.draw(faults(args))
        R, dev = data.draw(ranks), data.draw(devices)
        E = data.draw(int_arg(st.integers(1, 64).map(lambda k: R * k), pb("num_experts")))
        idx = data.draw(tensor_arg(D.int64, [data.draw(st.integers(0, 300)),
                                             data.draw(st.integers(1, 16))], dev, pb("topk_idx")))
        ev = data.draw(events(pb("previous_event")))
        v = Verdict()
        e = rule_int(v, E, "num_experts")
        v.flag(e is not None and (e <= 0 or e % R or e > 8192), "num_experts")
        v.flag(not tensor_ok(idx, D.int64, [ANY, ANY], dev), "topk_idx")
        v.flag(isinstance(idx, Dev) and len(idx.shape) == 2 and not 1 <= idx.shape[1] <= 16,
               "topk_idx")
        rule_event(v, ev)
        judge(tally, v, lambda: make_buffer(R, dev).get_dispatch_layout(idx, E, previous_event=ev),
              describe(R=R, dev=dev, E=E, topk_idx=idx, previous_event=ev))

    run()
    check_tally("get_dispatch_layout", tally, N_LAYOUT, args)


# Routing tensors a fuzzed handle may lack ("": none; "all": every one): a handle
# holds every tensor its combine and cached dispatches read (docs/api.md).
DROPS = ["", "all", "is_token_in_rank", "send_slot", "send_list", "recv_offsets",
         "recv_src_idx"]


def dispatch_rules(R, dev, x, handle, layout, topk_idx, topk_weights, align, worst, config, ev,
                   drop=""):
    v = Verdict()
    if isinstance(x, tuple):
        if len(x) != 2:
            v.flag(True, "x")
            return v
        x, x_scales = x
    else:
        x_scales = None
    if handle is not None and not isinstance(handle, _core.DispatchHandle):
        v.flag(True, "handle")
        return v
    a = rule_int(v, align, "expert_alignment")
    w = rule_int(v, worst, "num_worst_tokens")
    rule_event(v, ev)
    rule_config(v, config, R)
    # Every tensor is converted before the core validates the call: one that is not a
    # CUDA tensor is refused by name whatever x is.
    for name, t in (("x_scales", x_scales), ("topk_idx", topk_idx),
                    ("topk_weights", topk_weights), ("num_tokens_per_rank", layout[0]),
                    ("is_token_in_rank", layout[1]), ("num_tokens_per_expert", layout[2])):
        v.flag(t is not None and not isinstance(t, Dev), name)
    if not isinstance(x, Dev) or len(x.shape) != 2:
        v.flag(True, "x")
        return v
    # rows of any dtype, a multiple of 16 bytes (DeepEP's rule); scales only with
    # 1-byte elements, float32 or int32, [T, S >= 1], any strides
    T, H = x.shape
    v.flag(x.device != dev or T < 0 or (not x.data and T * H != 0), "x")
    v.flag(not hidden_ok(H, x.dtype, False), "hidden")
    v.flag(x.strides[1] != 1 or not vectors_ok(x), "x")
    if x_scales is not None:
        v.flag(ELEMENT[x.dtype] != 1, "x_scales")
        v.flag(not (tensor_ok(x_scales, D.float32, [T, ANY], dev, False)
                    or tensor_ok(x_scales, D.int32, [T, ANY], dev, False)), "x_scales")
        if isinstance(x_scales, Dev) and len(x_scales.shape) == 2:
            v.flag(x_scales.shape[1] < 1, "x_scales")
    v.flag(a is not None and a < 1, "expert_alignment")
    v.flag(w is not None and w < 0, "num_worst_tokens")
    if handle is not None:
        v.flag(topk_idx is not None or topk_weights is not None, "topk_idx")
        v.flag(w is not None and w > 0, "num_worst_tokens")
        v.flag(handle.num_ranks != R or handle.num_tokens != T, "handle")
        v.flag(bool(drop), "handle")
        return v
    per_rank, in_rank, per_expert = layout
    if per_rank is None or in_rank is None or per_expert is None:
        v.flag(True, "num_tokens_per_rank")
    else:
        v.flag(not tensor_ok(per_rank, D.int32, [R], dev), "num_tokens_per_rank")
        v.flag(not tensor_ok(in_rank, D.bool, [T, R], dev), "is_token_in_rank")
        v.flag(not tensor_ok(per_expert, D.int32, [ANY], dev), "num_tokens_per_expert")
        if isinstance(per_expert, Dev) and len(per_expert.shape) == 1:
            E = per_expert.shape[0]
            v.flag(E <= 0 or E % R, "num_experts")
    v.flag(topk_weights is not None and topk_idx is None, "topk_weights")
    if topk_idx is not None:
        v.flag(not tensor_ok(topk_idx, D.int64, [T, ANY], dev), "topk_idx")
        if isinstance(topk_idx, Dev) and len(topk_idx.shape) == 2:
            K = topk_idx.shape[1]
            v.flag(not 1 <= K <= 16, "topk_idx")
            if topk_weights is not None:
                v.flag(not tensor_ok(topk_weights, D.float32, [T, K], dev), "topk_weights")
    return v


DISPATCH_ARGS = ["x", "hidden", "x_scales", "handle", "num_tokens_per_rank", "is_token_in_rank",
                 "num_tokens_per_expert", "num_experts", "topk_idx", "topk_weights",
                 "expert_alignment", "num_worst_tokens", "config", "previous_event"]


def test_fuzz_dispatch():
    tally = Counter()

    @fuzz_settings(N_DISPATCH)
    @given(st.data())
    def run(data):
        target, pb = data.draw(faults(DISPATCH_ARGS))
        R, dev = data.draw(ranks), data.draw(devices)
        hit = lambda name: data.draw(st.floats(0, 1)) < pb(name)  # noqa: E731
        fp8 = data.draw(st.booleans())
        xt = D.float8_e4m3fn if fp8 else data.draw(
            st.sampled_from([D.bfloat16, D.bfloat16, D.float32, D.int64]))
        T = data.draw(st.integers(0, 300))
        H = 128 * data.draw(st.integers(1, 56)) if fp8 else \
            8 * data.draw(st.integers(1, 900)) // max(1, ELEMENT[xt] // 2)
        if hit("hidden"):
            H = data.draw(st.sampled_from([0, H + 4, H + 64, -128] if fp8 else [0, H + 4, -8]))
        K = data.draw(st.integers(1, 16))
        E = R * data.draw(st.integers(1, 32))
        if hit("num_experts"):
            E = data.draw(st.sampled_from([0, E + 1 if R > 1 else 0]))
        x = data.draw(tensor_arg(xt, [T, H], dev, pb("x")))
        if fp8 != hit("x_scales"):
            S = H // 128 if data.draw(st.booleans()) and H >= 128 else data.draw(
                st.sampled_from([1, 7]))
            st_dtype = data.draw(st.sampled_from([D.float32, D.int32]))
            x = (x, data.draw(tensor_arg(st_dtype, [T, S], dev, pb("x_scales"))))
        elif hit("x"):
            x = (x,) if not isinstance(x, tuple) else x + (None,)
        handle, layout, topk_idx, topk_weights = None, (None, None, None), None, None
        drop = ""
        if target == "handle" or data.draw(st.floats(0, 1)) < 0.3:
            if hit("handle") and data.draw(st.booleans()):
                handle = data.draw(st.sampled_from(
                    [(1, 2), 7, _testing().low_latency_handle(R, R, 8, 128, 1, 1)]))
            else:
                wrong = hit("handle")
                drop = data.draw(st.sampled_from(DROPS)) if wrong else ""
                handle = _testing().dispatch_handle(
                    (2 * R if R < 8 else 4) if wrong and data.draw(st.booleans()) else R,
                    T + 1 if wrong and not drop else T, data.draw(st.integers(0, 600)), H,
                    device=dev, drop=drop)
            if hit("topk_idx"):
                topk_idx = data.draw(tensor_arg(D.int64, [T, K], dev, pb("topk_idx")))
        else:
            if not hit("num_tokens_per_rank"):
                layout = (data.draw(tensor_arg(D.int32, [R], dev, pb("num_tokens_per_rank"))),
                          data.draw(tensor_arg(D.bool, [T, R], dev, pb("is_token_in_rank"))),
                          data.draw(tensor_arg(D.int32, [E], dev, pb("num_tokens_per_expert"))))
            elif data.draw(st.booleans()):  # one of the three missing
                i = data.draw(st.integers(0, 2))
                layout = tuple(None if j == i else Dev(d, s, dev) for j, (d, s) in
                               enumerate([(D.int32, [R]), (D.bool, [T, R]), (D.int32, [E])]))
            if not (hit("topk_weights") and data.draw(st.booleans())):  # else: weights alone
                topk_idx = data.draw(tensor_arg(D.int64, [T, K], dev, pb("topk_idx")))
            if data.draw(st.booleans()) or hit("topk_weights"):
                topk_weights = data.draw(tensor_arg(D.float32, [T, K], dev, pb("topk_weights")))
        align = data.draw(int_arg(st.sampled_from([1, 64, 128]), pb("expert_alignment")))
        worst = data.draw(int_arg(st.sampled_from([0, 0, 4 * T]) if handle is None
                                  else st.just(0), pb("num_worst_tokens")))
        config, ev = data.draw(configs(pb("config"))), data.draw(events(pb("previous_event")))
        v = dispatch_rules(R, dev, x, handle, layout, topk_idx, topk_weights, align, worst,
                           config, ev, drop)

        def call():
            make_buffer(R, dev).dispatch(
                x, handle=handle, num_tokens_per_rank=layout[0], is_token_in_rank=layout[1],
                num_tokens_per_expert=layout[2], topk_idx=topk_idx, topk_weights=topk_weights,
                expert_alignment=align, num_worst_tokens=worst, config=config,
                previous_event=ev)

        judge(tally, v, call, describe(R=R, dev=dev, x=x, handle=handle, layout=layout,
                                       topk_idx=topk_idx, topk_weights=topk_weights, align=align,
                                       worst=worst, config=config, ev=ev))

    run()
    check_tally("dispatch", tally, N_DISPATCH, DISPATCH_ARGS)


COMBINE_ARGS = ["handle", "x", "hidden", "topk_weights", "bias", "bias_0", "bias_1", "config",
                "previous_event"]


def test_fuzz_combine():
    tally = Counter()

    @fuzz_settings(N_COMBINE)
    @given(st.data())
    def run(data):
        _, pb = data.draw(faults(COMBINE_ARGS))
        R, dev = data.draw(ranks), data.draw(devices)
        hit = lambda name: data.draw(st.floats(0, 1)) < pb(name)  # noqa: E731
        T, N = data.draw(st.integers(0, 300)), data.draw(st.integers(0, 600))
        H = 8 * data.draw(st.integers(1, 900))
        tensorless = data.draw(st.booleans())  # a handle that does not know its hidden size
        if hit("hidden"):
            H, tensorless = data.draw(st.sampled_from([0, H + 4, -8])), True
        if hit("handle") and data.draw(st.booleans()):
            handle = data.draw(st.sampled_from(
                [None, (1, 2), _testing().low_latency_handle(R, R, 8, 128, 1, 1)]))
        else:
            wrong = hit("handle")
            drop = data.draw(st.sampled_from(DROPS)) if wrong else ""
            handle = _testing().dispatch_handle(
                (2 * R if R < 8 else 4) if wrong and not drop else R, T, N,
                0 if tensorless else (H + 8 if hit("x") else H), device=dev, drop=drop)
        x = data.draw(tensor_arg(D.bfloat16, [N, H], dev, pb("x")))
        tw = data.draw(tensor_arg(D.float32, [N, data.draw(st.integers(1, 16))], dev,
                                  pb("topk_weights"))) if data.draw(st.booleans()) else None
        if isinstance(tw, Dev) and len(tw.shape) == 2 and hit("topk_weights"):
            tw = Dev(tw.dtype, [tw.shape[0], data.draw(st.sampled_from([0, 17]))], tw.device)
        b0 = data.draw(tensor_arg(D.bfloat16, [T, H], dev, pb("bias_0")))
        b1 = data.draw(tensor_arg(D.bfloat16, [T, H], dev, pb("bias_1")))
        kind = data.draw(st.integers(0, 2))
        bias = [None, b0, (b0, b1)][kind]
        if hit("bias"):
            bias = data.draw(st.sampled_from([(b0,), (b0, b1, b1)]))
        config, ev = data.draw(configs(pb("config"))), data.draw(events(pb("previous_event")))

        v = Verdict()
        if not isinstance(handle, _core.DispatchHandle):
            v.flag(True, "handle")
        elif isinstance(bias, tuple) and len(bias) != 2:
            v.flag(True, "bias")
        else:
            rule_event(v, ev)
            rule_config(v, config, R)
            v.flag(handle.num_ranks != R or bool(drop), "handle")
            v.flag(not tensor_ok(x, D.bfloat16, [N, ANY], dev) or not vectors_ok(x), "x")
            c0, c1 = bias if isinstance(bias, tuple) else (bias, None)
            for name, t in (("bias_0", c0), ("bias_1", c1)):
                v.flag(t is not None and not isinstance(t, Dev), name)
            if tw is not None:
                v.flag(not tensor_ok(tw, D.float32, [N, ANY], dev), "topk_weights")
                if isinstance(tw, Dev) and len(tw.shape) == 2:
                    v.flag(not 1 <= tw.shape[1] <= 16, "topk_weights")
            if isinstance(x, Dev) and len(x.shape) == 2:
                Hx = x.shape[1]
                v.flag(handle.hidden != 0 and Hx != handle.hidden, "x")
                v.flag(not hidden_ok(Hx, D.bfloat16, False), "hidden")
                for name, t in (("bias_0", c0), ("bias_1", c1)):
                    if t is not None:
                        v.flag(not tensor_ok(t, D.bfloat16, [T, Hx], dev) or not vectors_ok(t),
                               name)

        judge(tally, v, lambda: make_buffer(R, dev).combine(x, handle, topk_weights=tw, bias=bias,
                                                            config=config, previous_event=ev),
              describe(R=R, dev=dev, x=x, handle=handle, tw=tw, bias=bias, config=config, ev=ev))

    run()
    check_tally("combine", tally, N_COMBINE, COMBINE_ARGS)

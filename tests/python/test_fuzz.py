"""Fuzzed bad input, Python side (hypothesis; no GPU, no PyTorch).

What runs before any kernel when a DeepEP-style call reaches epx.Buffer: the
wrapper's own checks (int arguments, handles, the (x, scales) pair, bias,
previous_event, config, the compatibility arguments), the conversion of every
tensor argument into a _core.TensorView, and the core's validation of the whole
call (src/core/validate.hpp, Config::validate), which _core.Buffer's ops run
first. Here a Buffer is driven without a GPU: its torch glue is replaced by one
that turns `Dev` stand-ins (what the glue reads from a CUDA tensor: pointer,
dtype, shape, strides, device) into views and hands anything else to the real
DLPack conversion, and its runtime by one that runs the core's validation and
stops where the kernels would start. Also fuzzed directly: the DLPack
conversion itself (NumPy arrays of any dtype, rank and strides, and
non-tensors), Config, and the static helpers.

Each generated set is judged by rules restated in this file: a valid set must
reach the kernels' doorstep; any other must raise a ValueError (EPXValueError,
EPXUnsupportedError) or TypeError whose message names one of the arguments the
rules found broken. Over 10,000 sets per run, from a seed drawn for the run
(printed; every failure's report names it): EPX_FUZZ_SEED=N repeats a run.
"""

import os
import random
import re
import types
from collections import Counter

import hypothesis  # a test dependency (scripts/install_deps.sh): fail, never skip, without it
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import epx
from epx import _core


def _testing():
    """epx._testing (handles with fake routing tensors), which scripts/test.sh builds."""
    return pytest.importorskip(
        "epx._testing", reason="epx built without EPX_PYTHON_TESTING=ON (scripts/test.sh builds it)")

D = _core.DType
ANY = None
CPU = _core.CPU
DTYPES = [D.bfloat16, D.float8_e4m3fn, D.float32, D.int32, D.int64, D.bool]
ELEMENT = {D.bfloat16: 2, D.float8_e4m3fn: 1, D.float32: 4, D.int32: 4, D.int64: 8, D.bool: 1}
INT32 = (-(2**31), 2**31 - 1)


# Drawn per run by conftest.py unless set (the report's header shows it).
SEED = int(os.environ.get("EPX_FUZZ_SEED") or random.SystemRandom().randrange(2**63))


def fuzz_settings(n):
    s = settings(max_examples=n, deadline=None, database=None,
                 suppress_health_check=list(HealthCheck))
    return lambda f: hypothesis.seed(SEED)(s(f))


class Launched(Exception):
    """The call passed every check and would launch its kernels now."""


# ---- stand-ins for a CUDA tensor, the torch glue and the core buffer -----------------------------

class Dev:
    """What epx's torch glue reads from a CUDA tensor: pointer, dtype, shape, strides
    (elements), device. Strides default to row-major."""

    def __init__(self, dtype, shape, device=0, strides=None, data=0x7F0000000000):
        self.dtype, self.shape, self.device, self.data = dtype, list(shape), device, data
        if strides is None:
            strides, acc = [], 1
            for e in reversed(self.shape):
                strides.insert(0, acc)
                acc *= max(e, 1)
        self.strides = list(strides)

    def __repr__(self):
        return (f"Dev({self.dtype.name}, {self.shape}, cuda:{self.device}, strides={self.strides}"
                f"{', null' if not self.data else ''})")


class Glue:
    """epx.buffer._TorchGlue's part the checks use: a Dev becomes the view the glue
    builds from a CUDA tensor's fields; anything else goes through DLPack, as the
    glue sends every tensor it cannot read directly."""

    def view(self, name, t):
        if isinstance(t, Dev):
            return _core.TensorView(t.data, t.dtype, t.shape, strides=t.strides, device=t.device)
        return _core.TensorView.from_dlpack(t, name)

    def opt_view(self, name, t):
        return None if t is None else self.view(name, t)

    def rows(self, name, t):  # a Dev's dtype is one the core names: no byte view
        return self.view(name, t)

    def current_stream(self, device):
        return 0


class ValidatingRuntime:
    """_core.Buffer's ops up to their first kernel: the core's validation, as the C++
    Buffer runs it first (src/core/high_throughput.cpp, low_latency.cpp)."""

    SMS = 132  # the device's SMs, for Config::validate

    def __init__(self, num_ranks, device):
        self.R, self.dev = num_ranks, device

    def get_dispatch_layout(self, topk_idx, num_experts, streams):
        _core.validate_dispatch_layout(topk_idx, num_experts, self.R, self.dev)
        raise Launched

    def dispatch(self, a):
        _core.validate_dispatch(a, self.R, self.dev)
        if a.config is not None:
            a.config.validate(self.R, self.SMS)
        raise Launched

    def combine(self, a):
        _core.validate_combine(a, self.R, self.dev)
        if a.config is not None:
            a.config.validate(self.R, self.SMS)
        raise Launched

    def low_latency_dispatch(self, a):
        _core.validate_low_latency_dispatch(a, self.R, self.dev)
        raise Launched

    def low_latency_combine(self, a):
        _core.validate_low_latency_combine(a, self.R, self.dev)
        raise Launched

    def clean_low_latency_buffer(self, max_tokens, hidden, num_experts):
        _core.validate_low_latency_sizes("clean_low_latency_buffer", max_tokens, hidden,
                                         num_experts, self.R)
        raise Launched

    def low_latency_update_mask_buffer(self, rank, mask, stream):
        _core.validate_rank_in_group("low_latency_update_mask_buffer", "rank_to_mask", rank,
                                     self.R)
        raise Launched

    def low_latency_query_mask_buffer(self, mask_status, stream):
        _core.validate_tensor("low_latency_query_mask_buffer", "mask_status", mask_status,
                              D.int32, [self.R], self.dev)
        raise Launched


def make_buffer(num_ranks, device):
    buf = object.__new__(epx.Buffer)
    buf._glue = Glue()
    buf.runtime = ValidatingRuntime(num_ranks, device)
    buf._device = types.SimpleNamespace(index=device)
    buf._in_process = False
    buf.group_size = num_ranks
    return buf


# ---- the rules -----------------------------------------------------------------------------------

def as_int(v, bounds=INT32):
    """(ok, value) for an int argument: an integer (bool included) that fits."""
    if isinstance(v, (bool, int, np.integer)):
        v = int(v)
        return bounds[0] <= v <= bounds[1], v
    return False, None


def dense(t):
    expect = 1
    for e, s in zip(reversed(t.shape), reversed(t.strides)):
        if e != 1 and s != expect:
            return False
        expect *= e
    return True


def tensor_ok(t, dtype, shape, device, contiguous=True):
    """A tensor argument: a CUDA tensor on `device` of `dtype`, rank and extents
    `shape` (None: any, never negative), non-null unless empty, dense when asked."""
    if not isinstance(t, Dev):
        return False  # not a tensor, or host memory
    if t.dtype != dtype or len(t.shape) != len(shape):
        return False
    if any(e < 0 or (want is not None and e != want) for e, want in zip(t.shape, shape)):
        return False
    n = int(np.prod(t.shape))
    if not t.data and n != 0:
        return False
    if n != 0 and t.data % ELEMENT[t.dtype]:  # the pointer a multiple of the element size
        return False
    return t.device == device and (not contiguous or dense(t))


def vectors_ok(t):
    """What the kernels move 16 bytes at a time (rows of x, biases, outputs): the
    pointer and every stride but the innermost multiples of 16 bytes."""
    if not isinstance(t, Dev) or not t.data or int(np.prod(t.shape)) == 0:
        return True
    return t.data % 16 == 0 and all(s * ELEMENT[t.dtype] % 16 == 0 for s in t.strides[:-1])


def hidden_ok(h, dtype, fp8):
    return h > 0 and h * ELEMENT[dtype] % 16 == 0 and (not fp8 or h % 128 == 0)


class Verdict:
    def __init__(self):
        self.broken = set()

    def flag(self, bad, arg):
        if bad:
            self.broken.add(arg)
        return bad


def rule_int(v, value, name, bounds=INT32):
    ok, n = as_int(value, bounds)
    v.flag(not ok, name)
    return n if ok else None


def rule_event(v, ev):
    v.flag(not (ev is None or (isinstance(ev, epx.EventOverlap) and ev.event is None)),
           "previous_event")


def rule_config(v, cfg, R, sms=ValidatingRuntime.SMS):
    """Config::validate's rules (epx/config.hpp), for an epx.Config (or the core's
    Config, which the wrapper also takes); other types are refused by name."""
    if cfg is None:
        return
    if not isinstance(cfg, (epx.Config, _core.Config)):
        v.flag(True, "config")
        return
    c = cfg._cfg if isinstance(cfg, epx.Config) else cfg
    v.flag(c.num_sms < 2 or (sms > 0 and c.num_sms > sms), "config.num_sms")
    send = c.num_send_sms if c.num_send_sms > 0 else max(1, c.num_sms // 3)
    v.flag(c.num_send_sms < 0 or send < 1 or c.num_sms - send < 1, "config.num_send_sms")
    v.flag(not 1 <= c.num_max_send_tokens <= 1024, "config.num_max_send_tokens")
    v.flag(c.num_max_recv_tokens < c.num_max_send_tokens, "config.num_max_recv_tokens")
    v.flag(not 0 <= c.num_max_rdma_send_tokens <= 2**20, "config.num_max_rdma_send_tokens")
    v.flag(not 0 <= c.num_max_rdma_recv_tokens <= 2**20, "config.num_max_rdma_recv_tokens")


def ll_size_rules(v, max_tokens, hidden, experts, R):
    v.flag(max_tokens is not None and not 1 <= max_tokens <= 1024,
           "num_max_dispatch_tokens_per_rank")
    v.flag(hidden is not None and (hidden <= 0 or hidden % 128 or hidden > 16384), "hidden")
    v.flag(experts is not None and (experts <= 0 or experts % R or experts > 1024), "num_experts")
    # the receive lists every (rank, token) of an expert: 24 Ki entries at most
    v.flag(max_tokens is not None and R * max_tokens > 24 * 1024,
           "num_max_dispatch_tokens_per_rank")


# ---- generators ----------------------------------------------------------------------------------

def wild_ints():
    return st.one_of(st.integers(-3, 3000), st.sampled_from([-1, 0, 127, 128, 1024, 1025, 8192,
                                                             8193, 16384, 16512, 2**31, -2**31 - 1,
                                                             2**40]))


def non_ints():
    return st.sampled_from([1.0, 128.0, "128", None, [1], np.float32(2.0)])


@st.composite
def int_arg(draw, good, bad_p):
    """`good` (a strategy of valid values), or with probability bad_p a wild int, a
    bool, a NumPy int or a non-int."""
    if draw(st.floats(0, 1)) >= bad_p:
        return draw(good)
    kind = draw(st.integers(0, 9))
    if kind < 6:
        return draw(wild_ints())
    if kind == 6:
        return draw(st.booleans())
    if kind == 7:
        return np.int64(draw(st.integers(-5, 5000)))
    return draw(non_ints())


ASPECTS = ["type", "rank", "extent", "dtype", "device", "strides", "null", "offset"]


@st.composite
def tensor_arg(draw, dtype, shape, device, bad_p):
    """A Dev meant to satisfy (dtype, shape with None = any, device); with
    probability bad_p one or two aspects of it are broken: not a CUDA tensor at
    all, its rank, one extent, its dtype, its device, its strides (padded rows,
    broadcast, every other element) or its pointer (null, or inside an element or
    a 16-byte line: a view such as x[:, 4:] or a flat slice)."""
    shape = [draw(st.sampled_from([0, 1, 7, 64, 256])) if e is None else e for e in shape]
    if draw(st.floats(0, 1)) >= bad_p:
        return Dev(dtype, shape, device)
    faults = draw(st.sets(st.sampled_from(ASPECTS), min_size=1, max_size=2))
    if "type" in faults:
        return draw(st.sampled_from(["tensor", 3, [1, 2], np.zeros((2, 2), np.float32),
                                     np.zeros(4, np.int64), np.zeros(3, np.float64)]))
    if "rank" in faults:
        shape = shape + [draw(st.integers(1, 4))] if draw(st.booleans()) or not shape \
            else shape[:-1]
    if "extent" in faults and shape:
        i = draw(st.integers(0, len(shape) - 1))
        shape[i] = draw(st.sampled_from([shape[i] + 1, shape[i] - 1, 0, -1, 300]))
    t = Dev(draw(st.sampled_from(DTYPES)) if "dtype" in faults else dtype, shape[:4],
            draw(st.sampled_from([device + 1, 3, 0])) if "device" in faults else device)
    if "strides" in faults and t.shape:
        i = draw(st.integers(0, len(t.shape) - 1))
        how = draw(st.integers(0, 2))
        if how == 0:
            t.strides[0] += draw(st.integers(1, 9))
        elif how == 1:
            t.strides[i] = 0
        else:
            t.strides[i] *= 2
    if "null" in faults:
        t.data = 0
    elif "offset" in faults:
        t.data += draw(st.sampled_from([1, 2, 4, 8, 12]))
    return t


@st.composite
def faults(draw, args):
    """(target, pb): a third of the sets break nothing; the others aim at one
    argument of `args`, broken with probability 0.8, over a background where any
    argument breaks with probability 0, 2 or 10%. pb(name) is name's probability."""
    target = draw(st.sampled_from([None] * (len(args) // 2 + 1) + list(args)))
    background = draw(st.sampled_from([0.0, 0.0, 0.02, 0.1]))
    return target, (lambda name: 0.8 if name == target else background)


ranks = st.sampled_from([1, 2, 4, 8])
devices = st.integers(0, 3)


@st.composite
def events(draw, bad_p):
    if draw(st.floats(0, 1)) < bad_p:
        return draw(st.sampled_from([42, "event", object()]))
    return draw(st.sampled_from([None, epx.EventOverlap()]))


@st.composite
def configs(draw, bad_p):
    if draw(st.floats(0, 1)) >= bad_p:
        return draw(st.sampled_from([None, None, epx.Config(24, 8, 4096), epx.Config()]))
    kind = draw(st.integers(0, 4))
    if kind == 0:
        return draw(st.sampled_from([42, "config", _core.Config(0, 8, 4096)]))
    c = epx.Config()
    c._cfg.num_sms = draw(st.sampled_from([0, 1, 3, 24, 200, -2]))
    c._cfg.num_send_sms = draw(st.sampled_from([0, -1, 23, 24, 1]))
    c._cfg.num_max_send_tokens = draw(st.sampled_from([0, 1, 8, 1024, 1025]))
    c._cfg.num_max_recv_tokens = draw(st.sampled_from([0, 4, 4096]))
    return c


# ---- the harness ---------------------------------------------------------------------------------

def names_argument(message, broken):
    return [a for a in broken if re.search(rf"(^|: |\(){re.escape(a)}: ", message)]


def judge(tally, verdict, call, describe):
    """Runs `call` and compares the outcome with `verdict` (see the module docstring)."""
    tally["sets"] += 1
    try:
        call()
    except Launched:
        assert not verdict.broken, f"accepted, but the rules find broken {verdict.broken}: " \
                                   f"{describe()}"
        tally["valid"] += 1
        return
    except (ValueError, TypeError, NotImplementedError) as e:  # EPX's ValueError, Unsupported
        msg = str(e)
        assert verdict.broken, f"rejected a valid set ({type(e).__name__}: {msg}): {describe()}"
        named = names_argument(msg, verdict.broken)
        assert named, f"the error names none of {sorted(verdict.broken)}: " \
                      f"{type(e).__name__}: {msg}; {describe()}"
        tally["rejected"] += 1
        for a in named:
            tally["named:" + a] += 1
        return
    raise AssertionError(f"no error and no launch: {describe()}")


def check_tally(op, tally, n, args):
    assert tally["sets"] >= n, f"{op}: only {tally['sets']} sets"
    assert tally["valid"] >= tally["sets"] // 10, f"{op}: too few valid sets {dict(tally)}"
    assert tally["rejected"] >= tally["sets"] // 10, f"{op}: too few rejected sets {dict(tally)}"
    missing = [a for a in args if not tally["named:" + a]]
    assert not missing, f"{op}: no set was rejected for {missing}"


def describe(**kw):
    return lambda: ", ".join(f"{k}={v!r}" for k, v in kw.items())


# ---- the DLPack conversion of tensor arguments ---------------------------------------------------

NP_DTYPES = {np.float32: D.float32, np.int32: D.int32, np.int64: D.int64, np.bool_: D.bool,
             np.uint8: D.float8_e4m3fn}  # uint8 carries FP8 bits
NP_UNSUPPORTED = [np.float16, np.float64, np.int8, np.int16, np.uint16, np.uint32, np.complex64]

N_DLPACK = 1500


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

N_LAYOUT, N_DISPATCH, N_COMBINE = 1000, 3000, 1500
N_LL_DISPATCH, N_LL_COMBINE, N_SMALL, N_CONFIG = 2000, 1500, 1000, 1000
assert (N_DLPACK + N_LAYOUT + N_DISPATCH + N_COMBINE + N_LL_DISPATCH + N_LL_COMBINE + N_SMALL
        + N_CONFIG) >= 10000


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


LL_DISPATCH_ARGS = ["num_max_dispatch_tokens_per_rank", "num_experts", "x", "hidden", "topk_idx",
                    "use_fp8", "use_ue8m0", "cumulative_local_expert_recv_stats",
                    "dispatch_wait_recv_cost_stats", "compat"]


def test_fuzz_low_latency_dispatch():
    tally = Counter()

    @fuzz_settings(N_LL_DISPATCH)
    @given(st.data())
    def run(data):
        _, pb = data.draw(faults(LL_DISPATCH_ARGS))
        R, dev = data.draw(ranks), data.draw(devices)
        hit = lambda name: data.draw(st.floats(0, 1)) < pb(name)  # noqa: E731
        maxT = data.draw(int_arg(st.sampled_from([1, 32, 128, 1024]),
                                 pb("num_max_dispatch_tokens_per_rank")))
        E = data.draw(int_arg(st.integers(1, 1024 // R).map(lambda k: R * k), pb("num_experts")))
        ok_t, t_cap = as_int(maxT)
        T = data.draw(st.integers(0, min(t_cap, 300) if ok_t and t_cap > 0 else 300))
        if hit("x") and ok_t and 0 < t_cap < 300:
            T = t_cap + 1
        H = 128 * data.draw(st.integers(1, 128))
        if hit("hidden"):
            H = data.draw(st.sampled_from([0, -128, 64, 100, 16512, 20000]))
        x = data.draw(tensor_arg(D.bfloat16, [T, H], dev, pb("x")))
        idx = data.draw(tensor_arg(D.int64, [T, data.draw(st.integers(1, 16))], dev,
                                   pb("topk_idx")))
        if isinstance(idx, Dev) and len(idx.shape) == 2 and hit("topk_idx"):
            idx = Dev(idx.dtype, [idx.shape[0], data.draw(st.sampled_from([0, 17]))], idx.device)
        use_fp8 = data.draw(st.booleans())
        round_scale = data.draw(st.booleans()) if use_fp8 or hit("use_fp8") else False
        use_ue8m0 = data.draw(st.booleans()) if round_scale or hit("use_fp8") else False
        if hit("use_ue8m0"):
            use_fp8, round_scale, use_ue8m0 = True, False, True
        ok_e, e = as_int(E)
        local = e // R if ok_e and e > 0 else 1
        stats = data.draw(tensor_arg(D.int32, [local], dev, pb(
            "cumulative_local_expert_recv_stats"))) if data.draw(st.booleans()) else None
        wait = data.draw(tensor_arg(D.int64, [R], dev, pb("dispatch_wait_recv_cost_stats"))) \
            if data.draw(st.booleans()) else None
        compat = {}
        if hit("compat"):
            name = data.draw(st.sampled_from(["use_nvfp4", "use_ue8m0_for_sf", "x_global_scale",
                                              "topk_weights"]))
            compat[name] = True if name.startswith("use") else Dev(D.float32, [])

        v = Verdict()
        for name in compat:
            v.flag(True, name)
        if not compat:  # the compatibility arguments are refused before anything else
            m = rule_int(v, maxT, "num_max_dispatch_tokens_per_rank")
            n_e = rule_int(v, E, "num_experts")
            v.flag(not tensor_ok(x, D.bfloat16, [ANY, ANY], dev) or not vectors_ok(x), "x")
            v.flag(not isinstance(idx, Dev), "topk_idx")
            v.flag(not use_fp8 and (round_scale or use_ue8m0), "use_fp8")
            v.flag(use_ue8m0 and not round_scale, "use_ue8m0")
            for name, t in (("cumulative_local_expert_recv_stats", stats),
                            ("dispatch_wait_recv_cost_stats", wait)):
                v.flag(t is not None and not isinstance(t, Dev), name)
            if isinstance(x, Dev) and len(x.shape) == 2:
                Tx, Hx = x.shape
                ll_size_rules(v, m, Hx, n_e, R)
                v.flag(m is not None and Tx > m, "x")
                v.flag(not tensor_ok(idx, D.int64, [Tx, ANY], dev), "topk_idx")
                v.flag(isinstance(idx, Dev) and len(idx.shape) == 2
                       and not 1 <= idx.shape[1] <= 16, "topk_idx")
                if stats is not None and n_e is not None:
                    v.flag(not tensor_ok(stats, D.int32, [n_e // R], dev),
                           "cumulative_local_expert_recv_stats")
                if wait is not None:
                    v.flag(not tensor_ok(wait, D.int64, [R], dev), "dispatch_wait_recv_cost_stats")

        judge(tally, v, lambda: make_buffer(R, dev).low_latency_dispatch(
            x, idx, maxT, E, cumulative_local_expert_recv_stats=stats,
            dispatch_wait_recv_cost_stats=wait, use_fp8=use_fp8, round_scale=round_scale,
            use_ue8m0=use_ue8m0, **compat),
            describe(R=R, dev=dev, maxT=maxT, E=E, x=x, idx=idx, fp8=use_fp8, round=round_scale,
                     ue8m0=use_ue8m0, stats=stats, wait=wait, compat=compat))

    run()
    check_tally("low_latency_dispatch", tally, N_LL_DISPATCH,
                [a for a in LL_DISPATCH_ARGS if a != "compat"] + ["use_nvfp4", "x_global_scale"])


LL_COMBINE_ARGS = ["handle", "x", "topk_idx", "topk_weights", "out",
                   "combine_wait_recv_cost_stats", "overlap"]


def test_fuzz_low_latency_combine():
    tally = Counter()

    @fuzz_settings(N_LL_COMBINE)
    @given(st.data())
    def run(data):
        _, pb = data.draw(faults(LL_COMBINE_ARGS))
        R, dev = data.draw(ranks), data.draw(devices)
        hit = lambda name: data.draw(st.floats(0, 1)) < pb(name)  # noqa: E731
        E, maxT = R * data.draw(st.integers(1, 32)), data.draw(st.sampled_from([1, 8, 32, 128]))
        H, K = 128 * data.draw(st.integers(1, 16)), data.draw(st.integers(1, 16))
        T = data.draw(st.integers(0, maxT))
        if hit("handle") and data.draw(st.booleans()):
            handle = data.draw(st.sampled_from(
                [None, (1, 2), _testing().dispatch_handle(R, 1, 1, 128)]))
        else:
            handle = _testing().low_latency_handle(
                (2 * R if R < 8 else 4) if hit("handle") else R, E, maxT, H, T, K)
        x = data.draw(tensor_arg(D.bfloat16, [E // R, R * maxT, H], dev, pb("x")))
        idx = data.draw(tensor_arg(D.int64, [T, K], dev, pb("topk_idx")))
        w = data.draw(tensor_arg(D.float32, [T, K], dev, pb("topk_weights")))
        out = data.draw(tensor_arg(D.bfloat16, [T, H], dev, pb("out"))) \
            if data.draw(st.booleans()) else None
        stats = data.draw(tensor_arg(D.int64, [R], dev, pb("combine_wait_recv_cost_stats"))) \
            if data.draw(st.booleans()) else None
        overlap = hit("overlap")

        v = Verdict()
        if overlap:
            v.flag(True, "overlap")
        elif not isinstance(handle, _core.LowLatencyHandle):
            v.flag(True, "handle")
        else:
            v.flag(handle.num_ranks != R, "handle")
            v.flag(not tensor_ok(x, D.bfloat16, [E // R, R * maxT, H], dev) or not vectors_ok(x),
                   "x")
            v.flag(not tensor_ok(idx, D.int64, [T, K], dev), "topk_idx")
            v.flag(not tensor_ok(w, D.float32, [T, K], dev), "topk_weights")
            if out is not None:
                v.flag(not tensor_ok(out, D.bfloat16, [T, H], dev) or not vectors_ok(out), "out")
            if stats is not None:
                v.flag(not tensor_ok(stats, D.int64, [R], dev), "combine_wait_recv_cost_stats")

        judge(tally, v, lambda: make_buffer(R, dev).low_latency_combine(
            x, idx, w, handle, out=out, combine_wait_recv_cost_stats=stats, overlap=overlap),
            describe(R=R, dev=dev, x=x, idx=idx, w=w, handle=handle, out=out, stats=stats,
                     overlap=overlap))

    run()
    check_tally("low_latency_combine", tally, N_LL_COMBINE, LL_COMBINE_ARGS)


SMALL_ARGS = ["num_max_dispatch_tokens_per_rank", "hidden", "num_experts", "num_ranks",
              "rank_to_mask", "mask_status", "num_sms", "new_num_sms"]


def test_fuzz_small_ops():
    """clean_low_latency_buffer, the shrink mask calls, get_low_latency_rdma_size_hint and
    set_num_sms: int arguments and their ranges."""
    tally = Counter()
    saved = epx.Buffer.num_sms

    @fuzz_settings(N_SMALL)
    @given(st.data())
    def run(data):
        _, pb = data.draw(faults(SMALL_ARGS))
        R, dev = data.draw(ranks), data.draw(devices)
        op = data.draw(st.sampled_from(["clean", "mask", "query", "hint", "sms"]))
        v = Verdict()
        buf = make_buffer(R, dev)
        if op in ("clean", "hint"):
            maxT = data.draw(int_arg(st.sampled_from([1, 128, 1024]),
                                     pb("num_max_dispatch_tokens_per_rank")))
            H = data.draw(int_arg(st.integers(1, 128).map(lambda k: 128 * k), pb("hidden")))
            E = data.draw(int_arg(st.integers(1, 1024 // R).map(lambda k: R * k),
                                  pb("num_experts")))
            m = rule_int(v, maxT, "num_max_dispatch_tokens_per_rank")
            h = rule_int(v, H, "hidden")
            e = rule_int(v, E, "num_experts")
            if op == "clean":
                ll_size_rules(v, m, h, e, R)
                call = lambda: buf.clean_low_latency_buffer(maxT, H, E)  # noqa: E731
            else:
                n = data.draw(int_arg(st.just(R), pb("num_ranks")))
                r = rule_int(v, n, "num_ranks")
                # Low-latency ops run across nodes: up to 160 ranks (20 nodes of 8).
                v.flag(r is not None and not 1 <= r <= 160, "num_ranks")
                if r is not None and 1 <= r <= 160:
                    ll_size_rules(v, m, h, e, r)

                def call():
                    assert epx.Buffer.get_low_latency_rdma_size_hint(maxT, H, n, E) > 0
                    raise Launched
            desc = describe(op=op, R=R, maxT=maxT, H=H, E=E)
        elif op == "mask":
            rank = data.draw(int_arg(st.integers(0, R - 1), pb("rank_to_mask")))
            k = rule_int(v, rank, "rank_to_mask")
            v.flag(k is not None and not 0 <= k < R, "rank_to_mask")
            call = lambda: buf.low_latency_update_mask_buffer(rank, True)  # noqa: E731
            desc = describe(op=op, R=R, rank=rank)
        elif op == "query":
            status = data.draw(tensor_arg(D.int32, [R], dev, pb("mask_status")))
            v.flag(not tensor_ok(status, D.int32, [R], dev), "mask_status")
            call = lambda: buf.low_latency_query_mask_buffer(status)  # noqa: E731
            desc = describe(op=op, R=R, status=status)
        else:
            # A set aimed at new_num_sms breaks its type (only a non-int is named
            # so: a wrong int is the num_sms rule); aimed anywhere else, int_arg's
            # mix. A wild int's share of the non-ints alone left some seeds
            # with no set naming new_num_sms in 1000.
            if data.draw(st.floats(0, 1)) < pb("new_num_sms"):
                n = data.draw(non_ints())
            else:
                n = data.draw(int_arg(st.integers(1, 66).map(lambda k: 2 * k), pb("num_sms")))
            k = rule_int(v, n, "new_num_sms")
            v.flag(k is not None and (k < 2 or k % 2), "num_sms")

            def call():
                epx.Buffer.set_num_sms(n)
                assert epx.Buffer.num_sms == n and _core.Buffer.num_sms() == n
                raise Launched
            desc = describe(op=op, n=n)
        judge(tally, v, call, desc)

    try:
        run()
    finally:
        epx.Buffer.set_num_sms(saved)
    check_tally("small ops", tally, N_SMALL, SMALL_ARGS)


CONFIG_ARGS = ["num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
               "num_max_rdma_chunked_send_tokens",
               "num_max_rdma_chunked_recv_tokens", "hidden_bytes", "num_ranks", "num_topk"]


def test_fuzz_config():
    """epx.Config's arguments and its buffer-size hints."""
    tally = Counter()

    @fuzz_settings(N_CONFIG)
    @given(st.data())
    def run(data):
        _, pb = data.draw(faults(CONFIG_ARGS))
        sms = data.draw(int_arg(st.integers(1, 33).map(lambda k: 2 * k), pb("num_sms")))
        send = data.draw(int_arg(st.integers(1, 64), pb("num_max_nvl_chunked_send_tokens")))
        recv = data.draw(int_arg(st.integers(64, 8192), pb("num_max_nvl_chunked_recv_tokens")))
        rdma = (data.draw(int_arg(st.just(6), pb("num_max_rdma_chunked_send_tokens"))),
                data.draw(int_arg(st.just(256), pb("num_max_rdma_chunked_recv_tokens"))))
        hidden_bytes = data.draw(int_arg(st.integers(1, 8192).map(lambda k: 2 * k),
                                         pb("hidden_bytes")))
        R = data.draw(int_arg(ranks, pb("num_ranks")))
        K = data.draw(int_arg(st.integers(1, 16), pb("num_topk")))
        v = Verdict()
        ring = (0, 2**20)  # the ring dispatch's sizes (0: EPX's own)
        vals = [rule_int(v, val, name, *bounds) for val, name, *bounds in
                ((sms, "num_sms"), (send, "num_max_nvl_chunked_send_tokens"),
                 (recv, "num_max_nvl_chunked_recv_tokens"),
                 (rdma[0], "num_max_rdma_chunked_send_tokens", ring),
                 (rdma[1], "num_max_rdma_chunked_recv_tokens", ring))]
        hb = rule_int(v, hidden_bytes, "hidden_bytes", (0, 2**64 - 1))
        r = rule_int(v, R, "num_ranks")
        k = rule_int(v, K, "num_topk")
        if not v.broken:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", epx.EPXIgnoredArgumentWarning)
                c = epx.Config(*vals)
            rule_config(v, c, r, sms=0)
            # More than 8 ranks: nodes of 8 (the internode hint), up to 160 ranks.
            across = r > 8
            v.flag(not (1 <= r <= 8 or (across and r % 8 == 0 and r <= 160)), "num_ranks")
            v.flag(not 0 < hb <= (2**30 if across else 2**32), "hidden_bytes")
            v.flag(not 1 <= k <= 16, "num_topk")

        def call():
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", epx.EPXIgnoredArgumentWarning)
                c = epx.Config(sms, send, recv, *rdma)
            assert c.get_nvl_buffer_size_hint(hidden_bytes, R, K) > 0
            assert c.get_rdma_buffer_size_hint(hidden_bytes, R) == 0
            raise Launched

        judge(tally, v, call, describe(sms=sms, send=send, recv=recv, rdma=rdma,
                                       hidden_bytes=hidden_bytes, R=R, K=K))

    run()
    check_tally("Config", tally, N_CONFIG, CONFIG_ARGS + ["config.num_sms",
                                                          "config.num_max_send_tokens",
                                                          "config.num_max_recv_tokens"])

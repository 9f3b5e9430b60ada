"""The fuzz of bad input, Python side (hypothesis; no GPU, no PyTorch): its harness.
test_fuzz.py (the high-throughput ops, DLPack, the layout) and test_fuzz_ll.py (the
low-latency ops, the small ops, Config) draw the sets and judge them with it.


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

import hypothesis  # a test dependency (scripts/install_deps.sh): fail, never skip, without it
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
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


# Sets per test: over 10,000 per run in all (the two test files).
N_DLPACK, N_LAYOUT, N_DISPATCH, N_COMBINE = 1500, 1000, 3000, 1500
N_LL_DISPATCH, N_LL_COMBINE, N_SMALL, N_CONFIG = 2000, 1500, 1000, 1000
assert (N_DLPACK + N_LAYOUT + N_DISPATCH + N_COMBINE + N_LL_DISPATCH + N_LL_COMBINE + N_SMALL
        + N_CONFIG) >= 10000

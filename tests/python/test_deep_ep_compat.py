"""CPU tests of the deep_ep compatibility package (python/deep_ep): the names
DeepEP V1's users import resolve to EPX's objects, the methods keep DeepEP V1's
parameters (names, order, defaults), the static helpers work without a GPU, and
names EPX does not provide fail loudly. No GPU, and no PyTorch except where a
test says so."""

import inspect
import subprocess
import sys
import textwrap
import types

import pytest

import deep_ep
import deep_ep.buffer
import deep_ep.utils
import epx

REQUIRED = inspect.Parameter.empty

# DeepEP V1's public signatures (deep_ep/buffer.py of DeepEP's V1 line, last
# release before V2): parameter names in order, with their defaults.
DEEPEP_V1_BUFFER = {
    "__init__": [("group", REQUIRED), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0),
                 ("low_latency_mode", False), ("num_qps_per_rank", 24),
                 ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
                 ("use_fabric", False), ("explicitly_destroy", False), ("enable_shrink", False),
                 ("comm", None)],
    "get_dispatch_layout": [("topk_idx", REQUIRED), ("num_experts", REQUIRED),
                            ("previous_event", None), ("async_finish", False),
                            ("allocate_on_comm_stream", False)],
    "dispatch": [("x", REQUIRED), ("handle", None), ("num_tokens_per_rank", None),
                 ("num_tokens_per_rdma_rank", None), ("is_token_in_rank", None),
                 ("num_tokens_per_expert", None), ("topk_idx", None), ("topk_weights", None),
                 ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None),
                 ("previous_event", None), ("async_finish", False),
                 ("allocate_on_comm_stream", False)],
    "combine": [("x", REQUIRED), ("handle", REQUIRED), ("topk_weights", None), ("bias", None),
                ("config", None), ("previous_event", None), ("async_finish", False),
                ("allocate_on_comm_stream", False)],
    "internode_dispatch": [("x", REQUIRED), ("handle", None), ("num_tokens_per_rank", None),
                           ("num_tokens_per_rdma_rank", None), ("is_token_in_rank", None),
                           ("num_tokens_per_expert", None), ("topk_idx", None),
                           ("topk_weights", None), ("expert_alignment", 1),
                           ("num_worst_tokens", 0), ("config", None), ("previous_event", None),
                           ("async_finish", False), ("allocate_on_comm_stream", False)],
    "internode_combine": [("x", REQUIRED), ("handle", REQUIRED), ("topk_weights", None),
                          ("bias", None), ("config", None), ("previous_event", None),
                          ("async_finish", False), ("allocate_on_comm_stream", False)],
    "clean_low_latency_buffer": [("num_max_dispatch_tokens_per_rank", REQUIRED),
                                 ("hidden", REQUIRED), ("num_experts", REQUIRED)],
    "low_latency_dispatch": [("x", REQUIRED), ("topk_idx", REQUIRED),
                             ("num_max_dispatch_tokens_per_rank", REQUIRED),
                             ("num_experts", REQUIRED),
                             ("cumulative_local_expert_recv_stats", None),
                             ("dispatch_wait_recv_cost_stats", None), ("use_fp8", True),
                             ("round_scale", False), ("use_ue8m0", False),
                             ("async_finish", False), ("return_recv_hook", False)],
    "low_latency_combine": [("x", REQUIRED), ("topk_idx", REQUIRED), ("topk_weights", REQUIRED),
                            ("handle", REQUIRED), ("use_logfmt", False), ("zero_copy", False),
                            ("async_finish", False), ("return_recv_hook", False),
                            ("out", None), ("combine_wait_recv_cost_stats", None)],
    "low_latency_update_mask_buffer": [("rank_to_mask", REQUIRED), ("mask", False)],
    "low_latency_query_mask_buffer": [("mask_status", REQUIRED)],
    "low_latency_clean_mask_buffer": [],
    "get_next_low_latency_combine_buffer": [("handle", REQUIRED)],
    "get_local_buffer_tensor": [("dtype", REQUIRED), ("size", None), ("offset", 0),
                                ("use_rdma_buffer", False)],
    "get_comm_stream": [],
    "destroy": [],
}
DEEPEP_V1_STATIC = {
    "is_sm90_compiled": [],
    "set_num_sms": [("new_num_sms", REQUIRED)],
    "capture": [],
    "get_low_latency_rdma_size_hint": [("num_max_dispatch_tokens_per_rank", REQUIRED),
                                       ("hidden", REQUIRED), ("num_ranks", REQUIRED),
                                       ("num_experts", REQUIRED)],
    "get_dispatch_config": [("num_ranks", REQUIRED)],
    "get_combine_config": [("num_ranks", REQUIRED)],
}
DEEPEP_V1_CONFIG = [("num_sms", 20), ("num_max_nvl_chunked_send_tokens", 6),
                    ("num_max_nvl_chunked_recv_tokens", 256),
                    ("num_max_rdma_chunked_send_tokens", 6),
                    ("num_max_rdma_chunked_recv_tokens", 256)]


def _params(fn, skip_self=True):
    ps = list(inspect.signature(fn).parameters.values())
    return ps[1:] if skip_self else ps


def _check_prefix(where, params, expected):
    """`params` start with DeepEP's parameters, in DeepEP's order, taking them
    positionally or by keyword, with DeepEP's defaults (EPX may give a default
    where DeepEP requires the argument)."""
    assert len(params) >= len(expected), f"{where}: {len(params)} parameters, DeepEP has more"
    for p, (name, default) in zip(params, expected):
        assert p.name == name, f"{where}: parameter {p.name!r} where DeepEP has {name!r}"
        assert p.kind == p.POSITIONAL_OR_KEYWORD, f"{where}: {name} is {p.kind}"
        if default is not REQUIRED:
            assert p.default == default, f"{where}: {name} defaults to {p.default!r}, " \
                                         f"DeepEP {default!r}"
    for p in params[len(expected):]:  # EPX's own additions never shift DeepEP's positions
        assert p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD), \
            f"{where}: extra parameter {p.name!r} is not keyword-only"


def test_names_resolve_to_epx_objects():
    assert deep_ep.Buffer is epx.Buffer and deep_ep.buffer.Buffer is epx.Buffer
    assert deep_ep.Config is epx.Config
    assert deep_ep.EventOverlap is epx.EventOverlap is deep_ep.utils.EventOverlap
    assert deep_ep.EventHandle is epx.EventHandle is deep_ep.utils.EventHandle
    assert deep_ep.utils.check_nvlink_connections is epx.utils.check_nvlink_connections
    assert callable(deep_ep.utils.check_nvlink_connections)
    assert deep_ep.__version__ == epx.__version__ and deep_ep.BACKEND == "epx"
    assert set(deep_ep.__all__) >= {"Buffer", "Config", "EventOverlap", "topk_idx_t"}


@pytest.mark.parametrize("method, expected", sorted(DEEPEP_V1_BUFFER.items()))
def test_buffer_methods_keep_deep_ep_v1_parameters(method, expected):
    fn = getattr(deep_ep.Buffer, method)
    assert callable(fn)
    _check_prefix(f"Buffer.{method}", _params(fn), expected)


@pytest.mark.parametrize("method, expected", sorted(DEEPEP_V1_STATIC.items()))
def test_static_helpers_keep_deep_ep_v1_parameters(method, expected):
    assert isinstance(inspect.getattr_static(deep_ep.Buffer, method), staticmethod), method
    _check_prefix(f"Buffer.{method}", _params(getattr(deep_ep.Buffer, method), False), expected)


def test_config_keeps_deep_ep_v1_parameters():
    _check_prefix("Config", _params(deep_ep.Config.__init__), DEEPEP_V1_CONFIG)
    # SGLang builds configs from a JSON object with DeepEP's names
    cfg = deep_ep.Config(**{"num_sms": 24, "num_max_nvl_chunked_send_tokens": 8,
                            "num_max_nvl_chunked_recv_tokens": 512,
                            "num_max_rdma_chunked_send_tokens": 6,
                            "num_max_rdma_chunked_recv_tokens": 256})
    assert (cfg.num_sms, cfg.num_max_nvl_chunked_send_tokens,
            cfg.num_max_nvl_chunked_recv_tokens) == (24, 8, 512)
    assert cfg.get_nvl_buffer_size_hint(7168 * 2, 8) > 0
    assert cfg.get_rdma_buffer_size_hint(7168 * 2, 8) == 0


def test_static_helpers_work_without_a_gpu():
    # vLLM sizes the low-latency buffer by keyword before any buffer exists
    n = deep_ep.Buffer.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank=128, hidden=7168, num_ranks=8, num_experts=256)
    assert isinstance(n, int) and n > 0
    assert n == epx.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    for get in (deep_ep.Buffer.get_dispatch_config, deep_ep.Buffer.get_combine_config):
        cfg = get(8)
        assert isinstance(cfg, deep_ep.Config) and cfg.num_sms == deep_ep.Buffer.num_sms
        assert cfg.get_nvl_buffer_size_hint(7168 * 2, 8) > 0
    # DeepEP's internode sizing at EP16: nodes of 8, the internode ops' whole-call worst case
    ep16 = deep_ep.Buffer.get_dispatch_config(16).get_nvl_buffer_size_hint(7168 * 2, 16)
    assert ep16 == epx.Buffer.get_internode_nvl_size_hint(4096, 7168, 16, 8, 16)
    assert deep_ep.Buffer.is_sm90_compiled() is True
    assert isinstance(deep_ep.Buffer.num_sms, int)


def test_names_epx_does_not_provide_fail_loudly():
    # DeepEP V2's ElasticBuffer & co. are provided (tests/python/test_deep_ep_v2.py).
    for name in ("HybridEPBuffer",):
        assert not hasattr(deep_ep, name)
        with pytest.raises(AttributeError, match=rf"deep_ep\.{name} .* not provided by EPX"):
            getattr(deep_ep, name)
    # Megatron-LM: `try: from deep_ep import HybridEPBuffer / except ImportError`
    with pytest.raises(ImportError, match="HybridEPBuffer"):
        from deep_ep import HybridEPBuffer  # noqa: F401
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        deep_ep.not_a_name  # noqa: B018


def test_internode_methods_within_one_node_raise_and_across_nodes_are_dispatch_and_combine():
    # No GPU needed: within one node they refuse before any work; across nodes
    # they go on to dispatch / combine (which stop at their first tensor here).
    buf = _bare_buffer(nodes=1)
    with pytest.raises(epx.EPXUnsupportedError, match="internode_dispatch: .*one node"):
        buf.internode_dispatch(None)
    with pytest.raises(epx.EPXUnsupportedError, match="internode_combine: .*one node"):
        buf.internode_combine(None, None)
    buf = _bare_buffer(nodes=2)
    with pytest.raises(_Stop):
        buf.internode_dispatch(None)
    with pytest.raises(TypeError, match="^combine: handle: expected the handle"):
        buf.internode_combine(None, None)


def _run_python(code):
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, env={"PYTHONPATH": ":".join(p for p in sys.path if p),
                                       "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_frameworks_import_lines_run_without_torch():
    """The import lines of SGLang, vLLM and Megatron-LM (docs/integration.md), in a
    fresh interpreter where `import torch` fails: importing needs no PyTorch."""
    out = _run_python("""
        import sys
        sys.modules["torch"] = None
        from deep_ep import Buffer, Config                         # SGLang
        import deep_ep                                             # vLLM
        from deep_ep.utils import EventHandle, EventOverlap        # Megatron-LM
        try:
            from deep_ep import HybridEPBuffer                     # Megatron-LM, optional
        except ImportError:
            pass
        else:
            raise AssertionError("HybridEPBuffer must not import")
        assert Buffer is deep_ep.Buffer and Config is deep_ep.Config
        try:
            deep_ep.topk_idx_t
        except ImportError as e:
            assert "PyTorch" in str(e), e
        else:
            raise AssertionError("topk_idx_t without torch must raise ImportError")
        print("ok")
    """)
    assert out.strip() == "ok"


def test_topk_idx_t_is_torch_int64():
    torch = pytest.importorskip("torch")
    assert deep_ep.topk_idx_t is torch.int64 and epx.topk_idx_t is torch.int64


class _FakeNvml:
    """pynvml's calls check_nvlink_connections uses, over a fixed set of NVLink pairs."""
    NVML_P2P_CAPS_INDEX_NVLINK = 3
    NVML_P2P_STATUS_OK = 0

    def __init__(self, linked):
        self.linked = linked

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return uuid

    def nvmlDeviceGetP2PStatus(self, a, b, cap):
        assert cap == self.NVML_P2P_CAPS_INDEX_NVLINK
        return 0 if frozenset((a, b)) in self.linked else 5


def test_nvlink_pairs_from_nvml():
    from epx.utils import _pairs_without_nvlink

    uuids = ["GPU-a", "GPU-b", "GPU-c"]
    all_pairs = {frozenset(p) for p in [("GPU-a", "GPU-b"), ("GPU-a", "GPU-c"),
                                        ("GPU-b", "GPU-c")]}
    assert _pairs_without_nvlink(uuids, _FakeNvml(all_pairs)) == []
    some = all_pairs - {frozenset(("GPU-a", "GPU-c"))}
    assert _pairs_without_nvlink(uuids, _FakeNvml(some)) == [(0, 2)]
    assert _pairs_without_nvlink(uuids, _FakeNvml(set())) == [(0, 1), (0, 2), (1, 2)]


# ---- DeepEP arguments EPX cannot act on: warn once, or refuse naming them --------------------

@pytest.fixture
def fresh_warnings():
    """Forgets which arguments have warned, so each test sees its first warning."""
    from epx import compat

    compat._reset_for_tests()
    yield
    compat._reset_for_tests()


class _Stop(Exception):
    pass


class _StopGlue:
    """Stands in for the torch glue of a Buffer: the first tensor conversion stops the
    call, so a test sees what the method did with its arguments before any work."""

    def view(self, name, t):
        raise _Stop(name)

    opt_view = rows = view


def _bare_buffer(nodes=1):
    """A Buffer with no GPU state whose ranks form `nodes` nodes."""
    buf = object.__new__(epx.Buffer)
    buf._glue = _StopGlue()
    buf.runtime = types.SimpleNamespace(get_num_rdma_ranks=lambda: nodes)
    return buf


def _ignored(record):
    return [w for w in record if issubclass(w.category, epx.EPXIgnoredArgumentWarning)]


# DeepEP branches' arguments (keyword-only in EPX), per method.
FRAMEWORK_KWARGS = {
    "__init__": ["allow_nvlink_for_normal_mode", "eager_support"],
    "low_latency_dispatch": ["topk_weights", "x_global_scale", "use_nvfp4", "use_ue8m0_for_sf",
                             "use_eager"],
    "low_latency_combine": ["overlap", "packed_recv_count", "comp_signal", "block_m", "threshold",
                            "num_sms", "src_signals", "src_signal_expect_value", "use_eager"],
}


@pytest.mark.parametrize("method, names", sorted(FRAMEWORK_KWARGS.items()))
def test_deep_ep_branch_arguments_are_accepted_by_keyword(method, names):
    params = inspect.signature(getattr(deep_ep.Buffer, method)).parameters
    for name in names:
        assert name in params and params[name].kind == inspect.Parameter.KEYWORD_ONLY, name


@pytest.mark.parametrize("kwargs, arg", [
    (dict(num_qps_per_rank=32), "num_qps_per_rank"),
    (dict(allow_nvlink_for_low_latency_mode=False), "allow_nvlink_for_low_latency_mode"),
    (dict(allow_mnnvl=True), "allow_mnnvl"),
    (dict(use_fabric=True), "use_fabric"),
    (dict(eager_support=True), "eager_support"),
])
def test_buffer_arguments_without_effect_warn_once(fresh_warnings, kwargs, arg):
    import warnings

    for round_ in range(2):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            # No torch (ImportError) or no process group (ValueError): the warning
            # comes first either way.
            with pytest.raises((ImportError, ValueError)):
                epx.Buffer(None, **kwargs)
        got = _ignored(record)
        if round_ == 0:
            assert len(got) == 1, [str(w.message) for w in record]
            assert f"Buffer: {arg}: has no effect" in str(got[0].message)
            assert got[0].filename == __file__  # points at the caller's line
        else:
            assert got == [], "warned twice for the same argument"


def test_buffer_defaults_do_not_warn(fresh_warnings):
    import warnings

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises((ImportError, ValueError)):
            epx.Buffer(None, num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True,
                       allow_mnnvl=False, use_fabric=False, eager_support=False)
    assert _ignored(record) == []


def test_buffer_refuses_high_throughput_without_nvlink():
    with pytest.raises(epx.EPXUnsupportedError,
                       match="Buffer: allow_nvlink_for_normal_mode: .*NVLink only") as info:
        epx.Buffer(None, allow_nvlink_for_normal_mode=False)
    assert info.value.code == epx._core.ErrorCode.unsupported


@pytest.mark.parametrize("kwargs, arg", [
    (dict(use_nvfp4=True), "use_nvfp4"),
    (dict(x_global_scale=object()), "x_global_scale"),
    (dict(use_ue8m0_for_sf=True), "use_ue8m0_for_sf"),
    (dict(topk_weights=object()), "topk_weights"),
])
def test_low_latency_dispatch_refuses_what_it_cannot_return(kwargs, arg):
    with pytest.raises(epx.EPXUnsupportedError, match=rf"low_latency_dispatch: {arg}: "):
        _bare_buffer().low_latency_dispatch(None, None, 128, 256, **kwargs)


def test_low_latency_combine_refuses_overlap_and_takes_its_settings_without_it():
    with pytest.raises(epx.EPXUnsupportedError, match="low_latency_combine: overlap: "):
        _bare_buffer().low_latency_combine(None, None, None, None, overlap=True)
    # Without overlap DeepEP ignores the overlap settings too: the call goes on.
    with pytest.raises(TypeError, match="handle: expected the handle"):
        _bare_buffer().low_latency_combine(None, None, None, None, overlap=False, block_m=128,
                                           threshold=3, num_sms=5, comp_signal=object(),
                                           packed_recv_count=object(), src_signals=object(),
                                           src_signal_expect_value=2)


def test_per_call_arguments_without_effect_warn_once(fresh_warnings):
    import warnings

    calls = [
        ("dispatch", "num_tokens_per_rdma_rank",
         lambda b: b.dispatch(None, num_tokens_per_rdma_rank=object())),
        ("low_latency_dispatch", "use_eager",
         lambda b: b.low_latency_dispatch(None, None, 128, 256, use_eager=True)),
    ]
    # Across nodes DeepEP passes get_dispatch_layout's per-node counts: no warning.
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(_Stop):
            _bare_buffer(nodes=2).dispatch(None, num_tokens_per_rdma_rank=object())
    assert not _ignored(record)
    for op, arg, call in calls:
        for round_ in range(2):
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                with pytest.raises(_Stop):
                    call(_bare_buffer())
            got = _ignored(record)
            assert len(got) == (1 if round_ == 0 else 0), (op, arg, round_)
            if got:
                assert f"{op}: {arg}: " in str(got[0].message)


def test_config_rdma_fields_reach_the_core_config(fresh_warnings):
    """DeepEP's defaults leave EPX's ring sizes (0 in the core config); other values
    go through; out of range is an error naming the DeepEP field."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", epx.EPXIgnoredArgumentWarning)
        d = epx.Config(24, 6, 256, 6, 256)
        assert (d._cfg.num_max_rdma_send_tokens, d._cfg.num_max_rdma_recv_tokens) == (0, 0)
        assert (d.num_max_rdma_chunked_send_tokens, d.num_max_rdma_chunked_recv_tokens) == (6, 256)
        c = epx.Config(24, 6, 256, 24, 128)
        assert (c._cfg.num_max_rdma_send_tokens, c._cfg.num_max_rdma_recv_tokens) == (24, 128)
        assert (c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (24, 128)
        c.num_max_rdma_chunked_send_tokens = 6
        assert c._cfg.num_max_rdma_send_tokens == 0 and c.num_max_rdma_chunked_send_tokens == 6
        w = epx.Buffer.get_dispatch_config(16)
        assert (w.num_max_rdma_chunked_send_tokens, w.num_max_rdma_chunked_recv_tokens) == (6, 256)
        for bad in (-1, 2**20 + 1):
            with pytest.raises(epx.EPXValueError, match="num_max_rdma_chunked_recv_tokens"):
                epx.Config(24, 6, 256, 6, bad)
            with pytest.raises(epx.EPXValueError, match="num_max_rdma_chunked_send_tokens"):
                epx.Config(24, 6, 256, bad, 256)


def test_config_rdma_fields_warn_once_unless_default(fresh_warnings):
    import warnings

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        epx.Config(24, 6, 256, 6, 256)  # DeepEP's defaults: no warning
        assert _ignored(record) == []
        epx.Config(24, 6, 256, 6, 128)  # as in DeepEP's own config tables
        epx.Config(24, 6, 256, 12, 128)
    got = [str(w.message) for w in _ignored(record)]
    assert len(got) == 2, got
    assert any("num_max_rdma_chunked_recv_tokens" in m for m in got)
    assert any("num_max_rdma_chunked_send_tokens" in m for m in got)

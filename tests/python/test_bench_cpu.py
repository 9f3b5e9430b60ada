"""CPU tests of epx.bench: its command line, byte counts (against the C++
bench's figures), statistics, result, report and plots. Need NumPy; the plots
matplotlib (skipped without it)."""

import json
import textwrap

import pytest

from cpu_helpers import _run_clean



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


def test_bench_v2_mode_result_and_report():
    """--mode v2: one point at --tokens (no sweep even with --sweep), V2's and V1's ops with
    high-throughput bytes, the SM count get_theoretical_num_sms gave, in the JSON and the
    table."""
    b = _bench()
    args = b.parse_args(["--mode", "v2", "--tokens", "1024", "--sweep"])
    assert b.families(args.mode) == ("v2",) and b._points(args) == {"v2": [1024]}
    ranks = []
    for r in range(2):
        N = 3 * 1024 + 50 * r
        ops = {k: {"us": 50.0 + 10 * i + r, "host_us": 5.0, "bytes": b.op_bytes("v2", kind, N,
                                                                                   7168)}
               for i, (k, _, kind) in enumerate(b.V2_OPS)}
        ranks.append({"v2": [{"tokens": 1024, "num_recv_tokens": N, "num_sms": 20, "ops": ops,
                              "torch": {}}]})
    res = b.build_result(args, 2, ranks, device="Fake GPU x2")
    v2 = res["v2"]
    assert res["sweep"] == {} and v2["tokens"] == 1024 and v2["num_sms"] == 20
    assert v2["v2_dispatch_bf16_us"] == pytest.approx(50.5)
    assert v2["v1_combine_us"] == pytest.approx(90.5)
    g = [b.ht_bytes(3 * 1024 + 50 * r, 7168, fp8=True) / (60.0 + r) / 1e3 for r in range(2)]
    assert v2["v2_dispatch_fp8_gbps"] == pytest.approx(sum(g) / 2)
    json.dumps(res)
    text = b.format_report(res)
    assert "V2 API (ElasticBuffer) beside V1 (Buffer): 1024 tokens per rank, 20 SMs" in text
    for _, label, _ in b.V2_OPS:
        assert any(line.startswith(label) for line in text.splitlines()), label
    assert "tokens received per rank: 3097" in text


class _FakeV1:
    """What _measure_ht / _measure_v2 call on an epx.Buffer, on CPU tensors: every token goes
    to this rank once (`rows` of them come back, default all), the combine returns its input."""

    def __init__(self, rows=None):
        self.rows, self.calls = rows, []

    def get_dispatch_layout(self, idx, E):
        self.calls.append("layout")
        return (None, None, None, None, None)

    def dispatch(self, x, handle=None, **kw):
        self.calls.append("dispatch" if handle is None else "cached dispatch")
        rows = x if not isinstance(x, tuple) else x[0]
        return rows[:self.rows], None, None, None, "v1-handle", None

    def combine(self, y, handle):
        assert handle == "v1-handle"
        self.calls.append("combine")
        return y, None, None


class _FakeV2:
    def __init__(self):
        self.calls = []

    def get_theoretical_num_sms(self, E, K):
        return 20

    def dispatch(self, x, topk_idx=None, topk_weights=None, num_experts=None, num_sms=0):
        assert num_experts is not None and num_sms == 20 and topk_weights.shape == topk_idx.shape
        self.calls.append("dispatch")
        return (x if not isinstance(x, tuple) else x[0]), None, None, "v2-handle", None

    def combine(self, y, handle, num_sms=0):
        assert handle == "v2-handle" and num_sms == 20
        self.calls.append("combine")
        return y, None, None


class _OnceTimer:
    """Timer.measure's contract, running each op once."""

    def measure(self, fn, nbytes):
        fn()
        return {"us": 1.0, "bytes": nbytes}


def test_bench_measure_functions_drive_the_apis_as_the_gpu_run_will():
    """_measure_ht and _measure_v2 on fake buffers (CPU tensors): every op of their tables
    is called and counted with the rows the dispatch returned; V1 and V2 receiving different
    row counts is an error naming both."""
    torch = pytest.importorskip("torch")
    b = _bench()
    args = b.parse_args(["--mode", "v2", "--tokens", "16", "--hidden", "256", "--topk", "2",
                         "--experts", "8"])
    v1, v2 = _FakeV1(), _FakeV2()
    p = b._measure_v2(v1, v2, _OnceTimer(), None, args, 16, 0, torch.device("cpu"))
    assert p["num_recv_tokens"] == 16 and p["num_sms"] == 20
    assert set(p["ops"]) == {k for k, _, _ in b.V2_OPS}
    assert p["ops"]["v2_dispatch_fp8"]["bytes"] == b.ht_bytes(16, 256, fp8=True)
    assert p["ops"]["v1_combine"]["bytes"] == b.ht_bytes(16, 256)
    assert v2.calls.count("dispatch") == 3 and v2.calls.count("combine") == 1
    assert v1.calls.count("layout") == 2 and v1.calls.count("combine") == 1
    with pytest.raises(RuntimeError, match="V1 receives 15 rows, V2 16"):
        b._measure_v2(_FakeV1(rows=15), _FakeV2(), _OnceTimer(), None, args, 16, 0,
                      torch.device("cpu"))
    args_ht = b.parse_args(["--mode", "ht", "--tokens", "16", "--hidden", "256", "--topk", "2",
                            "--experts", "8"])
    v1 = _FakeV1()
    p = b._measure_ht(v1, _OnceTimer(), None, args_ht, 16, 0, torch.device("cpu"))
    assert set(p["ops"]) == {k for k, _, _ in b.HT_OPS} and p["num_recv_tokens"] == 16
    assert v1.calls.count("cached dispatch") == 2


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

"""CPU tests of the reference model (epx.reference) against independent NumPy
computations: conversions, FP8 quantisation, LogFMT, layout, and the
high-throughput and low-latency dispatch and combine. Need NumPy only."""


import numpy as np
import pytest

from epx import _core
from epx import reference as ref

from cpu_helpers import FP8, RNG, np_bf16_bits, np_bf16_float, np_fp8_bits, np_layout, np_quantize, random_bf16, random_topk



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

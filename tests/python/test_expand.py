"""epx.expand (DeepEP V2's expanded layout from EPX's non-expanded dispatch) against
epx.reference.ht_expand / ht_fold, on PyTorch CPU tensors and fresh random routings.

The GPU path through deep_ep.ElasticBuffer is test_gpu.py's _case_elastic_v2."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from epx import expand  # noqa: E402
from epx import reference as ref  # noqa: E402

SEED = int(os.environ.get("EPX_FUZZ_SEED", np.random.SeedSequence().entropy % 2**32))


def _routing(rng, n, k, e_local, p_here):
    """[n, k] local ids, each pair this rank's with probability p_here, else -1;
    distinct ids per row (as top-k gives them)."""
    idx = np.full((n, k), -1, np.int64)
    for i in range(n):
        ids = rng.permutation(max(e_local, k))[:k]
        here = (rng.random(k) < p_here) & (ids < e_local)
        idx[i, here] = ids[here]
    return idx


CASES = [  # rows, top-k, local experts, alignment, share of pairs here
    (0, 4, 2, 1, 0.5), (1, 1, 1, 1, 1.0), (37, 4, 3, 1, 0.5), (64, 8, 4, 4, 0.3),
    (129, 8, 16, 128, 0.6), (50, 6, 2, 7, 0.9), (20, 3, 8, 2, 0.0),
]


@pytest.mark.parametrize("n, k, e_local, align, p", CASES)
def test_layout_matches_the_reference(n, k, e_local, align, p):
    rng = np.random.default_rng([SEED, n, k, e_local, align])
    idx = _routing(rng, n, k, e_local, p)
    want = ref.ht_expand(idx, e_local, align)
    t = torch.from_numpy(idx)
    counts = expand.count_pairs(t, e_local)
    assert counts.tolist() == want["counts"].tolist()
    slots, psum = expand.layout(t, counts, align)
    assert slots.dtype == torch.int32 and psum.dtype == torch.int32
    np.testing.assert_array_equal(slots.numpy(), want["slots"])
    np.testing.assert_array_equal(psum.numpy(), want["starts"] + want["counts"])
    assert int(expand.align_counts(counts, align).sum()) == want["num_slots"]
    # every slot used once, inside its expert's aligned group
    used = want["slots"][want["slots"] >= 0]
    assert len(set(used.tolist())) == len(used)
    assert want["num_slots"] <= expand.worst_case_slots(n, k, e_local, align)


@pytest.mark.parametrize("n, k, e_local, align, p", CASES)
def test_rows_and_weights_expand_and_fold_back(n, k, e_local, align, p):
    rng = np.random.default_rng([SEED, 7, n, k, e_local, align])
    idx = _routing(rng, n, k, e_local, p)
    want = ref.ht_expand(idx, e_local, align)
    slots = torch.from_numpy(want["slots"]).to(torch.int32)
    # Sizes: the exact total, and V2's worst case (extra slots stay zero).
    for num_slots in (want["num_slots"], expand.worst_case_slots(n, k, e_local, align)):
        H = 32
        bits = ref.bf16_from_float(rng.standard_normal((n, H)).astype(np.float32))
        rows = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
        out = expand.expand_rows(rows, slots, num_slots)
        assert out.shape == (num_slots, H) and out.dtype == torch.bfloat16
        got = out.view(torch.int16).numpy().view(np.uint16)
        filled = np.zeros(num_slots, bool)
        for i in range(n):
            for j in range(k):
                s = want["slots"][i, j]
                if s >= 0:
                    np.testing.assert_array_equal(got[s], bits[i])
                    filled[s] = True
        assert not got[~filled].any(), "padding and unused slots are zero"

        # FP8 rows (one byte each) land at the same slots
        q = rng.integers(0, 256, (n, H), dtype=np.uint8)
        q_exp = expand.expand_rows(torch.from_numpy(q).view(torch.float8_e4m3fn), slots,
                                   num_slots)
        assert q_exp.dtype == torch.float8_e4m3fn and q_exp.shape == (num_slots, H)
        got_q = q_exp.view(torch.uint8).numpy()
        for i in range(n):
            for j in range(k):
                if want["slots"][i, j] >= 0:
                    np.testing.assert_array_equal(got_q[want["slots"][i, j]], q[i])
        assert not got_q[~filled].any()

        w = rng.random((n, k)).astype(np.float32)
        we = expand.expand_weights(torch.from_numpy(w), slots, num_slots)
        assert we.shape == (num_slots,)
        for i in range(n):
            for j in range(k):
                if want["slots"][i, j] >= 0:
                    assert we[want["slots"][i, j]].item() == w[i, j]
        assert not we.numpy()[~filled].any()
        back = expand.fold_weights(we, slots).numpy()
        np.testing.assert_array_equal(back, np.where(want["slots"] >= 0, w, 0))

        # fold: expert outputs in slot order -> one row per received row
        y_bits = ref.bf16_from_float(rng.standard_normal((num_slots, H)).astype(np.float32))
        y = torch.from_numpy(y_bits.view(np.int16)).view(torch.bfloat16)
        folded = expand.fold_rows(y, slots).view(torch.int16).numpy().view(np.uint16)
        np.testing.assert_array_equal(folded, ref.ht_fold(y_bits, want["slots"]))


def test_the_fold_sums_in_float32_and_rounds_once():
    # 1 + 2^-8 + 2^-8: each 2^-8 is half of BF16's ulp at 1, so rounding after each
    # add (ties to even) would give 1.0 twice; one rounding of the sum gives 1 + 2^-7
    slots = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    y = torch.tensor([[1.0], [2.0**-8], [2.0**-8]], dtype=torch.float32).to(torch.bfloat16)
    assert expand.fold_rows(y, slots).float().item() == 1.0 + 2.0**-7
    ref_bits = ref.ht_fold(y.view(torch.int16).numpy().view(np.uint16), slots.numpy())
    assert ref.bf16_to_float(ref_bits).item() == 1.0 + 2.0**-7


def test_a_wrong_slot_count_is_refused_by_name():
    import epx

    with pytest.raises(epx.EPXValueError, match=r"combine: x: has 5 rows; .* 8 slots"):
        expand.check_expanded("ElasticBuffer.combine", "x", torch.zeros(5, 2), 8)
    expand.check_expanded("ElasticBuffer.combine", "x", torch.zeros(8, 2), 8)


# ---- ElasticBuffer's expand glue, EPX's reference dispatch standing in for its kernels ------
# (the kernels' own outputs are checked on a GPU: test_gpu.py's _case_elastic_v2)

class _V1Handle:
    def __init__(self, tensors):
        self.tensors = tensors

    def _tensor(self, name):
        return self.tensors[name]


class _ReferenceRuntime:
    """epx.Buffer's get_dispatch_layout / dispatch / combine for rank 0 of `world` ranks,
    answered by epx.reference on CPU tensors; combine returns what it was given."""

    def __init__(self, all_x, all_idx, all_w, num_experts):
        self.args = (all_x, all_idx, all_w, num_experts)

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None):
        return None, None, None, None, None

    def dispatch(self, x, topk_idx=None, topk_weights=None, expert_alignment=1,
                 num_worst_tokens=0, handle=None, **_):
        all_x, all_idx, all_w, E = self.args
        if handle is not None:
            return self._cached(x), None, None, None, None, None
        o = ref.ht_dispatch(all_x, all_idx, E, topk_weights=all_w,
                            expert_alignment=expert_alignment)[0]
        n = len(o["recv_src_idx"])
        rows = num_worst_tokens or n
        recv = np.zeros((rows, all_x[0].shape[1]), np.uint16)
        recv[:n] = o["recv_x"]
        ridx = np.full((rows, all_idx[0].shape[1]), -1, np.int64)
        ridx[:n] = o["recv_topk_idx"]
        rw = np.zeros(ridx.shape, np.float32)
        rw[:n] = o["recv_topk_weights"]
        src = np.zeros(rows, np.int32)
        src[:n] = o["recv_src_idx"]
        h = _V1Handle({"rank_prefix_matrix": torch.from_numpy(
            o["rank_prefix_matrix"].astype(np.int32)), "recv_src_idx": torch.from_numpy(src)})
        counts = [] if num_worst_tokens else o["num_recv_tokens_per_expert"]
        self.want, self.rows = o, rows
        return (torch.from_numpy(recv.view(np.int16)).view(torch.bfloat16),
                torch.from_numpy(ridx), torch.from_numpy(rw), counts, h, None)

    def _cached(self, x):
        """V1's cached dispatch of the last dispatch's routing: every rank's rows of x's
        kind (rank 0's the tensor given, the others' the world's: BF16 x, or the weights
        padded as x is) in the received order; rows past the data zero."""
        all_x, _, all_w, _ = self.args
        bf16 = x.dtype == torch.bfloat16
        o, got = self.want, (x.view(torch.int16) if bf16 else x).numpy()
        if not bf16:
            peers = [np.pad(w, ((0, 0), (0, got.shape[1] - w.shape[1]))) for w in all_w]
        else:
            peers = [a.view(np.int16) for a in all_x]
        peers[0] = got
        n = len(o["recv_src_idx"])
        ends = o["rank_prefix_matrix"][:, 0]
        out = np.zeros((self.rows, got.shape[1]), got.dtype)
        for i in range(n):
            out[i] = peers[int(np.searchsorted(ends, i, side="right"))][o["recv_src_idx"][i]]
        return torch.from_numpy(out).view(torch.bfloat16) if bf16 else torch.from_numpy(out)

    def combine(self, x, handle, topk_weights=None, bias=None, **_):
        return x, topk_weights, None


def _elastic_on_reference(rng, tokens, E, K, H, maxT):
    """A 2-rank ElasticBuffer on rank 0 whose runtime is _ReferenceRuntime over fresh random
    routing (distinct experts per token), rows and weights: `tokens` per rank. Returns the
    buffer and every rank's x (BF16 bits), top-k ids and weights."""
    import epx

    world = len(tokens)
    all_idx = [np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int64)
               for t in tokens]
    all_x = [ref.bf16_from_float(rng.standard_normal((len(i), H)).astype(np.float32))
             for i in all_idx]
    all_w = [rng.random(i.shape).astype(np.float32) for i in all_idx]
    buf = object.__new__(epx.ElasticBuffer)
    buf.num_ranks, buf.rank_idx, buf.num_max_tokens_per_rank = world, 0, maxT
    buf.num_allocated_qps, buf.num_rdma_ranks, buf.num_nvlink_ranks = 4, 1, world
    buf.num_scaleout_ranks, buf.num_scaleup_ranks = 1, world
    buf.allow_multiple_reduction = True
    buf.runtime = _ReferenceRuntime(all_x, all_idx, all_w, E)
    return buf, all_x, all_idx, all_w


@pytest.mark.parametrize("sync", [True, False])
def test_elastic_expanded_dispatch_and_combine_glue(sync):
    rng = np.random.default_rng([SEED, 11, sync])
    world, E, K, H, maxT, align = 2, 8, 3, 16, 24, 4
    buf, all_x, all_idx, all_w = _elastic_on_reference(rng, (20, 13), E, K, H, maxT)
    rt = buf.runtime
    x = torch.from_numpy(all_x[0].view(np.int16)).view(torch.bfloat16)
    stats = torch.zeros(E // world, dtype=torch.int32)
    rx, ri, rw, h, _ = buf.dispatch(x, topk_idx=torch.from_numpy(all_idx[0]),
                                    topk_weights=torch.from_numpy(all_w[0]), num_experts=E,
                                    expert_alignment=align, do_expand=True, do_cpu_sync=sync,
                                    cumulative_local_expert_recv_stats=stats)
    o = rt.want
    n = len(o["recv_src_idx"])
    lay = ref.ht_expand(o["recv_topk_idx"], E // world, align)
    S = lay["num_slots"] if sync else expand.worst_case_slots(maxT * world, K, E // world, align)
    assert ri is None and h.do_expand and h.num_expanded_tokens == S
    assert rx.shape == (S, H) and rw.shape == (S,)
    assert h.num_recv_tokens == (n if sync else maxT * world)
    assert stats.tolist() == lay["counts"].tolist()
    np.testing.assert_array_equal(h.num_unaligned_recv_tokens_per_expert.numpy(), lay["counts"])
    np.testing.assert_array_equal(h.psum_num_recv_tokens_per_expert.numpy(),
                                  lay["starts"] + lay["counts"])
    np.testing.assert_array_equal(h.recv_src_metadata[:n, 2:].numpy(), lay["slots"])
    assert bool((h.recv_src_metadata[n:, 2:] == -1).all())
    where = lay["slots"] >= 0
    rows = np.broadcast_to(np.arange(n)[:, None], where.shape)[where]
    got = rx.view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(got[lay["slots"][where]], o["recv_x"][rows])
    np.testing.assert_array_equal(rw.numpy()[lay["slots"][where]], o["recv_topk_weights"][where])

    # combine: slot-order outputs folded per row before EPX's combine; weights back to [N, K]
    y = ref.bf16_from_float(rng.standard_normal((S, H)).astype(np.float32))
    yt = torch.from_numpy(y.view(np.int16)).view(torch.bfloat16)
    cx, cw, _ = buf.combine(yt, h, topk_weights=rw)
    np.testing.assert_array_equal(cx[:n].view(torch.int16).numpy().view(np.uint16),
                                  ref.ht_fold(y, lay["slots"]))
    assert not cx[n:].float().any()
    np.testing.assert_array_equal(cw[:n].numpy(), np.where(where, o["recv_topk_weights"], 0))


@pytest.mark.parametrize("sync", [True, False])
@pytest.mark.parametrize("do_expand", [False, True])
def test_elastic_cached_dispatch_glue(do_expand, sync):
    """handle=: the handle's routing and row order again, x and the weights resent, the
    same handle returned; the outputs equal the first dispatch's."""
    rng = np.random.default_rng([SEED, 12, sync, do_expand])
    E, K, H, maxT, align = 8, 3, 16, 24, 2
    buf, all_x, all_idx, all_w = _elastic_on_reference(rng, (17, 21), E, K, H, maxT)
    x = torch.from_numpy(all_x[0].view(np.int16)).view(torch.bfloat16)
    w = torch.from_numpy(all_w[0])
    rx, ri, rw, h, _ = buf.dispatch(x, topk_idx=torch.from_numpy(all_idx[0]), topk_weights=w,
                                    num_experts=E, expert_alignment=align, do_expand=do_expand,
                                    do_cpu_sync=sync)
    # the caller's x and weights change in place between the calls, as a layer's would
    x2 = torch.from_numpy(ref.bf16_from_float(
        rng.standard_normal(all_x[0].shape).astype(np.float32)).view(np.int16)).view(torch.bfloat16)
    all_x[0] = x2.view(torch.int16).numpy().view(np.uint16)
    rx2, ri2, rw2, h2, _ = buf.dispatch(x2, handle=h, topk_weights=w, do_expand=do_expand)
    assert h2 is h
    rx_again, _, rw_none, _, _ = buf.dispatch(x, handle=h, do_expand=do_expand)
    assert rw_none is None
    np.testing.assert_array_equal(rx_again.view(torch.int16).numpy(),
                                  rx.view(torch.int16).numpy())
    np.testing.assert_array_equal(rw2.numpy(), rw.numpy())
    assert rx2.shape == rx.shape
    # every received row is its source's current x (rank 0's now x2's, the peer's unchanged)
    o = buf.runtime.want
    n = len(o["recv_src_idx"])
    ends = o["rank_prefix_matrix"][:, 0]
    got = rx2.view(torch.int16).numpy().view(np.uint16)
    want = [all_x[int(np.searchsorted(ends, i, side="right"))][o["recv_src_idx"][i]]
            for i in range(n)]
    if do_expand:
        assert ri2 is None
        slots = h.expand_slots.numpy()
        for i in range(n):
            for s_ in slots[i][slots[i] >= 0]:
                np.testing.assert_array_equal(got[s_], want[i])
    else:
        np.testing.assert_array_equal(ri2.numpy(), ri.numpy())
        assert ri2.data_ptr() != ri.data_ptr()  # a copy the caller may change
        for i in range(n):
            np.testing.assert_array_equal(got[i], want[i])
        assert not got[n:].any()

"""The intranode handle's channel elements (epx.handles) against the reference's
plain-loop statement of DeepEP's definitions: on numpy arrays always, and on
torch CPU tensors (what handles hold) where torch is installed."""

import importlib.util

import numpy as np
import pytest

from epx import handles
from epx import reference as ref


def _testing():
    """epx._testing (handles with fake routing tensors), which scripts/test.sh builds."""
    return pytest.importorskip(
        "epx._testing", reason="epx built without EPX_PYTHON_TESTING=ON (scripts/test.sh builds it)")

BACKENDS = ["numpy"] + (["torch"] if importlib.util.find_spec("torch") else [])


def _as(backend, a):
    if backend == "numpy":
        return np.asarray(a)
    import torch
    return torch.from_numpy(np.ascontiguousarray(a))


def _np(x):
    return x if isinstance(x, np.ndarray) else x.numpy()


def _masks(rng, R, sizes, p):
    return [rng.random((T, R)) < p for T in sizes]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("R,C,sizes,p", [
    (2, 1, [5, 7], 0.5),
    (4, 10, [64, 81, 0, 33], 0.4),
    (8, 12, [200, 3, 129, 77, 1, 0, 50, 96], 0.3),
    (3, 16, [5, 9, 2], 0.9),  # fewer tokens than channels
    (4, 7, [40, 40, 40, 40], 0.0),  # nothing sent
    (4, 7, [40, 41, 42, 43], 1.0),  # everything sent everywhere
])
def test_channel_elements_match_the_reference(R, C, sizes, p, backend):
    rng = np.random.default_rng(R * 100 + C)
    masks = _masks(rng, R, sizes, p)
    source_tokens = _as(backend, np.asarray(sizes, dtype=np.int32))
    for rank in range(R):
        want = ref.deepep_intranode_handle(masks, rank, C)
        prefix = _as(backend, want[0])
        in_rank = _as(backend, masks[rank])
        src_idx = _as(backend, want[3])
        chan = handles.channel_prefix_matrix(in_rank, C)
        np.testing.assert_array_equal(_np(chan), want[1])
        assert str(chan.dtype).endswith("int32") and tuple(chan.shape) == (R, C)
        recv = handles.recv_channel_prefix_matrix(prefix, src_idx, source_tokens, rank, C)
        np.testing.assert_array_equal(_np(recv), want[2])
        # num_worst_tokens: rows past the received ones (-1 here) change nothing
        padded = _as(backend, np.concatenate([want[3], np.full(5, -1, np.int32)]))
        np.testing.assert_array_equal(
            _np(handles.recv_channel_prefix_matrix(prefix, padded, source_tokens, rank, C)),
            want[2])
        assert str(recv.dtype).endswith("int32") and tuple(recv.shape) == (R, C)
        head = handles.send_head(in_rank, chan)
        np.testing.assert_array_equal(_np(head), want[5])
        assert str(head.dtype).endswith("int32") and tuple(head.shape) == (sizes[rank], R)


def test_reference_handle_meanings_on_a_small_case():
    # Two ranks, two channels; rank 0 has 4 tokens (channels {0,1}, {2,3}),
    # rank 1 has 3 tokens (channels {0,1}, {2}).
    m0 = np.array([[1, 0], [1, 1], [0, 1], [1, 1]], dtype=bool)
    m1 = np.array([[0, 1], [1, 0], [1, 1]], dtype=bool)
    prefix, chan, recv_chan, src_idx, in_rank, head = ref.deepep_intranode_handle([m0, m1], 1, 2)
    # to rank 0: 3 from rank 0, then 2 from rank 1; to rank 1: 3 from rank 0, then 2 from rank 1
    np.testing.assert_array_equal(prefix, [[3, 3], [5, 5]])
    # rank 1 sends to rank 0 tokens 1 (channel 0) and 2 (channel 1); to itself 0, 2
    np.testing.assert_array_equal(chan, [[1, 2], [1, 2]])
    # rows rank 1 receives: from rank 0 tokens 1, 2, 3 (channel 0 holds 1 of them),
    # from itself tokens 0, 2 (channel 0 holds 1)
    np.testing.assert_array_equal(recv_chan, [[0, 1], [0, 1]])
    np.testing.assert_array_equal(src_idx, [1, 2, 3, 0, 2])
    np.testing.assert_array_equal(in_rank, m1)
    np.testing.assert_array_equal(head, [[-1, 0], [0, -1], [0, 0]])


def test_non_handles_are_refused_by_name():
    with pytest.raises(TypeError, match=r"combine: handle: expected the handle returned by "
                                        r"dispatch, got a plain tuple"):
        handles.core_dispatch_handle("combine", (1, 2, 3))
    with pytest.raises(TypeError, match=r"dispatch: handle: .* got int"):
        handles.core_dispatch_handle("dispatch", 3)


def test_reference_tokens_per_node():
    rng = np.random.default_rng(7)
    R, rpn, E, K, T = 8, 2, 32, 6, 50
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int64)
    idx[rng.random(idx.shape) < 0.3] = -1
    got = ref.tokens_per_node(idx, E, R, rpn)
    node_of = np.where(idx >= 0, idx // (E // R) // rpn, -1)
    want = [int(sum((row == n).any() for row in node_of)) for n in range(R // rpn)]
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int32


def test_dispatch_handle_tuple_behaviour_without_a_gpu():
    """The tuple makes each element once, on first read (index, negative index,
    slice or unpacking), and is equal only to itself. A tensor-less core handle
    and numpy stand-ins for its tensors: the values on a GPU are test_gpu.py's."""

    tensors = {
        "rank_prefix_matrix": np.array([[2, 1], [3, 4]], dtype=np.int32),
        "recv_src_idx": np.array([0, 1, 0, 2], dtype=np.int32),
        "is_token_in_rank": np.array([[1, 0], [1, 1], [0, 1]], dtype=bool),
        "source_num_tokens": np.array([3, 3], dtype=np.int32),
    }
    reads = []

    class Fake(handles.DispatchHandle):
        def _tensor(self, name):
            reads.append(name)
            return tensors[name]

    core = _testing().dispatch_handle(2, 3, 4, 128)
    h = Fake(core, 1, 2, lambda t: t)
    assert reads == [] and len(h) == 6 and isinstance(h, tuple)
    want = ref.deepep_intranode_handle(
        [np.array([[1, 1], [1, 0], [0, 1]], dtype=bool), tensors["is_token_in_rank"]], 1, 2)
    # elements 1 and 5 depend on this rank's is_token_in_rank alone
    np.testing.assert_array_equal(h[1], want[1])
    np.testing.assert_array_equal(h[-1], want[5])
    np.testing.assert_array_equal(h[0], tensors["rank_prefix_matrix"])
    a, b, c, d, e, f = h
    assert a is h[0] and d is tensors["recv_src_idx"] and e is tensors["is_token_in_rank"]
    assert [x is y for x, y in zip(h[1:3], (b, c))] == [True, True]
    assert sorted(set(reads)) == sorted(tensors) and len(reads) == len(set(reads))
    assert h == h and h != Fake(core, 1, 2, lambda t: t) and hash(h) == hash(h)
    with pytest.raises(IndexError):
        h[6]
    with pytest.raises(TypeError, match="cannot be pickled"):
        import pickle
        pickle.dumps(h)
    assert h.num_ranks == 2 and h.num_recv_tokens == 4  # the core's attributes
    # a channel count given as a lookup is asked for when a channel element is read
    asked = []
    lazy = Fake(core, 1, lambda: asked.append(1) or 2, lambda t: t)
    lazy[0], lazy[3], lazy[4]
    assert asked == []
    np.testing.assert_array_equal(lazy[1], want[1])
    assert asked == [1]
    with pytest.raises(ValueError, match="num_channels: must be >= 1, got 0"):
        Fake(core, 1, 0, lambda t: t)
    with pytest.raises(ValueError, match="num_channels: must be >= 1, got 0"):
        Fake(core, 1, lambda: 0, lambda t: t)[1]


# ---- the internode handle (docs/internode_ht.md): the reference's statement of DeepEP's
# definitions, checked against the dispatch reference's rows and the layout's counts ----------

def _routing(rng, T, K, E, p_none=0.2):
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]) if T else \
        np.zeros((0, K), np.int64)
    idx = idx.astype(np.int64)
    idx[rng.random(idx.shape) < p_none] = -1
    return idx


@pytest.mark.parametrize("R,L,C,sizes", [
    (4, 2, 3, [37, 0, 64, 5]),
    (8, 4, 5, [20, 3, 1, 40, 17, 9, 0, 33]),
    (8, 2, 16, [12, 7, 3, 30, 2, 9, 5, 11]),  # more channels than some ranks have tokens
    (6, 3, 4, [10, 11, 12, 0, 2, 30]),
    (4, 4, 2, [5, 6, 7, 8]),  # one node
])
def test_internode_handle_reference(R, L, C, sizes):
    rng = np.random.default_rng(R * 1000 + L * 10 + C)
    E, K, H = 4 * R, 4, 128
    N = R // L
    idxs = [_routing(rng, T, K, E) for T in sizes]
    masks = [ref.dispatch_layout(i, E, R)[2] for i in idxs]
    disp = ref.ht_dispatch([np.zeros((T, H), np.uint16) for T in sizes], idxs, E)
    per_node = [ref.tokens_per_node(i, E, R, L) for i in idxs]
    per_rank = [ref.dispatch_layout(i, E, R)[0] for i in idxs]
    for rank in range(R):
        m, l = rank // L, rank % L
        (in_rank, rdma, gbl, recv_rdma, recv_rdma_sum, recv_gbl, recv_gbl_sum, meta,
         rdma_head, nvl_head) = ref.deepep_internode_handle(masks, rank, C, L)
        T = sizes[rank]
        np.testing.assert_array_equal(in_rank, masks[rank])
        # what this rank sends: per node and per rank, the last channel's prefix is the total
        assert rdma.shape == (N, C) and rdma.dtype == np.int32
        np.testing.assert_array_equal(rdma[:, -1], per_node[rank])
        np.testing.assert_array_equal(gbl[:, -1], per_rank[rank])
        assert (np.diff(rdma, axis=1) >= 0).all() and (np.diff(gbl, axis=1) >= 0).all()
        # what the forwarder receives: from each node's rank of this local index
        np.testing.assert_array_equal(recv_rdma[:, -1], [per_node[s * L + l][m] for s in range(N)])
        np.testing.assert_array_equal(recv_rdma_sum, np.cumsum(recv_rdma[:, -1]))
        # the rows this rank receives (the dispatch reference's order)
        d = disp[rank]
        n_recv = len(d["recv_src_idx"])
        np.testing.assert_array_equal(recv_gbl_sum, d["rank_prefix_matrix"][:, rank])
        assert recv_gbl_sum[-1] == n_recv
        starts = recv_gbl.reshape(-1)
        ends = np.append(starts[1:], n_recv)
        for row, (s, t) in enumerate(zip(d["recv_src_rank"], d["recv_src_idx"])):
            c = t // -(-sizes[s] // C)
            assert starts[s * C + c] <= row < ends[s * C + c], (rank, row, s, t)
            # rows of one (source, channel) are contiguous, in token order
            before = int(masks[s][c * -(-sizes[s] // C):t, rank].sum())
            assert row == starts[s * C + c] + before
        assert meta.shape == (n_recv, 8) and meta.dtype == np.uint8
        words = meta.view("<i4").reshape(n_recv, 2)
        for row, (s, t) in enumerate(zip(d["recv_src_rank"], d["recv_src_idx"])):
            assert words[row, 0] == s // L
            want_bits = sum(1 << p for p in range(L) if masks[s][t, m * L + p])
            assert words[row, 1] == want_bits
            assert (words[row, 1] >> l) & 1  # the row came here
        # heads: per (channel, node) the tokens that go there are numbered 0, 1, ... in order
        q = -(-T // C) if T else 1
        for n in range(N):
            goes = masks[rank][:, n * L:(n + 1) * L].any(axis=1)
            np.testing.assert_array_equal(rdma_head[~goes, n], -1)
            for c in range(C):
                sel = goes & (np.arange(T) // q == c)
                np.testing.assert_array_equal(rdma_head[sel, n], np.arange(sel.sum()))
        assert nvl_head.shape == (recv_rdma_sum[-1], L)
        row = 0
        for s in range(N):
            for c in range(C):
                k = recv_rdma[s, c] - (recv_rdma[s, c - 1] if c else 0)
                block = nvl_head[row:row + k]
                for p in range(L):
                    got = block[:, p]
                    np.testing.assert_array_equal(got[got >= 0], np.arange((got >= 0).sum()))
                row += k
        for p in range(L):  # what the forwarder passes to local rank p: all of it, once
            want = sum(int(masks[s * L + l][:, m * L + p].sum()) for s in range(N))
            assert int((nvl_head[:, p] >= 0).sum()) == want


def test_internode_handle_on_a_small_case():
    # 4 ranks as 2 nodes of 2, one channel. Rank 1 = (node 0, local 1); its network
    # peer is rank 3 = (node 1, local 1).
    m0 = np.array([[0, 1, 0, 0]], dtype=bool)           # rank 0: to rank 1
    m1 = np.array([[1, 0, 0, 1], [0, 0, 0, 0], [0, 1, 1, 0]], dtype=bool)
    m2 = np.array([[0, 1, 0, 0], [1, 1, 0, 0]], dtype=bool)
    m3 = np.array([[1, 1, 1, 0], [0, 0, 1, 1]], dtype=bool)
    h = ref.deepep_internode_handle([m0, m1, m2, m3], 1, 1, 2)
    np.testing.assert_array_equal(h[1], [[2], [2]])        # rank 1 sends 2 tokens to each node
    np.testing.assert_array_equal(h[2], [[1], [1], [1], [1]])
    # forwarder (0, 1) receives from rank 1 (its own node): tokens 0, 2; from rank 3: token 0
    np.testing.assert_array_equal(h[3], [[2], [1]])
    np.testing.assert_array_equal(h[4], [2, 3])
    # rows of rank 1: rank 0 token 0, rank 1 token 2, rank 2 tokens 0 and 1, rank 3 token 0
    np.testing.assert_array_equal(h[6], [1, 2, 4, 5])
    np.testing.assert_array_equal(h[5], [[0], [1], [2], [4]])
    words = h[7].view("<i4").reshape(-1, 2)
    np.testing.assert_array_equal(words[:, 0], [0, 0, 1, 1, 1])
    np.testing.assert_array_equal(words[:, 1], [0b10, 0b10, 0b10, 0b11, 0b11])
    np.testing.assert_array_equal(h[8], [[0, 0], [-1, -1], [1, 1]])
    # forwarded rows: rank 1's tokens 0 (to rank 0) and 2 (to rank 1), then rank 3's
    # token 0 (to both): counted per source node, so it is the first of its stream
    np.testing.assert_array_equal(h[9], [[0, -1], [-1, 0], [0, 0]])
    with pytest.raises(ValueError, match="ranks_per_node"):
        ref.deepep_internode_handle([m0, m1, m2, m3], 1, 1, 3)


# Routings for the internode handle's elements: (R, L, C, tokens per rank, p)
INTERNODE_CASES = [
    (4, 2, 3, [37, 0, 64, 5], 0.3),
    (8, 4, 12, [200, 3, 129, 77, 1, 0, 50, 96], 0.2),
    (6, 3, 16, [5, 9, 2, 0, 4, 7], 0.5),  # fewer tokens than channels
    (4, 2, 5, [40, 41, 42, 43], 0.0),  # nothing sent
    (8, 2, 4, [30, 31, 32, 33, 34, 35, 36, 37], 1.0),  # everything everywhere
    (3, 1, 2, [9, 0, 4], 0.6),  # nodes of one rank
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("R,L,C,sizes,p", INTERNODE_CASES)
def test_internode_derivable_elements_match_the_reference(R, L, C, sizes, p, backend):
    rng = np.random.default_rng(R * 7 + L * 3 + C)
    masks = _masks(rng, R, sizes, p)
    source_tokens = _as(backend, np.asarray(sizes, dtype=np.int32))
    for rank in range(R):
        want = ref.deepep_internode_handle(masks, rank, C, L)
        in_rank = _as(backend, masks[rank])
        rdma = handles.rdma_channel_prefix_matrix(in_rank, C, L)
        np.testing.assert_array_equal(_np(rdma), want[1])
        assert str(rdma.dtype).endswith("int32") and tuple(rdma.shape) == (R // L, C)
        np.testing.assert_array_equal(_np(handles.channel_prefix_matrix(in_rank, C)), want[2])
        head = handles.send_rdma_head(in_rank, rdma, L)
        np.testing.assert_array_equal(_np(head), want[8])
        assert str(head.dtype).endswith("int32") and tuple(head.shape) == (sizes[rank], R // L)
        src_idx = np.asarray([t for s in range(R) for t in range(sizes[s]) if masks[s][t, rank]],
                             dtype=np.int32)
        recv = handles.recv_gbl_channel_prefix_matrix(_as(backend, want[6]),
                                                      _as(backend, src_idx), source_tokens, C)
        np.testing.assert_array_equal(_np(recv), want[5])
        assert str(recv.dtype).endswith("int32") and tuple(recv.shape) == (R, C)


def _forwarder_state(masks, rank, L, pad):
    """What the internode kernels record on ``rank`` (a statement of their records
    independent of epx.handles): per source node s, the tokens of rank (s, l) that
    reach this node, in token order, as fwd_token / fwd_mask [N, rows] (rows past a
    node's count hold ``pad``), their counts, and per received row [source rank,
    record index, mask of this node's ranks] in the dispatch's row order."""
    R = len(masks)
    N, m, l = R // L, rank // L, rank % L
    rows = [[t for t in range(masks[s * L + l].shape[0])
             if masks[s * L + l][t, m * L:(m + 1) * L].any()] for s in range(N)]
    width = max([len(r) for r in rows] + [1])
    token = np.full((N, width), pad, dtype=np.int32)
    mask = np.full((N, width), pad, dtype=np.int32)
    for s, toks in enumerate(rows):
        for j, t in enumerate(toks):
            token[s, j] = t
            mask[s, j] = sum(1 << p for p in range(L) if masks[s * L + l][t, m * L + p])
    meta = []
    for src in range(R):
        sent = [t for t in range(masks[src].shape[0])
                if masks[src][t, m * L:(m + 1) * L].any()]
        for j, t in enumerate(sent):
            if masks[src][t, rank]:
                meta.append([src, j, sum(1 << p for p in range(L) if masks[src][t, m * L + p])])
    meta = np.asarray(meta, dtype=np.int32).reshape(-1, 3)
    return token, mask, [len(r) for r in rows], meta


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("R,L,C,sizes,p", INTERNODE_CASES)
def test_internode_recorded_elements_match_the_reference(R, L, C, sizes, p, backend):
    """Elements 3, 4, 7 and 9 from what the kernels record (modelled here from the
    routing) against the reference's definitions."""
    rng = np.random.default_rng(R * 11 + L * 5 + C)
    masks = _masks(rng, R, sizes, p)
    N = R // L
    for rank in range(R):
        want = ref.deepep_internode_handle(masks, rank, C, L)
        token, mask, fwd_rows, meta = _forwarder_state(masks, rank, L, pad=-7)
        src_tokens = _as(backend, np.asarray(sizes[rank % L::L], dtype=np.int32))
        got3 = handles.recv_rdma_channel_prefix_matrix(_as(backend, token), fwd_rows,
                                                       src_tokens, C)
        np.testing.assert_array_equal(_np(got3), want[3])
        assert str(got3.dtype).endswith("int32") and tuple(got3.shape) == (N, C)
        got4 = handles.recv_rdma_rank_prefix_sum(fwd_rows, _as(backend, token))
        np.testing.assert_array_equal(_np(got4), want[4])
        assert str(got4.dtype).endswith("int32")
        got7 = handles.recv_src_meta(_as(backend, meta), L)
        np.testing.assert_array_equal(_np(got7), want[7])
        assert str(got7.dtype).endswith("uint8") and tuple(got7.shape) == want[7].shape
        got9 = handles.send_nvl_head(_as(backend, mask), _as(backend, token), fwd_rows,
                                     src_tokens, C, L)
        np.testing.assert_array_equal(_np(got9), want[9])
        assert str(got9.dtype).endswith("int32") and tuple(got9.shape) == want[9].shape


def test_internode_handle_refuses_a_handle_within_one_node_and_is_taken_back():
    """InternodeDispatchHandle wraps only a dispatch across nodes (ranks_per_node > 0);
    dispatch and combine take either handle tuple back (their .core), and refuse a
    tuple rebuilt from the elements by name."""

    core = _testing().dispatch_handle(4, 8, 5, 128)  # within one node
    assert core.ranks_per_node == 0 and core.net_worst == 0
    with pytest.raises(ValueError, match="across nodes"):
        handles.InternodeDispatchHandle(core, 0, 4, lambda t: t)
    intra = handles.DispatchHandle(core, 0, 4, lambda t: t)
    assert handles.core_dispatch_handle("combine", intra) is core
    with pytest.raises(TypeError, match="combine: handle: .*rebuilt"):
        handles.core_dispatch_handle("combine", tuple(range(10)))

"""The intranode handle's channel elements (epx.handles) against the reference's
plain-loop statement of DeepEP's definitions: on numpy arrays always, and on
torch CPU tensors (what handles hold) where torch is installed."""

import importlib.util

import numpy as np
import pytest

from epx import handles
from epx import reference as ref

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
    from epx import _core

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

    core = _core.DispatchHandle._for_validation(2, 3, 4, 128)
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

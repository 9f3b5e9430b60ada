"""Checks epx.bench's torch baseline (TorchAllToAll) against EPX's reference model, inside
one rank of a torch.distributed group: gloo on the CPU (test_cpu.py) or NCCL on GPUs
(test_gpu.py). The baseline must move exactly the data EPX's ops move, or the EPX/torch
ratios of the benchmark would compare different work."""

import numpy as np

from epx import reference as ref


def _bits(t):
    """bf16 tensor -> uint16 numpy bits (on the host)."""
    import torch

    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def _gather(group, obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group)
    return out


def check(rank, world, group, device):
    import torch

    from epx.bench import TorchAllToAll, quantize_fp8

    device = torch.device(device)
    rng = np.random.default_rng(50 + rank)
    H, K, E = 256, 4, 4 * world
    El = E // world
    T = 30 + 7 * rank
    idx_np = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int64)
    idx_np[rng.random(idx_np.shape) < 0.15] = -1
    x_np = ref.bf16_from_float(rng.standard_normal((T, H)).astype(np.float32))
    w_np = rng.random((T, K)).astype(np.float32)
    all_idx, all_x, all_w = (list(a) for a in zip(*_gather(group, (idx_np, x_np, w_np))))
    x = torch.from_numpy(x_np.view(np.int16)).view(torch.bfloat16).to(device)
    idx, w = torch.from_numpy(idx_np).to(device), torch.from_numpy(w_np).to(device)

    # ---- high-throughput semantics: one row per (token, destination rank)
    want = ref.ht_dispatch(all_x, all_idx, E, topk_weights=all_w)[rank]
    tb = TorchAllToAll(group, E, per_rank=True)
    route = tb.route(idx)
    recv, recv_idx, recv_w = tb.dispatch(x, route, idx, w)
    N = want["recv_x"].shape[0]
    assert N > 0 and sum(route.recv_splits) == N and tuple(recv.shape) == (N, H)
    # the baseline orders rows by source rank, then source token
    order = np.lexsort((want["recv_src_idx"], want["recv_src_rank"]))
    np.testing.assert_array_equal(_bits(recv), want["recv_x"][order])
    np.testing.assert_array_equal(recv_idx.cpu().numpy(), want["recv_topk_idx"][order])
    np.testing.assert_array_equal(recv_w.cpu().numpy(), want["recv_topk_weights"][order])
    counts = [int((recv_idx == e).sum()) for e in range(El)]
    assert counts == want["num_recv_tokens_per_expert"]

    # reused route without metadata (as the benchmark times the cached dispatch)
    again, none_idx, none_w = tb.dispatch(x, route)
    assert none_idx is None and none_w is None and torch.equal(again, recv)

    # FP8 rows and their scales
    q, s = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and tuple(s.shape) == (T, H // 128)
    (rq, rs), _, _ = tb.dispatch((q, s), route, idx, w)
    assert rq.dtype == torch.float8_e4m3fn and rs.dtype == torch.float32
    every_q = _gather(group, (q.view(torch.uint8).cpu().numpy(), s.cpu().numpy()))
    src_rank, src_idx = want["recv_src_rank"][order], want["recv_src_idx"][order]
    np.testing.assert_array_equal(rq.view(torch.uint8).cpu().numpy(),
                                  np.stack([every_q[r][0][t] for r, t in zip(src_rank, src_idx)]))
    np.testing.assert_array_equal(rs.cpu().numpy(),
                                  np.stack([every_q[r][1][t] for r, t in zip(src_rank, src_idx)]))

    # combine (identity experts on random rows): the unweighted sum per token
    y_bits = ref.bf16_from_float(rng.standard_normal((N, H)).astype(np.float32))
    ref_y = []
    for yb, o in _gather(group, (y_bits, order)):
        unsorted = np.empty_like(yb)  # the reference takes rows in its own order
        unsorted[o] = yb
        ref_y.append(unsorted)
    want_c = ref.ht_combine(all_idx, ref_y, E)[rank][0]
    got_c = tb.combine(torch.from_numpy(y_bits.view(np.int16)).view(torch.bfloat16).to(device),
                       route)
    assert got_c.dtype == torch.bfloat16 and tuple(got_c.shape) == (T, H)
    np.testing.assert_allclose(ref.bf16_to_float(_bits(got_c)), ref.bf16_to_float(want_c),
                               rtol=1e-2, atol=1e-2)
    assert np.abs(ref.bf16_to_float(want_c)).max() > 0.5
    try:
        tb.combine(recv, route, w)
    except ValueError as e:
        assert "unweighted" in str(e)
    else:
        raise AssertionError("per-rank combine must refuse topk_weights")

    # ---- low-latency semantics: one row per valid selection, weighted combine
    tl = TorchAllToAll(group, E, per_rank=False)
    rl = tl.route(idx)
    assert sum(rl.send_splits) == int((idx_np >= 0).sum())
    rows_l, expert_l, no_w = tl.dispatch(x, rl, idx)
    assert no_w is None and rows_l.shape[0] == sum(rl.recv_splits)
    want_l = ref.ll_dispatch(all_x, all_idx, E, max(a.shape[0] for a in all_x))[rank]
    for e in range(El):  # the same rows per local expert (the order within may differ)
        mine = np.sort(_bits(rows_l[expert_l == e]).view(np.int16), axis=0)
        theirs = np.sort(want_l["recv_x"][e, :want_l["recv_count"][e]].view(np.int16), axis=0)
        np.testing.assert_array_equal(mine, theirs)
    (ql, sl), expert_q, _ = tl.dispatch(quantize_fp8(x), rl, idx)
    assert torch.equal(expert_q, expert_l) and ql.shape[0] == sl.shape[0] == rows_l.shape[0]
    # identity experts: sum over the valid selections of weight * x
    out = tl.combine(rows_l, rl, w)
    xf = ref.bf16_to_float(x_np).astype(np.float64)
    expect = ((idx_np >= 0) * w_np).sum(1)[:, None] * xf
    np.testing.assert_allclose(ref.bf16_to_float(_bits(out)), expect, rtol=1e-2, atol=1e-2)
    assert np.abs(expect).max() > 0.5
    try:
        tl.combine(rows_l, rl)
    except ValueError as e:
        assert "need the top-k weights" in str(e)
    else:
        raise AssertionError("per-selection combine must require topk_weights")

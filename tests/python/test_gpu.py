"""Multi-GPU tests of epx.Buffer through the DeepEP API: 2 and 4 ranks, one process
per GPU (torch.multiprocessing), results checked against the CPU reference model.
Skipped without PyTorch or with too few GPUs. Run: pytest tests/python -m gpu
"""

import os
import sys
import tempfile
import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

# NVLink multicast stays off (see docs); bounded waits so a failing rank cannot hang the test.
# CUDA modules load eagerly: with lazy loading (EPX warns of it) a cached dispatch across
# nodes over the proxy once ran into the deadline with 2 processes on 2x H100, likely a
# torch kernel loaded for the first time while EPX kernels waited (docs/limitations.md).
# In-process ranks need 32 hardware queues: with the default 8, a count exchange of 4 ranks
# as 2x2 waited until the deadline (a kernel queued behind another rank's waiting one).
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1"), ("EPX_TIMEOUT_S", "60"),
               ("CUDA_MODULE_LOADING", "EAGER"), ("CUDA_DEVICE_MAX_CONNECTIONS", "32")):
    os.environ.setdefault(_k, _v)


def _num_gpus():
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _stacks_later(case, rank):
    """EPX_TEST_STACKS_AFTER_S=N: while the case runs, every N seconds every thread's Python
    stack goes out (faulthandler), so a run cut by a timeout still says where each rank was
    and whether it moved. To EPX_TEST_STACKS_DIR/<case>-rank<r>.txt when that is set (the
    ranks' dumps do not interleave), else to stderr. Returns the function that disarms it."""
    after = float(os.environ.get("EPX_TEST_STACKS_AFTER_S", "0") or 0)
    if after <= 0:
        return lambda: None
    import faulthandler

    out, close = sys.__stderr__, (lambda: None)
    where = os.environ.get("EPX_TEST_STACKS_DIR")
    if where:
        os.makedirs(where, exist_ok=True)
        out = open(os.path.join(where, f"{case}-rank{rank}.txt"), "w")
        close = out.close
    faulthandler.dump_traceback_later(after, repeat=True, file=out)

    def disarm():
        faulthandler.cancel_dump_traceback_later()
        close()

    return disarm


def _rendezvous():
    """A file:// init method in a fresh directory: no TCP port to collide with."""
    return "file://" + os.path.join(tempfile.mkdtemp(prefix="epx-rdv-"), "store")


def _worker(rank, world, init, case):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    disarm = _stacks_later(case, rank)
    try:
        globals()[case](rank, world, dist.group.WORLD)
        torch.cuda.synchronize()
        dist.barrier()
    except BaseException:
        _report_and_linger(init, rank, world)
        raise
    finally:
        disarm()
        dist.destroy_process_group()


def _errors_dir(init):
    """The rendezvous directory (file:// init method): where each rank's error goes."""
    return os.path.dirname(init[len("file://"):])


def _report_and_linger(init, rank, world):
    """A failing rank writes its traceback beside the rendezvous, then waits (at most
    EPX_TEST_ERROR_GRACE_S, 10 s unless set) for every other rank's: torch.multiprocessing
    ends the others at the first failure, and a peer's own diagnostic (its side of a lost
    op, reached at its own deadline) is often what names the cause."""
    import traceback

    where = _errors_dir(init)
    with open(os.path.join(where, f"error-rank{rank}.txt"), "w") as f:
        f.write(traceback.format_exc())
    deadline = time.monotonic() + float(os.environ.get("EPX_TEST_ERROR_GRACE_S", "10"))
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(where, f"error-rank{r}.txt")) for r in range(world)):
            break
        time.sleep(0.2)


def _other_ranks_errors(init, world, first):
    """The tracebacks the other ranks wrote (_report_and_linger), as text."""
    out = []
    for r in range(world):
        path = os.path.join(_errors_dir(init), f"error-rank{r}.txt")
        if r != first and os.path.exists(path):
            with open(path) as f:
                out.append(f"-- rank {r} failed too:\n{f.read()}")
    return "\n".join(out)


def _spawn(case, world):
    if _num_gpus() < world:
        pytest.skip(f"needs {world} GPUs and PyTorch")
    import torch.multiprocessing as mp

    init = _rendezvous()
    try:
        mp.spawn(_worker, args=(world, init, case), nprocs=world, join=True)
    except Exception as e:  # a rank raised: its traceback is in the message
        if "EPXUnsupportedError" in str(e) and "not implemented" in str(e):
            pytest.skip(f"not implemented in this build: {str(e).splitlines()[-1]}")
        others = _other_ranks_errors(init, world, getattr(e, "error_index", -1))
        if others:
            raise AssertionError(f"{e}\n{others}") from e
        raise


def _in_process(case, world):
    """The case with `world` ranks as threads of this process on one GPU."""
    if _num_gpus() < 1:
        pytest.skip("needs a GPU and PyTorch")
    import epx

    disarm = _stacks_later(case, "all")
    try:
        epx.run_in_process(world, lambda comm: globals()[case](comm.Get_rank(), world, comm),
                           timeout_s=120.0)
    finally:
        disarm()


# "processes": one process per GPU; "in_process": the ranks as threads on one GPU.
_RANKS = {"processes": _spawn, "in_process": _in_process}


# The cases that run both ways: _case_<name>(rank, world, group).
_CASES = ["high_throughput", "low_latency", "low_latency_shrink", "low_latency_cuda_graph"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("ranks", list(_RANKS))
@pytest.mark.parametrize("case", _CASES)
def test_case(case, world, ranks):
    _RANKS[ranks](f"_case_{case}", world)


@pytest.mark.parametrize("case", _CASES + ["high_throughput_across_nodes", "moe_layer_example"])
def test_eight_processes(case):
    """Each case as 8 processes on an 8-GPU host (the across-nodes one as 2 nodes of 4);
    skipped with fewer GPUs."""
    _spawn(f"_case_{case}", 8)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("ranks", list(_RANKS))
def test_high_throughput_across_nodes(world, ranks):
    """The high-throughput ops across virtual nodes (2 nodes of world // 2 ranks)."""
    _RANKS[ranks]("_case_high_throughput_across_nodes", world)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("ranks", list(_RANKS))
@pytest.mark.parametrize("case", ["low_latency", "low_latency_cuda_graph"])
def test_low_latency_across_nodes(case, world, ranks, monkeypatch):
    """The low-latency cases on ranks split into 2 virtual nodes (EPX_RANKS_PER_NODE,
    which the spawned ranks inherit): peers in the other node over the backend's
    network path (EPX_BACKEND: proxy, nccl or nvshmem), as DeepEP's internode
    low-latency kernels reach them over RDMA."""
    monkeypatch.setenv("EPX_RANKS_PER_NODE", str(max(1, world // 2)))
    _RANKS[ranks](f"_case_{case}", world)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("ranks", list(_RANKS))
@pytest.mark.parametrize("nodes", [1, 2])
def test_elastic_v2(world, ranks, nodes, monkeypatch):
    """DeepEP V2's deep_ep.ElasticBuffer: non-expanded dispatch (with and without CPU
    sync, aligned, FP8 with TMA-aligned scales, asynchronous) and combine against
    EPX's reference, within one node and across 2 virtual nodes (EPX_RANKS_PER_NODE)."""
    if nodes > 1:
        monkeypatch.setenv("EPX_RANKS_PER_NODE", str(world // nodes))
    _RANKS[ranks]("_case_elastic_v2", world)


@pytest.mark.parametrize("world", [2, 4])
def test_moe_layer_example(world):
    """examples/moe_layer.py (deep_ep code, only the import changed) against a dense
    single-process computation of the same layer."""
    _spawn("_case_moe_layer_example", world)


@pytest.mark.parametrize("world", [2, 4])
def test_torch_baseline(world):
    """epx.bench's torch.distributed baseline moves what EPX moves (NCCL, on the GPUs)."""
    _spawn("_case_torch_baseline", world)


@pytest.mark.parametrize("world", [2, 4])
def test_bench(world, tmp_path):
    """python -m epx.bench end to end on a small workload: every figure present, bytes
    counted as DESIGN.md says, the sweep and the torch comparison recorded."""
    if _num_gpus() < world:
        pytest.skip(f"needs {world} GPUs and PyTorch")
    import json

    from epx import bench

    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    H, K, E = 1024, 4, 32
    argv = ["--ranks", str(world), "--tokens", "256", "--ll-tokens", "32", "--hidden", str(H),
            "--topk", str(K), "--experts", str(E), "--warmup", "2", "--iters", "5",
            "--compare-torch", "--sweep-tokens", "64,256", "--sweep-ll-tokens", "8,32",
            "--json", str(out)]
    import importlib.util

    if importlib.util.find_spec("matplotlib") is not None:
        argv += ["--plot", str(png)]
    else:
        png = None
    assert bench.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["num_ranks"] == world and res["iters"] == 5
    ht, ll = res["ht"], res["ll"]
    for fam, ops, torch_ops in (("ht", bench.HT_OPS, ("dispatch_bf16", "dispatch_fp8", "combine",
                                                       "dispatch_bf16_full")),
                                ("ll", bench.LL_OPS, ("dispatch_fp8", "dispatch_bf16",
                                                      "combine"))):
        r = res[fam]
        for key, _, kind in ops:
            s = r["ops"][key]
            assert 0 < s["us"]["min"] <= s["us"]["mean"] <= s["us"]["max"] < 1e6, (fam, key, s)
            assert (s["gbps"] is None) == (kind is None), (fam, key)
        for key in torch_ops:
            assert r["torch"][key]["us"]["mean"] > 0 and r["epx_over_torch"][key] > 0
        assert [p["tokens"] for p in res["sweep"][fam]] == ([64, 256] if fam == "ht" else [8, 32])
    # bytes as DESIGN.md counts them: HT from the rows received, LL per selection
    n = ht["num_recv_tokens"]
    assert n["min"] > 0
    assert ht["ops"]["dispatch_bf16"]["bytes"]["min"] == bench.ht_bytes(int(n["min"]), H)
    assert ht["ops"]["dispatch_fp8"]["bytes"]["max"] == bench.ht_bytes(int(n["max"]), H, True)
    assert ht["torch"]["dispatch_bf16"]["bytes"] == ht["ops"]["dispatch_bf16"]["bytes"]
    assert ll["num_selections"]["min"] == 32 * K  # every pick of the random routing is valid
    assert ll["ops"]["dispatch_fp8"]["bytes"]["mean"] == bench.ll_bytes(32 * K, H, True)
    assert ll["ops"]["combine"]["bytes"]["mean"] == bench.ll_bytes(32 * K, H)
    for key in ("dispatch_bf16_gbps", "dispatch_fp8_gbps", "combine_gbps"):
        assert ht[key] > 0
    for key in ("dispatch_us", "combine_us", "dispatch_send_us", "dispatch_recv_us",
                "combine_send_us", "combine_recv_us"):
        assert ll[key] > 0
    if png is not None:
        assert png.read_bytes()[:4] == b"\x89PNG"


# ---- helpers running inside the ranks ------------------------------------------------------------

def _bits(t):
    """bf16 / fp8 tensor -> its bits as numpy (uint16 / uint8)."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)
    return t.contiguous().view(torch.uint8).cpu().numpy()


def _bf16(bits, device):
    import torch

    t = torch.from_numpy(np.ascontiguousarray(bits).view(np.int16))
    return t.view(torch.bfloat16).to(device)


def _fp8(bits, device):
    import torch

    return torch.from_numpy(np.ascontiguousarray(bits)).to(device).view(torch.float8_e4m3fn)


def _gather(group, obj):
    import epx

    if isinstance(group, epx.InProcessComm):
        return group.allgather(obj)
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group)
    return out


def _device(rank, group):
    """The rank's GPU: GPU `rank` with a process per GPU, the shared one in-process."""
    import torch

    import epx

    if isinstance(group, epx.InProcessComm):
        return torch.device("cuda", group.device)
    return torch.device("cuda", rank)


def _buffer(group, *args, **kwargs):
    """epx.Buffer over a process group, or over an in-process rank (comm=). Across
    (virtual) nodes with a process per rank the buffer must be on the backend that
    EPX_BACKEND names ("proxy" when unset): a run meant for nccl or nvshmem that
    resolved to another transport would pass without testing it."""
    import epx

    if isinstance(group, epx.InProcessComm):
        return epx.Buffer(None, *args, comm=group, **kwargs)
    buf = epx.Buffer(group, *args, **kwargs)
    if buf.get_num_rdma_ranks() > 1:
        want = os.environ.get("EPX_BACKEND", "auto")
        assert buf.backend == ("proxy" if want == "auto" else want), (buf.backend, want)
    return buf


def _diagnosed(buf):
    """A failed comparison asks the buffer first: a wait that failed leaves its output
    unwritten, and the buffer's diagnostic names the op, the peer and the word."""
    import contextlib

    @contextlib.contextmanager
    def guard():
        try:
            yield
        except AssertionError:
            import torch

            torch.cuda.synchronize()
            buf.check()
            raise

    return guard()


class _SyncAfterOps:
    """The buffer, with a device-wide wait after each low-latency op (and hook): with
    EPX_TEST_SYNC_AFTER_OPS=1 the LL case runs its ops one at a time, so that a failure
    that needs host work (a copy, a launch) while an op still waits for its peers shows
    by passing then."""

    _OPS = ("low_latency_dispatch", "low_latency_combine")

    def __init__(self, buf):
        self._buf = buf

    def __getattr__(self, name):
        import torch

        attr = getattr(self._buf, name)
        if name not in self._OPS:
            return attr

        def call(*args, **kwargs):
            out = list(attr(*args, **kwargs))
            torch.cuda.synchronize()
            if callable(out[-1]):  # the hook: its receive too
                hook = out[-1]

                def hook_then_wait():
                    hook()
                    torch.cuda.synchronize()

                out[-1] = hook_then_wait
            return tuple(out)

        return call


def _routing(rng, T, K, E, drop=0.1):
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int64)
    idx[rng.random(idx.shape) < drop] = -1
    return idx


def _check_raises(exc, pattern, fn):
    import re

    try:
        fn()
    except exc as e:
        assert re.search(pattern, str(e)), f"{exc.__name__} message {str(e)!r} !~ {pattern!r}"
        return
    raise AssertionError(f"expected {exc.__name__} matching {pattern!r}")


# ---- high-throughput -----------------------------------------------------------------------------

def _ht_inputs(rank, group, dev, rng, T, H, K, E):
    """This rank's routing and rows (host copies too), rows and weights on `dev`,
    every rank's routing and rows gathered, and the reference dispatch of all ranks."""
    import torch

    from epx import reference as ref

    idx_np = _routing(rng, T, K, E)
    x_np = ref.bf16_from_float(rng.standard_normal((T, H)).astype(np.float32))
    w_np = rng.random((T, K)).astype(np.float32)
    idx = torch.from_numpy(idx_np).to(dev)
    x = _bf16(x_np, dev)
    w = torch.from_numpy(w_np).to(dev)
    all_idx, all_x, all_w = zip(*_gather(group, (idx_np, x_np, w_np)))
    want = ref.ht_dispatch(list(all_x), list(all_idx), E, topk_weights=list(all_w))
    return idx_np, x_np, idx, x, w, all_idx, all_x, want


def _fp8_ht_inputs(rank, group, dev, x_np, all_idx, E):
    """This rank's rows x_np quantized to FP8 with per-128-channel float32 scales: the
    (rows, scales) pair on `dev`, and this rank's reference dispatch of every rank's pair."""
    import torch

    from epx import reference as ref

    q_np, s_np = ref.quantize_fp8(ref.bf16_to_float(x_np))
    all_q = _gather(group, (q_np, s_np))
    want8 = ref.ht_dispatch([tuple(a) for a in all_q], list(all_idx), E)[rank]
    return (_fp8(q_np, dev), torch.from_numpy(s_np).to(dev)), want8


def _check_dispatch(mine, recv_x, recv_idx, recv_w, counts):
    """A dispatch's outputs against this rank's reference dispatch."""
    np.testing.assert_array_equal(_bits(recv_x), mine["recv_x"])
    np.testing.assert_array_equal(recv_idx.cpu().numpy(), mine["recv_topk_idx"])
    np.testing.assert_array_equal(recv_w.cpu().numpy(), mine["recv_topk_weights"])
    assert counts == mine["num_recv_tokens_per_expert"]


def _check_combine_with_biases(combine, rank, group, dev, rng, T, H, E, all_idx, want, recv_x,
                               handle, recv_w, ranks_per_node=0, check=None):
    """combine(recv_x, handle, ...) of identity experts with weights and a pair of fresh
    biases against the reference (bit for bit; weights to 1e-6); every rank's received
    rows, for the caller's further checks. check: the buffer's check, called once the
    combine finished (a failed wait raises its own error before the rows are compared)."""
    import torch

    from epx import reference as ref

    b0_np = ref.bf16_from_float(rng.standard_normal((T, H)).astype(np.float32))
    b1_np = ref.bf16_from_float(rng.standard_normal((T, H)).astype(np.float32))
    all_recv_x = [want[r]["recv_x"] for r in range(len(want))]
    all_recv_w = [want[r]["recv_topk_weights"] for r in range(len(want))]
    all_bias = _gather(group, (b0_np, b1_np))
    expect = ref.ht_combine(list(all_idx), all_recv_x, E, topk_weights=all_recv_w,
                            bias=all_bias, ranks_per_node=ranks_per_node)[rank]
    cx, cw, _ = combine(recv_x, handle, topk_weights=recv_w,
                        bias=(_bf16(b0_np, dev), _bf16(b1_np, dev)))
    if check is not None:
        torch.cuda.synchronize()
        check()
    np.testing.assert_array_equal(_bits(cx), expect[0])
    np.testing.assert_allclose(cw.cpu().numpy(), expect[1], rtol=1e-6)
    return all_recv_x


def _case_high_throughput_across_nodes(rank, world, group):
    """DeepEP's calls, unchanged, on ranks split into virtual nodes of world // 2 ranks:
    layout with per-node counts, dispatch (DeepEP's internode handle), cached dispatch,
    combine with weights and biases, against the reference (the combine bit for bit,
    nodes summed as BF16)."""
    import torch

    import epx
    from epx import reference as ref

    dev = _device(rank, group)
    rpn = max(1, world // 2)
    H, K, E = 512, 4, 8 * world
    rng = np.random.default_rng(300 + rank)
    T = 80 + 13 * rank
    _, _, idx, x, w, all_idx, _, want = _ht_inputs(rank, group, dev, rng, T, H, K, E)
    mine = want[rank]

    nvl = epx.Buffer.get_internode_nvl_size_hint(128, H, world, rpn, K)
    buf = _buffer(group, nvl, 0, explicitly_destroy=True, ranks_per_node=rpn)
    assert buf.get_num_rdma_ranks() == world // rpn
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    assert per_rdma is not None and per_rdma.shape == (world // rpn,)
    torch.cuda.synchronize()
    before = buf.network_traffic()
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
        topk_weights=w)
    _check_dispatch(mine, recv_x, recv_idx, recv_w, counts)
    torch.cuda.synchronize()
    after = buf.network_traffic()
    if buf.backend == "proxy":
        # The proxy counts what it carried: every token bound for another node
        # crosses once per node, at least its BF16 row, in at least one put.
        picks = idx.cpu().numpy()
        node_of = np.where(picks >= 0, picks // (E // world) // rpn, -1)
        me = rank // rpn
        crossings = sum(len({n for n in row if n >= 0 and n != me}) for row in node_of)
        d = {k: after[k] - before[k] for k in after}
        assert d["put_bytes"] >= crossings * H * 2, (d, crossings)
        if crossings:
            assert d["puts"] >= 1 and d["writes"] >= 1 and d["commands"] >= d["puts"], d
    else:
        assert after is None and before is None, (buf.backend, after)
    # DeepEP's internode 10-tuple, every element against the reference's definitions
    # (channels: the default config's num_sms // 2, as DeepEP)
    assert isinstance(handle, epx.InternodeDispatchHandle) and len(handle) == 10
    C = epx.Buffer.get_dispatch_config(world).num_sms // 2
    masks = [ref.dispatch_layout(i, E, world)[2] for i in all_idx]
    want_h = ref.deepep_internode_handle(masks, rank, C, rpn)
    i32, u8 = torch.int32, torch.uint8
    dtypes = (torch.bool, i32, i32, i32, i32, i32, i32, u8, i32, i32)
    for k, (got, exp) in enumerate(zip(handle, want_h)):
        assert got.device == dev and got.dtype == dtypes[k], f"handle[{k}]"
        np.testing.assert_array_equal(got.cpu().numpy(), exp, err_msg=f"handle[{k}]")
    # DeepEP's internode test reads handle[-4] as the end of each source's rows
    ends = handle[-4].cpu().numpy()
    np.testing.assert_array_equal(
        ends, np.cumsum([int((mine["recv_src_rank"] == i).sum()) for i in range(world)]))
    again = buf.dispatch(x, handle=handle)[0]
    torch.cuda.synchronize()
    buf.check()  # a failed op raises its own error here, before the rows are compared
    np.testing.assert_array_equal(_bits(again), mine["recv_x"])

    all_recv_x = _check_combine_with_biases(buf.internode_combine, rank, group, dev, rng, T, H,
                                            E, all_idx, want, recv_x, handle, recv_w,
                                            ranks_per_node=rpn, check=buf.check)
    # A plain combine on the same handle right after the weighted one (4 processes as
    # 2x2 on 4x H200 once got this one wrong on a cross-node pair: docs/benchmarks.md)
    cx, _, _ = buf.combine(recv_x, handle)
    torch.cuda.synchronize()
    buf.check()
    np.testing.assert_array_equal(
        _bits(cx), ref.ht_combine(list(all_idx), all_recv_x, E, ranks_per_node=rpn)[rank][0])

    # num_worst_tokens: no host wait (the counts are exchanged on the GPU); the outputs
    # have that many rows, the first ones as above, the tail's top-k -1; DeepEP returns
    # no per-expert counts then. The handle's elements and the combine as before.
    worst = 128 * world
    wx, widx, ww, wcounts, whandle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
        topk_weights=w, num_worst_tokens=worst)
    torch.cuda.synchronize()
    buf.check()
    n = len(mine["recv_src_idx"])
    assert wx.shape[0] == worst and wcounts == []
    np.testing.assert_array_equal(_bits(wx)[:n], mine["recv_x"])
    np.testing.assert_array_equal(widx[:n].cpu().numpy(), mine["recv_topk_idx"])
    assert (widx[n:] == -1).all()
    np.testing.assert_array_equal(ww[:n].cpu().numpy(), mine["recv_topk_weights"])
    for k in range(10):  # recv_src_meta has a row per output row: the first n compared
        got = whandle[k].cpu().numpy()
        np.testing.assert_array_equal(got[:n] if k == 7 else got, want_h[k],
                                      err_msg=f"num_worst_tokens handle[{k}]")
    cx, _, _ = buf.combine(wx, whandle)
    expect = ref.ht_combine(list(all_idx), all_recv_x, E, ranks_per_node=rpn)[rank][0]
    np.testing.assert_array_equal(_bits(cx), expect)
    torch.cuda.synchronize()
    buf.destroy()


def _case_bad_views(rank, world, group):
    """As a new user would call it: torch views whose base is not 16-byte aligned
    (x[:, 4:4 + H] of a [T, H + 8] bf16 tensor; a flat slice 2 bytes off) are refused
    by name before any kernel runs (they used to fault with a misaligned address
    and take the process down), and the buffer then serves the aligned call."""
    import torch

    import epx

    dev = _device(rank, group)
    H, K, E = 256, 4, 8 * world
    rng = np.random.default_rng(700 + rank)
    T = 32 + rank
    _, _, idx, x, w, _, _, want = _ht_inputs(rank, group, dev, rng, T, H, K, E)
    nvl = max(cfg.get_nvl_buffer_size_hint(H * 2, world)
              for cfg in (epx.Buffer.get_dispatch_config(world),
                          epx.Buffer.get_combine_config(world)))
    buf = _buffer(group, nvl, 0, explicitly_destroy=True)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    wide = torch.zeros(T, H + 8, dtype=torch.bfloat16, device=dev)
    wide[:, 4:4 + H] = x
    view = wide[:, 4:4 + H]
    assert view.data_ptr() % 16 == 8 and view.stride(0) * 2 % 16 == 0
    with pytest.raises(ValueError, match=r"dispatch: x: must start at a 16-byte aligned address"):
        buf.dispatch(view, **layout)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(x, **layout)
    _check_dispatch(want[rank], recv_x, recv_idx, recv_w, counts)
    bias = torch.zeros(T * H + 8, dtype=torch.bfloat16, device=dev)[1:1 + T * H].view(T, H)
    with pytest.raises(ValueError, match=r"combine: bias_0: must start at a 16-byte aligned"):
        buf.combine(recv_x, handle, bias=bias)
    combined, _, _ = buf.combine(recv_x, handle)
    assert combined.shape == (T, H)
    buf.destroy()

    maxT = 16
    rdma = epx.Buffer.get_low_latency_rdma_size_hint(maxT, 512, world, E)
    ll = _buffer(group, 0, rdma, low_latency_mode=True, explicitly_destroy=True)
    flat = torch.zeros(16 * 512 + 8, dtype=torch.bfloat16, device=dev)[1:1 + 16 * 512].view(16, 512)
    ll_idx = torch.zeros(16, K, dtype=torch.int64, device=dev)
    with pytest.raises(ValueError, match=r"low_latency_dispatch: x: must start at a 16-byte"):
        ll.low_latency_dispatch(flat, ll_idx, maxT, E)
    ll.destroy()


@pytest.mark.parametrize("ranks", list(_RANKS))
def test_bad_views_are_refused_by_name(ranks):
    _RANKS[ranks]("_case_bad_views", 2)


def _case_high_throughput(rank, world, group):
    import torch

    import epx
    from epx import reference as ref

    dev = _device(rank, group)
    H, K, E = 256, 4, 8 * world
    rng = np.random.default_rng(100 + rank)
    T = 64 + 17 * rank
    idx_np, x_np, idx, x, w, all_idx, all_x, want = _ht_inputs(rank, group, dev, rng, T, H, K, E)
    mine = want[rank]

    hidden_bytes = H * 2
    nvl = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, world)
              for cfg in (epx.Buffer.get_dispatch_config(world),
                          epx.Buffer.get_combine_config(world)))
    buf = _buffer(group, nvl, 0, explicitly_destroy=True)
    assert buf.rank == rank and buf.group_size == world

    # layout
    per_rank, per_rdma, per_expert, in_rank, ev = buf.get_dispatch_layout(idx, E)
    assert per_rdma is None and isinstance(ev, epx.EventOverlap)
    e_rank, e_expert, e_in = ref.dispatch_layout(idx_np, E, world)
    assert per_rank.dtype == torch.int32 and in_rank.dtype == torch.bool
    np.testing.assert_array_equal(per_rank.cpu().numpy(), e_rank)
    np.testing.assert_array_equal(per_expert.cpu().numpy(), e_expert)
    np.testing.assert_array_equal(in_rank.cpu().numpy(), e_in)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert)

    # dispatch
    recv_x, recv_idx, recv_w, counts, handle, ev = buf.dispatch(
        x, topk_idx=idx, topk_weights=w, **layout)
    _check_dispatch(mine, recv_x, recv_idx, recv_w, counts)
    assert recv_x.device == dev and recv_idx.dtype == torch.int64

    # DeepEP's 6-tuple handle, every element against the reference's definitions
    # (channels: the default config's num_sms // 2, as DeepEP)
    assert isinstance(handle, tuple) and len(handle) == 6
    C = epx.Buffer.get_dispatch_config(world).num_sms // 2
    masks = [ref.dispatch_layout(i, E, world)[2] for i in all_idx]
    want_h = ref.deepep_intranode_handle(masks, rank, C)
    dtypes = (torch.int32, torch.int32, torch.int32, torch.int32, torch.bool, torch.int32)
    for k, (got, exp) in enumerate(zip(handle, want_h)):
        assert got.device == dev and got.dtype == dtypes[k], f"handle[{k}]"
        np.testing.assert_array_equal(got.cpu().numpy(), exp, err_msg=f"handle[{k}]")
    np.testing.assert_array_equal(handle[0].cpu().numpy(), mine["rank_prefix_matrix"])
    np.testing.assert_array_equal(handle[3].cpu().numpy(), mine["recv_src_idx"])
    # DeepEP's own test reads rank_prefix_matrix[i][rank] as the end of source i's rows
    ends = [int(handle[0][i][rank]) for i in range(world)]
    assert ends == list(np.cumsum([int((mine["recv_src_rank"] == i).sum())
                                   for i in range(world)]))

    # cached dispatch reuses the routing
    again, n1, n2, n3, n4, _ = buf.dispatch(x, handle=handle)
    assert (n1, n2, n3, n4) == (None, None, None, None)
    np.testing.assert_array_equal(_bits(again), mine["recv_x"])

    # combine (identity experts), with weights and a pair of biases
    all_recv_x = _check_combine_with_biases(buf.combine, rank, group, dev, rng, T, H, E, all_idx,
                                            want, recv_x, handle, recv_w)
    plain = ref.ht_combine(list(all_idx), all_recv_x, E)[rank][0]
    cx2, cw2, _ = buf.combine(recv_x, handle)
    assert cw2 is None
    np.testing.assert_array_equal(_bits(cx2), plain)

    # a DeepEP-style config whose ring (16 rows per peer) is smaller than a pair's
    # rows (about 60): the staging laps, the results do not change
    small = epx.Config(20, 4, 16)
    rx_s, _, _, _, h_s, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, config=small, **layout)
    np.testing.assert_array_equal(_bits(rx_s), mine["recv_x"])
    again_s = buf.dispatch(x, handle=h_s, config=small)[0]
    np.testing.assert_array_equal(_bits(again_s), mine["recv_x"])
    np.testing.assert_array_equal(_bits(buf.combine(rx_s, h_s, config=small)[0]), plain)
    # the same through the pull dispatch (EPX's Config.pull_dispatch), its export
    # ring lapping too; a combine given that config ignores the flag
    small.pull_dispatch = True
    rx_p, _, _, _, h_p, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, config=small, **layout)
    np.testing.assert_array_equal(_bits(rx_p), mine["recv_x"])
    np.testing.assert_array_equal(_bits(buf.dispatch(x, handle=h_p, config=small)[0]),
                                  mine["recv_x"])
    np.testing.assert_array_equal(_bits(buf.combine(rx_p, h_p, config=small)[0]), plain)

    # DeepEP's other inputs: rows of a dtype EPX has no name for (float16, sent as
    # bytes), and FP8 rows with int32 (packed UE8M0) per-token scales or float32
    # scales of 3 per token in column-major order. Each received row (and its
    # scales) is the source's, in the reference's receive order.
    def expect_rows(sources, recv):
        got = recv.contiguous().view(torch.uint8).cpu().numpy()
        want_rows = [sources[s][t] for s, t in zip(mine["recv_src_rank"], mine["recv_src_idx"])]
        np.testing.assert_array_equal(got, np.asarray(want_rows).reshape(got.shape))

    x16_np = rng.standard_normal((T, H)).astype(np.float16)
    all_x16 = [a.view(np.uint8) for a in _gather(group, x16_np)]
    rx16, _, _, _, h16, _ = buf.dispatch(torch.from_numpy(x16_np).to(dev), topk_idx=idx,
                                         topk_weights=w, **layout)
    assert rx16.dtype == torch.float16 and rx16.shape == (mine["recv_src_idx"].size, H)
    expect_rows(all_x16, rx16)
    np.testing.assert_array_equal(buf.dispatch(torch.from_numpy(x16_np).to(dev),
                                               handle=h16)[0].cpu().numpy(), rx16.cpu().numpy())
    q_np = rng.integers(0, 255, (T, H), dtype=np.uint8)
    s_int = rng.integers(0, 2**31 - 1, (T, 1), dtype=np.int64).astype(np.int32)
    s_col = rng.standard_normal((3, T)).astype(np.float32)  # used transposed: [T, 3], strides (1, T)
    all_q, all_si, all_sc = zip(*_gather(group, (q_np, s_int, s_col.T.copy())))
    xq = torch.from_numpy(q_np).to(dev).view(torch.float8_e4m3fn)
    for scales, all_s in ((torch.from_numpy(s_int).to(dev), all_si),
                          (torch.from_numpy(s_col).to(dev).t(), all_sc)):
        (rq, rs), _, _, _, _, _ = buf.dispatch((xq, scales), topk_idx=idx, topk_weights=w,
                                               **layout)
        expect_rows([a for a in all_q], rq)
        assert rs.dtype == scales.dtype and rs.shape == (rq.shape[0], scales.shape[1])
        expect_rows([np.ascontiguousarray(a).view(np.uint8) for a in all_s], rs)

    # asynchronous, ordered after a captured event, outputs on the comm stream
    for on_comm in (False, True):
        prev = epx.Buffer.capture()
        out = buf.get_dispatch_layout(idx, E, previous_event=prev, async_finish=True,
                                      allocate_on_comm_stream=on_comm)
        out[-1].current_stream_wait()
        prev = epx.EventOverlap(epx.EventHandle())
        rx, _, _, cnt, h2, ev = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                             num_tokens_per_rank=out[0],
                                             is_token_in_rank=out[3],
                                             num_tokens_per_expert=out[2],
                                             previous_event=prev, async_finish=True,
                                             allocate_on_comm_stream=on_comm)
        assert ev.event is not None
        with ev:
            pass  # leaving the block makes the current stream wait
        np.testing.assert_array_equal(_bits(rx), mine["recv_x"])
        cx3, _, ev = buf.combine(rx, h2, previous_event=buf.capture(), async_finish=True,
                                 allocate_on_comm_stream=on_comm)
        ev.current_stream_wait()
        np.testing.assert_array_equal(_bits(cx3), plain)

    # FP8 payload with per-128-channel scales
    x8, want8 = _fp8_ht_inputs(rank, group, dev, x_np, all_idx, E)
    (rq, rs), ri, _, c8, _, _ = buf.dispatch(x8, topk_idx=idx, **layout)
    assert rq.dtype == torch.float8_e4m3fn and rs.dtype == torch.float32
    np.testing.assert_array_equal(_bits(rq), want8["recv_x"][0])
    np.testing.assert_array_equal(rs.cpu().numpy(), want8["recv_x"][1])
    assert c8 == want8["num_recv_tokens_per_expert"]

    # expert alignment and worst-case sizing (no host sync)
    want_al = ref.ht_dispatch(list(all_x), list(all_idx), E, expert_alignment=8)[rank]
    _, _, _, c_al, _, _ = buf.dispatch(x, topk_idx=idx, expert_alignment=8, **layout)
    assert c_al == want_al["num_recv_tokens_per_expert"] and all(c % 8 == 0 for c in c_al)
    worst = sum(a.shape[0] for a in all_idx)
    rx_w, ri_w, _, c_w, h_w, _ = buf.dispatch(x, topk_idx=idx, num_worst_tokens=worst, **layout)
    N = mine["recv_x"].shape[0]
    assert rx_w.shape == (worst, H) and c_w == []
    np.testing.assert_array_equal(_bits(rx_w[:N]), mine["recv_x"])
    np.testing.assert_array_equal(ri_w[:N].cpu().numpy(), mine["recv_topk_idx"])
    assert (ri_w[N:] == -1).all()

    # autograd inputs are accepted (DeepEP is called inside autograd Functions)
    xg = x.float().requires_grad_().bfloat16()
    rg, _, _, _, _, _ = buf.dispatch(xg, topk_idx=idx, **layout)
    np.testing.assert_array_equal(_bits(rg), mine["recv_x"])

    # errors name the argument
    _check_raises(epx.EPXValueError, r"dispatch: x_scales: needs x of 1-byte elements",
                  lambda: buf.dispatch((x, torch.ones(x.shape[0], 1, device=dev)),
                                       topk_idx=idx, **layout))
    _check_raises(epx.EPXValueError, r"dispatch: hidden: a row must be a multiple of 16 bytes",
                  lambda: buf.dispatch(x[:, :-1].contiguous(), topk_idx=idx, **layout))
    _check_raises(TypeError, r"^x: expected a torch.Tensor, got ndarray",
                  lambda: buf.dispatch(x_np, topk_idx=idx, **layout))
    _check_raises(TypeError, r"handle: expected the handle returned by dispatch",
                  lambda: buf.combine(recv_x, (1, 2)))
    _check_raises(epx.EPXValueError, r"get_dispatch_layout: num_experts: must be divisible",
                  lambda: buf.get_dispatch_layout(idx, E + 1))

    # raw buffer and streams
    raw = buf.get_local_buffer_tensor(torch.bfloat16, (4, 8))
    assert raw.shape == (4, 8) and raw.device == dev
    raw.fill_(1.5)
    assert buf.get_local_buffer_tensor(torch.bfloat16)[:32].eq(1.5).all()
    assert buf.get_comm_stream().cuda_stream == buf.runtime.comm_stream

    torch.cuda.synchronize()
    buf.destroy()
    _check_raises(RuntimeError, r"after destroy", lambda: buf.get_dispatch_layout(idx, E))


# ---- low-latency ---------------------------------------------------------------------------------

def _check_ll_rows(recv, count, handle, x_src, world, rows_equal):
    """Every valid row of every local expert holds the source token its handle names."""
    import torch
    from epx.buffer import _TorchGlue

    # DeepEP's tuple: handle[0] src_info, handle[1] layout_range (and the core's own views).
    assert isinstance(handle, tuple) and len(handle) == 5
    assert tuple(handle[2:]) == (handle.core.num_max_dispatch_tokens_per_rank,
                                 handle.core.hidden, handle.core.num_experts)
    src_info = handle[0].cpu().numpy()
    rng_ = handle[1].cpu().numpy()
    np.testing.assert_array_equal(src_info, _TorchGlue.get().out(handle.src_info).cpu().numpy())
    assert handle[0].dtype == torch.int32 and handle[1].dtype == torch.int64
    for le in range(count.shape[0]):
        total = 0
        for s in range(world):
            begin, n = int(rng_[le, s]) >> 32, int(rng_[le, s]) & 0xFFFFFFFF
            for row in range(begin, begin + n):
                rows_equal(recv, le, row, x_src[s][src_info[le, row]])
            total += n
        assert total == count[le]


def _case_low_latency_cuda_graph(rank, world, group):
    """Dispatch + combine captured once in a torch.cuda.CUDAGraph (as decode engines do)
    and replayed with new tokens, routing and weights written into the same tensors."""
    import torch

    import epx
    from epx import reference as ref

    dev = _device(rank, group)
    H, K, E, maxT, T = 512, 4, 4 * world, 32, 24
    rdma = epx.Buffer.get_low_latency_rdma_size_hint(maxT, H, world, E)
    buf = _buffer(group, 0, rdma, low_latency_mode=True, explicitly_destroy=True)
    x = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    idx = torch.empty(T, K, dtype=torch.int64, device=dev)
    w = torch.empty(T, K, dtype=torch.float32, device=dev)

    def fill(seed):
        rng = np.random.default_rng(seed * 1000 + rank)
        idx_np = _routing(rng, T, K, E, drop=0.15)
        x_np = ref.bf16_from_float(rng.standard_normal((T, H)).astype(np.float32))
        w_np = rng.random((T, K)).astype(np.float32)
        idx.copy_(torch.from_numpy(idx_np))
        x.copy_(_bf16(x_np, dev))
        w.copy_(torch.from_numpy(w_np))
        return [list(a) for a in zip(*_gather(group, (idx_np, x_np, w_np)))]

    all_idx, all_x, all_w = fill(0)
    # eager first (lazy set-up stays out of the capture), checked like the replays
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, maxT, E, use_fp8=False)
    out, _, _ = buf.low_latency_combine(recv, idx, w, handle)
    torch.cuda.synchronize(dev)
    buf.check()
    want = ref.ll_dispatch(all_x, all_idx, E, maxT)
    expect = ref.ll_combine([want[r]["recv_x"] for r in range(world)], all_idx, all_w, E,
                            maxT)[rank]
    np.testing.assert_allclose(ref.bf16_to_float(_bits(out)), ref.bf16_to_float(expect),
                               rtol=1e-2, atol=1e-2, err_msg="eager combine")
    _gather(group, 0)
    graph = torch.cuda.CUDAGraph()
    # Each rank its own capture stream (torch.cuda.graph's default one is shared by
    # every thread) and thread_local mode: in-process ranks capture at the same time.
    with torch.cuda.graph(graph, stream=torch.cuda.Stream(dev), capture_error_mode="thread_local"):
        recv_g, count_g, handle_g, _, _ = buf.low_latency_dispatch(x, idx, maxT, E, use_fp8=False)
        out_g, _, _ = buf.low_latency_combine(recv_g, idx, w, handle_g)
    _gather(group, 0)  # every rank's graph exists before any rank replays
    for replay in range(1, 6):
        all_idx, all_x, all_w = fill(replay)
        torch.cuda.synchronize(dev)
        _gather(group, 0)
        graph.replay()
        torch.cuda.current_stream(dev).synchronize()
        want = ref.ll_dispatch(all_x, all_idx, E, maxT)
        np.testing.assert_array_equal(count_g.cpu().numpy(), want[rank]["recv_count"],
                                      err_msg=f"replay {replay}")
        expect = ref.ll_combine([want[r]["recv_x"] for r in range(world)], all_idx, all_w, E,
                                maxT)[rank]
        np.testing.assert_allclose(ref.bf16_to_float(_bits(out_g)), ref.bf16_to_float(expect),
                                   rtol=1e-2, atol=1e-2, err_msg=f"replay {replay}")
    _gather(group, 0)
    del graph
    buf.destroy()


def _case_low_latency_shrink(rank, world, group):
    """enable_shrink: the last rank makes no low-latency call; the others mask it and
    get the ops without it (its experts' picks count as -1, it sends no token)."""
    import torch

    import epx
    from epx import reference as ref

    dev = _device(rank, group)
    H, K, E, maxT = 512, 4, 4 * world, 32
    El, dead = E // world, world - 1
    rng = np.random.default_rng(300 + rank)
    T = 20 + 3 * rank
    idx_np = _routing(rng, T, K, E, drop=0.1)
    x_np = ref.bf16_from_float(rng.standard_normal((T, H)).astype(np.float32))
    w_np = rng.random((T, K)).astype(np.float32)
    all_idx, all_x, all_w = (list(a) for a in zip(*_gather(group, (idx_np, x_np, w_np))))
    live = [r != dead for r in range(world)]
    ref_idx = [np.where(i // El == dead, -1, i) if live[r] else i[:0]
               for r, i in enumerate(all_idx)]
    ref_x = [a if live[r] else a[:0] for r, a in enumerate(all_x)]
    ref_w = [a if live[r] else a[:0] for r, a in enumerate(all_w)]
    want = ref.ll_dispatch(ref_x, ref_idx, E, maxT)

    rdma = epx.Buffer.get_low_latency_rdma_size_hint(maxT, H, world, E)
    buf = _buffer(group, 0, rdma, low_latency_mode=True, explicitly_destroy=True,
                  enable_shrink=True)
    assert buf.runtime.shrink_enabled
    if live[rank]:
        status = torch.full((world,), -1, dtype=torch.int32, device=dev)
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == [0] * world
        _check_raises(ValueError, "rank_to_mask",
                      lambda: buf.low_latency_update_mask_buffer(world, True))
        _check_raises(ValueError, "mask_status",
                      lambda: buf.low_latency_query_mask_buffer(status.to(torch.int64)))
        buf.low_latency_update_mask_buffer(dead, True)
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == [int(not a) for a in live]

        idx, x = torch.from_numpy(idx_np).to(dev), _bf16(x_np, dev)
        w = torch.from_numpy(w_np).to(dev)
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, maxT, E, use_fp8=False)
        np.testing.assert_array_equal(count.cpu().numpy(), want[rank]["recv_count"])

        def same_bf16(r, le, row, src_row):
            np.testing.assert_array_equal(r[le, row], src_row)

        _check_ll_rows(_bits(recv), count.cpu().numpy(), handle, ref_x, world, same_bf16)
        expect = ref.ll_combine([want[r]["recv_x"] for r in range(world)], ref_idx, ref_w, E,
                                maxT)[rank]
        combined, _, _ = buf.low_latency_combine(recv, idx, w, handle)
        np.testing.assert_allclose(ref.bf16_to_float(_bits(combined)),
                                   ref.bf16_to_float(expect), rtol=1e-2, atol=1e-2)
        buf.low_latency_clean_mask_buffer()
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == [0] * world
    _gather(group, 0)
    buf.destroy()

    plain = _buffer(group, 0, rdma, low_latency_mode=True, explicitly_destroy=True)
    _check_raises(ValueError, "enable_shrink", lambda: plain.low_latency_clean_mask_buffer())
    plain.destroy()


def _case_low_latency(rank, world, group):
    import torch

    import epx
    from epx import reference as ref

    dev = _device(rank, group)
    H, K, E, maxT = 512, 4, 4 * world, 32  # UE8M0 packs 4 scales per int32: H % 512 == 0
    El = E // world
    rng = np.random.default_rng(200 + rank)
    T = 20 + 3 * rank
    idx_np = _routing(rng, T, K, E, drop=0.15)
    x_np = ref.bf16_from_float(rng.standard_normal((T, H)).astype(np.float32))
    w_np = rng.random((T, K)).astype(np.float32)
    idx, x, w = torch.from_numpy(idx_np).to(dev), _bf16(x_np, dev), torch.from_numpy(w_np).to(dev)
    all_idx, all_x, all_w = (list(a) for a in zip(*_gather(group, (idx_np, x_np, w_np))))
    want = ref.ll_dispatch(all_x, all_idx, E, maxT)

    rdma = epx.Buffer.get_low_latency_rdma_size_hint(maxT, H, world, E)
    buf = _buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=El,
                  explicitly_destroy=True)
    # With EPX_PROXY_CUMEM=0 the ops over the proxy across nodes run one at a time:
    # its one-host engine then issues its copies as primary-context CUDA calls that
    # the driver holds while this thread waits in a pageable .cpu() copy behind an op
    # (docs/limitations.md, known-failing otherwise). By default they run in a
    # context of the engine's own and the ops overlap as in DeepEP's tests.
    proxy_across = (buf.backend == "proxy" and buf.get_num_rdma_ranks() > 1
                    and os.environ.get("EPX_PROXY_CUMEM") == "0")
    if os.environ.get("EPX_TEST_SYNC_AFTER_OPS") == "1" or proxy_across:
        buf = _SyncAfterOps(buf)
    buf.clean_low_latency_buffer(maxT, H, E)
    with _diagnosed(buf):
        # DeepEP's topology queries, on this rank's device: one NVLink domain, or the
        # virtual nodes of EPX_RANKS_PER_NODE (test_low_latency_across_nodes)
        rpn = int(os.environ.get("EPX_RANKS_PER_NODE", "0") or 0) or world
        for obj in (buf, buf.runtime):
            assert obj.get_local_device_id() == dev.index
            assert (obj.get_num_rdma_ranks(), obj.get_rdma_rank()) == (world // rpn, rank // rpn)
            assert (obj.get_root_rdma_rank(True), obj.get_root_rdma_rank(False)) == (rank % rpn, 0)

        # BF16 dispatch
        stats = torch.zeros(El, dtype=torch.int32, device=dev)
        recv, count, handle, ev, hook = buf.low_latency_dispatch(
            x, idx, maxT, E, cumulative_local_expert_recv_stats=stats, use_fp8=False)
        assert hook is None and recv.shape == (El, world * maxT, H)
        np.testing.assert_array_equal(count.cpu().numpy(), want[rank]["recv_count"])
        np.testing.assert_array_equal(stats.cpu().numpy(), want[rank]["recv_count"])
        recv_np = _bits(recv)

        def same_bf16(r, le, row, src_row):
            np.testing.assert_array_equal(r[le, row], src_row)

        _check_ll_rows(recv_np, count.cpu().numpy(), handle, all_x, world, same_bf16)

        # combine with identity experts: the expected result does not depend on the row order
        expect = ref.ll_combine([want[r]["recv_x"] for r in range(world)], all_idx, all_w, E,
                                maxT)[rank]
        combined, ev, hook = buf.low_latency_combine(recv, idx, w, handle)
        assert hook is None
        torch.cuda.synchronize(dev)
        buf.check()  # a failed wait raises its own error here, before the rows are compared
        got = ref.bf16_to_float(_bits(combined))
        np.testing.assert_allclose(got, ref.bf16_to_float(expect), rtol=1e-2, atol=1e-2)

        # wait statistics: the last rank starts 50 ms late, the others' stats name it
        slow = world - 1
        dwait = torch.zeros(world, dtype=torch.int64, device=dev)
        cwait = torch.zeros(world, dtype=torch.int64, device=dev)
        _gather(group, 0)
        if rank == slow:
            time.sleep(0.05)
        recv_w, _, handle_w, _, _ = buf.low_latency_dispatch(
            x, idx, maxT, E, dispatch_wait_recv_cost_stats=dwait, use_fp8=False)
        _gather(group, 0)
        if rank == slow:
            time.sleep(0.05)
        combined_w, _, _ = buf.low_latency_combine(recv_w, idx, w, handle_w,
                                                   combine_wait_recv_cost_stats=cwait)
        np.testing.assert_array_equal(_bits(combined_w), _bits(combined))
        for name, t in (("dispatch", dwait), ("combine", cwait)):
            waits = t.cpu().numpy()
            assert (waits >= 0).all(), (name, waits)
            if rank != slow:
                assert waits[slow] >= 10_000_000, (name, waits)
                assert (2 * np.delete(waits, slow) < waits[slow]).all(), (name, waits)

        # LogFMT: the LogFMT reference within the plain tolerance (the kernels code
        # what crosses as the reference does, with its arithmetic), and not the
        # BF16 result
        lf, _, _ = buf.low_latency_combine(recv, idx, w, handle, use_logfmt=True)
        want_lf = ref.bf16_to_float(ref.ll_combine([want[r]["recv_x"] for r in range(world)],
                                                   all_idx, all_w, E, maxT, use_logfmt=True)[rank])
        got_lf = ref.bf16_to_float(_bits(lf))
        mag = np.abs(ref.bf16_to_float(x_np)) * (np.abs(w_np) * (idx_np >= 0)).sum(1, keepdims=True)
        tol = 1e-2 * np.abs(want_lf) + 1e-2 + 2.0**-8 * mag
        assert (np.abs(got_lf - want_lf) <= tol).all()
        assert (_bits(lf) != _bits(combined)).mean() > 0.1

        # hooks, zero copy, out=, async
        recv2, _, h2, _, hook = buf.low_latency_dispatch(x, idx, maxT, E, use_fp8=False,
                                                         return_recv_hook=True)
        assert callable(hook)
        hook()
        # rows past recv_count are unspecified: compare the valid rows of each expert
        cnt = count.cpu().numpy()
        bits2 = _bits(recv2)
        for le in range(El):
            np.testing.assert_array_equal(bits2[le, :cnt[le]], recv_np[le, :cnt[le]])
        zbuf = buf.get_next_low_latency_combine_buffer(h2)
        assert zbuf.shape == (El, world * maxT, H) and zbuf.dtype == torch.bfloat16
        zbuf.copy_(recv2)
        out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
        c2, ev, hook = buf.low_latency_combine(zbuf, idx, w, h2, zero_copy=True, out=out,
                                               async_finish=True, return_recv_hook=True)
        assert c2 is out
        hook()
        ev.current_stream_wait()
        np.testing.assert_allclose(ref.bf16_to_float(_bits(out)), ref.bf16_to_float(expect),
                                   rtol=1e-2, atol=1e-2)

        # FP8 dispatch: rows are the quantized source rows, scales column-major
        for round_scale, ue8m0 in ((False, False), (True, False), (True, True)):
            (q, s), count8, h8, _, _ = buf.low_latency_dispatch(
                x, idx, maxT, E, use_fp8=True, round_scale=round_scale, use_ue8m0=ue8m0)
            assert q.dtype == torch.float8_e4m3fn
            if ue8m0:
                assert s.dtype == torch.int32 and s.shape == (El, world * maxT, H // 512)
            else:
                assert s.dtype == torch.float32 and s.shape == (El, world * maxT, H // 128)
            assert s.stride(1) == 1  # column-major in the last two dims
            q_np, s_np = _bits(q), s.contiguous().cpu().numpy()
            quant = [ref.quantize_fp8(ref.bf16_to_float(a), round_scale) for a in all_x]

            def same_fp8(r, le, row, src, s_np=s_np, ue8m0=ue8m0):
                qs, ss = src
                np.testing.assert_array_equal(r[le, row], qs)
                if ue8m0:
                    exps = s_np[le, row].view(np.uint8)[: H // 128]
                    want_e = [_core_ue8m0(v) for v in ss]
                    np.testing.assert_array_equal(exps, want_e)
                else:
                    np.testing.assert_array_equal(s_np[le, row], ss)

            src = [[(quant[r][0][t], quant[r][1][t]) for t in range(all_x[r].shape[0])]
                   for r in range(world)]
            _check_ll_rows(q_np, count8.cpu().numpy(), h8, src, world, same_fp8)

    # errors
    _check_raises(epx.EPXValueError, r"low_latency_dispatch: x: has \d+ tokens, more than",
                  lambda: buf.low_latency_dispatch(x, idx, 4, E, use_fp8=False))
    _check_raises(TypeError, r"handle: expected the handle returned by low_latency_dispatch",
                  lambda: buf.low_latency_combine(recv, idx, w, None))
    torch.cuda.synchronize()
    buf.destroy()


def _core_ue8m0(scale):
    from epx import _core

    return _core.ref.scale_to_ue8m0(float(scale))


# ---- the example MoE layer -----------------------------------------------------------------------

def _examples():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
    if path not in sys.path:
        sys.path.insert(0, path)
    import moe_layer
    import moe_reference

    return moe_layer, moe_reference


def _case_moe_layer_example(rank, world, group):
    import torch

    ml, m = _examples()
    dev = torch.device("cuda", rank)
    H, I, E, K, maxT, seed = 512, 256, 4 * world, 4, 64, 5
    El = E // world
    _, w1, w2 = m.expert_weights(seed, E, H, I)

    # the example as a function: prefill (high-throughput) and FP8 decode (low-latency),
    # different token counts per rank
    T, Td = 96 + 13 * rank, 40 + 5 * rank
    r = ml.run_example(group, num_tokens=T, num_decode_tokens=Td,
                       num_max_dispatch_tokens_per_rank=maxT, hidden=H, intermediate=I,
                       num_experts=E, topk=K, seed=seed, use_fp8=True)
    assert r["out"].shape == (T, H) and r["out_decode"].shape == (Td, H)
    assert (r["topk_idx"] // El != rank).any(), "no token leaves this rank: a weak test"
    every = _gather(group, r)
    failures = []
    if rank == 0:  # all ranks' tokens through the dense reference, in one process
        def cat(key):
            return np.concatenate([e[key] for e in every])

        for name, x in (("prefill", cat("x")), ("decode", m.fp8_roundtrip(cat("x_decode")))):
            sfx = "" if name == "prefill" else "_decode"
            want = m.moe_forward(x, cat("topk_idx" + sfx), cat("topk_weights" + sfx), w1, w2)
            err = m.compare(cat("out" + sfx), want)
            if err is not None:
                failures.append(f"{name}: {err}")
    failures = _gather(group, failures)[0]
    assert not failures, failures

    # decode through the layer's steps, BF16 and FP8, with poisoned outputs: the expert
    # rows past recv_count (which the combine must not read) and the combine's out=
    layer = ml.MoELayer(group, H, I, E, K, num_max_dispatch_tokens_per_rank=maxT, seed=seed)
    try:
        x_np = m.random_tokens(300 + rank, Td, H)
        x = torch.from_numpy(x_np).to(dev, torch.bfloat16)
        idx, w = layer.route(x)
        for use_fp8 in (False, True):
            recv, count, handle = layer.dispatch_decode(x, idx, use_fp8)
            assert int(count.sum()) > 0
            y = ml.masked_experts(recv, count, layer.w1, layer.w2)
            stale = torch.arange(y.shape[1], device=dev).unsqueeze(0) >= count.unsqueeze(1)
            assert stale.any()
            y[stale] = float("nan")
            out = torch.full((Td, H), float("nan"), dtype=torch.bfloat16, device=dev)
            got = layer.combine_decode(y, idx, w, handle, out=out)
            assert got is out
            x_in = m.fp8_roundtrip(x_np) if use_fp8 else x_np
            want = m.moe_forward(x_in, idx.cpu().numpy(), w.cpu().numpy(), w1, w2)
            err = m.compare(got.float().cpu().numpy(), want)
            assert err is None, f"decode (fp8={use_fp8}) on rank {rank}: {err}"
        # prefill through the steps: the grouped GEMM sees every received token
        xp_np = m.random_tokens(400 + rank, T, H)
        xp = torch.from_numpy(xp_np).to(dev, torch.bfloat16)
        idx_p, w_p = layer.route(xp)
        recv_x, recv_idx, recv_w, counts, handle = layer.dispatch(xp, idx_p, w_p)
        assert len(counts) == El and sum(counts) == int((recv_idx >= 0).sum())
        got = layer.combine(ml.grouped_experts(recv_x, recv_idx, recv_w, counts, layer.w1,
                                               layer.w2), handle)
        want = m.moe_forward(xp_np, idx_p.cpu().numpy(), w_p.cpu().numpy(), w1, w2)
        err = m.compare(got.float().cpu().numpy(), want)
        assert err is None, f"prefill steps on rank {rank}: {err}"
        torch.cuda.synchronize()
        import torch.distributed as dist

        dist.barrier(group)
    finally:
        layer.close()


# ---- the torch baseline of epx.bench -------------------------------------------------------------

def _case_torch_baseline(rank, world, group):
    import torch

    import torch_baseline_check

    torch_baseline_check.check(rank, world, group, torch.device("cuda", rank))


def _case_elastic_v2(rank, world, group):
    """deep_ep.ElasticBuffer's non-expanded dispatch and combine against epx.reference:
    every output V2 callers read (recv tensors, the EPHandle's counts, prefix sums and
    source metadata), with and without CPU sync, then the combine bit for bit."""
    import torch

    import deep_ep
    import epx
    from epx import reference as ref

    dev = _device(rank, group)
    H, K, E, maxT = 256, 4, 8 * world, 128
    E_local = E // world
    rng = np.random.default_rng(300 + rank)
    T = 64 + 17 * rank
    idx_np, x_np, idx, x, w, all_idx, all_x, want = _ht_inputs(rank, group, dev, rng, T, H, K, E)
    mine = want[rank]
    N = len(mine["recv_src_idx"])

    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=maxT, hidden=H, num_topk=K,
                                explicitly_destroy=True)
    assert (buf.rank_idx, buf.num_ranks) == (rank, world)
    nodes, rpn = buf.get_physical_domain_size()
    assert nodes * rpn == world
    assert nodes == max(1, world // int(os.environ.get("EPX_RANKS_PER_NODE", world) or world))
    assert buf.get_logical_domain_size() == (nodes, rpn)  # allow_hybrid_mode=True
    assert buf.num_bytes % (2 << 20) == 0
    num_sms = buf.get_theoretical_num_sms(E, K)
    assert num_sms == epx.Buffer.get_dispatch_config(world).num_sms
    assert buf.get_theoretical_num_qps(num_sms) == (0 if nodes == 1 else min(num_sms, 4))

    # rows from each scale-up peer: sources of the same local index when nodes > 1
    src = np.asarray(mine["recv_src_rank"])
    per_src = np.array([(src == s).sum() for s in range(world)])
    per_peer = per_src.reshape(nodes, rpn).sum(0) if nodes > 1 else per_src
    meta0 = src.astype(np.int64) * maxT + np.asarray(mine["recv_src_idx"])

    def check_handle(h, counts_aligned, num_rows):
        assert isinstance(h, deep_ep.EPHandle) and h.do_expand is False
        assert (h.num_experts, h.num_max_tokens_per_rank, h.num_sms) == (E, maxT, num_sms)
        assert h.num_recv_tokens == num_rows
        np.testing.assert_array_equal(h.psum_num_recv_tokens_per_scaleup_rank.cpu().numpy(),
                                      np.cumsum(per_peer))
        assert h.psum_num_recv_tokens_per_scaleup_rank.dtype == torch.int32
        np.testing.assert_array_equal(h.psum_num_recv_tokens_per_expert.cpu().numpy(),
                                      np.cumsum(counts_aligned))
        meta = h.recv_src_metadata
        assert meta.shape == (num_rows, K + 2) and meta.dtype == torch.int32
        np.testing.assert_array_equal(meta[:N, 0].cpu().numpy(), meta0)
        assert bool((meta[N:, 0] == -1).all())
        assert torch.equal(h.topk_idx, idx) and h.topk_idx.data_ptr() != idx.data_ptr()

    # dispatch with CPU sync (V2's default), then combine with weights and biases
    recv_x, recv_idx, recv_w, h, ev = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                   num_experts=E)
    assert isinstance(ev, deep_ep.EventOverlap) and ev.event is None
    _check_dispatch(mine, recv_x, recv_idx, recv_w, h.num_recv_tokens_per_expert_list)
    check_handle(h, mine["num_recv_tokens_per_expert"], N)
    assert h.num_expanded_tokens == sum(mine["num_recv_tokens_per_expert"])
    ranks_per_node = rpn if nodes > 1 else 0
    all_recv_x = _check_combine_with_biases(buf.combine, rank, group, dev, rng, T, H, E,
                                            all_idx, want, recv_x, h, recv_w,
                                            ranks_per_node=ranks_per_node)
    plain = ref.ht_combine(list(all_idx), all_recv_x, E, ranks_per_node=ranks_per_node)[rank][0]
    cx, cw, _ = buf.combine(recv_x, h)
    assert cw is None
    np.testing.assert_array_equal(_bits(cx), plain)

    # aligned counts; the statistics get the unaligned ones
    aligned = ref.ht_dispatch(list(all_x), list(all_idx), E, expert_alignment=4)[rank]
    stats = torch.zeros(E_local, dtype=torch.int32, device=dev)
    _, ri, _, h4, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                   expert_alignment=4, cumulative_local_expert_recv_stats=stats)
    assert h4.num_recv_tokens_per_expert_list == aligned["num_recv_tokens_per_expert"]
    check_handle(h4, aligned["num_recv_tokens_per_expert"], N)
    unaligned = [int((np.asarray(mine["recv_topk_idx"]) == e).sum()) for e in range(E_local)]
    assert stats.cpu().tolist() == unaligned

    # without CPU sync (vLLM's decode path): maxT x R rows, the real ones first
    wx, wi, ww, hw, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                     do_cpu_sync=False, num_max_tokens_per_rank=maxT)
    assert wx.shape[0] == maxT * world and hw.num_recv_tokens_per_expert_list == []
    np.testing.assert_array_equal(_bits(wx[:N]), mine["recv_x"])
    np.testing.assert_array_equal(wi[:N].cpu().numpy(), mine["recv_topk_idx"])
    assert bool((wi[N:] == -1).all())
    check_handle(hw, mine["num_recv_tokens_per_expert"], maxT * world)
    np.testing.assert_array_equal(_bits(buf.combine(wx, hw)[0]), plain)

    # asynchronous, after a captured event, outputs on the comm stream
    ax, ai, aw, ha, aev = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                       previous_event=buf.capture(),
                                       async_with_compute_stream=True,
                                       allocate_on_comm_stream=True)
    aev.current_stream_wait()
    _check_dispatch(mine, ax, ai, aw, ha.num_recv_tokens_per_expert_list)
    check_handle(ha, mine["num_recv_tokens_per_expert"], N)
    acx, _, cev = buf.combine(ax, ha, async_with_compute_stream=True,
                              allocate_on_comm_stream=True)
    cev.current_stream_wait()
    np.testing.assert_array_equal(_bits(acx), plain)

    # FP8 rows with per-128 float32 scales, returned TMA-aligned column-major
    x8, want8 = _fp8_ht_inputs(rank, group, dev, x_np, all_idx, E)
    (rq, rs), _, _, h8, _ = buf.dispatch(x8, topk_idx=idx, num_experts=E,
                                         use_tma_aligned_col_major_sf=True)
    np.testing.assert_array_equal(_bits(rq), want8["recv_x"][0])
    assert rs.shape == (N, H // 128) and rs.stride() == (1, (N + 3) // 4 * 4)
    np.testing.assert_array_equal(rs.cpu().numpy(), want8["recv_x"][1])

    # cached dispatches (handle=): new rows along the routing of h and hw
    _check_elastic_cached(buf, rank, group, dev, rng, h, hw, idx, w, all_idx, mine, E, h8,
                          x8, want8)

    # the expanded layout (SGLang's decode): one slot per (row, local expert), grouped
    # by expert with aligned starts, with and without CPU sync, BF16 and FP8
    _check_elastic_expanded(buf, rank, group, dev, rng, x, idx, w, x8, all_idx, want, want8,
                            E, maxT, num_sms, ranks_per_node)
    buf.barrier()
    buf.destroy()


def _check_elastic_cached(buf, rank, group, dev, rng, h, hw, idx, w, all_idx, mine, E, h8,
                          x8, want8):
    """ElasticBuffer.dispatch(handle=): the cached handle's routing and row order with
    fresh rows (every rank's gathered for the reference), the weights sent again and
    masked as the first dispatch's, the handle itself returned; with and without CPU
    sync, asynchronous after an event, FP8 with TMA-aligned scales."""
    from epx import reference as ref

    N, H = len(mine["recv_src_idx"]), mine["recv_x"].shape[1]
    x2_np = ref.bf16_from_float(rng.standard_normal((idx.shape[0], H)).astype(np.float32))
    all_x2 = _gather(group, x2_np)
    want2 = ref.ht_dispatch(list(all_x2), list(all_idx), E)[rank]
    x2 = _bf16(x2_np, dev)
    for handle in (h, hw):
        cx, ci, cw, ch, _ = buf.dispatch(x2, handle=handle, topk_weights=w)
        rows = handle.num_recv_tokens
        assert ch is handle and cx.shape == (rows, H) and ci.shape == cw.shape
        np.testing.assert_array_equal(_bits(cx[:N]), want2["recv_x"])
        np.testing.assert_array_equal(ci[:N].cpu().numpy(), mine["recv_topk_idx"])
        np.testing.assert_array_equal(cw[:N].cpu().numpy(), mine["recv_topk_weights"])
        assert bool((ci[N:] == -1).all()) and not cw[N:].cpu().numpy().any()
    cx, _, cw, _, _ = buf.dispatch(x2, handle=h)
    assert cw is None
    np.testing.assert_array_equal(_bits(cx), want2["recv_x"])
    # asynchronous, after a captured event
    ax, _, aw, _, aev = buf.dispatch(x2, handle=h, topk_weights=w, previous_event=buf.capture(),
                                     async_with_compute_stream=True,
                                     allocate_on_comm_stream=True)
    aev.current_stream_wait()
    np.testing.assert_array_equal(_bits(ax), want2["recv_x"])
    np.testing.assert_array_equal(aw.cpu().numpy(), mine["recv_topk_weights"])
    # FP8 along its own handle
    (q, sf), _, _, _, _ = buf.dispatch(x8, handle=h8, use_tma_aligned_col_major_sf=True)
    np.testing.assert_array_equal(_bits(q), want8["recv_x"][0])
    assert sf.stride() == (1, (N + 3) // 4 * 4)
    np.testing.assert_array_equal(sf.cpu().numpy(), want8["recv_x"][1])


def _check_elastic_expanded(buf, rank, group, dev, rng, x, idx, w, x8, all_idx, want, want8,
                            E, maxT, num_sms, ranks_per_node):
    """ElasticBuffer.dispatch(do_expand=True) against epx.reference.ht_expand of this
    rank's reference dispatch, then its combine (expert outputs in slot order, 1-D
    weights) against ht_fold + ht_combine of every rank, bit for bit."""
    import torch

    import epx
    from epx import expand
    from epx import reference as ref

    world = len(want)
    mine, E_local, align = want[rank], E // world, 4
    N, H, K = len(mine["recv_src_idx"]), x.shape[1], idx.shape[1]
    lay = ref.ht_expand(mine["recv_topk_idx"], E_local, align)
    slots, S = lay["slots"], lay["num_slots"]
    where = slots >= 0
    # each (row, k) pair here: its slot, and the received row it copies
    at, rows = slots[where], np.broadcast_to(np.arange(N)[:, None], slots.shape)[where]

    def check(rx, rw, h, num_slots):
        assert h.do_expand is True and h.num_expanded_tokens == num_slots
        assert rx.shape == (num_slots, H) and rw.shape == (num_slots,)
        got = _bits(rx)
        np.testing.assert_array_equal(got[at], mine["recv_x"][rows])
        free = np.ones(num_slots, bool)
        free[at] = False
        assert not got[free].any(), "padding slots are zero"
        np.testing.assert_array_equal(rw.cpu().numpy()[at], mine["recv_topk_weights"][where])
        assert not rw.cpu().numpy()[free].any()
        np.testing.assert_array_equal(h.psum_num_recv_tokens_per_expert.cpu().numpy(),
                                      lay["starts"] + lay["counts"])
        np.testing.assert_array_equal(h.num_unaligned_recv_tokens_per_expert.cpu().numpy(),
                                      lay["counts"])
        np.testing.assert_array_equal(h.recv_src_metadata[:N, 2:].cpu().numpy(), slots)
        assert bool((h.recv_src_metadata[N:, 2:] == -1).all())

    stats = torch.zeros(E_local, dtype=torch.int32, device=dev)
    rx, ri, rw, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                    expert_alignment=align, do_expand=True,
                                    do_zero_padding=True,
                                    cumulative_local_expert_recv_stats=stats)
    assert ri is None
    check(rx, rw, h, S)
    assert stats.cpu().tolist() == lay["counts"].tolist()
    # cached (V2's test does this): the same slots, padding zero, the handle returned
    crx, cri, crw, ch, _ = buf.dispatch(x, handle=h, topk_weights=w, do_expand=True,
                                        do_zero_padding=True)
    assert cri is None and ch is h
    check(crx, crw, h, S)

    # combine of expert outputs in slot order, weighted back, with biases
    y_np = ref.bf16_from_float(rng.standard_normal((S, H)).astype(np.float32))
    b_np = ref.bf16_from_float(rng.standard_normal((x.shape[0], H)).astype(np.float32))
    folded = ref.ht_fold(y_np, slots)
    folded_w = np.where(where, mine["recv_topk_weights"], 0).astype(np.float32)
    all_folded = _gather(group, (folded, folded_w, b_np))
    expect = ref.ht_combine(list(all_idx), [f[0] for f in all_folded], E,
                            topk_weights=[f[1] for f in all_folded],
                            bias=[(f[2], None) for f in all_folded],
                            ranks_per_node=ranks_per_node)[rank]
    cx, cw, _ = buf.combine(_bf16(y_np, dev), h, topk_weights=rw, bias=_bf16(b_np, dev))
    np.testing.assert_array_equal(_bits(cx), expect[0])
    np.testing.assert_allclose(cw.cpu().numpy(), expect[1], rtol=1e-6)

    # without CPU sync: V2's worst-case slot count, the same slots filled
    worst = expand.worst_case_slots(maxT * world, K, E_local, align)
    wx, _, ww, hw, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                    expert_alignment=align, do_expand=True, do_cpu_sync=False)
    check(wx, ww, hw, worst)
    y_worst = np.zeros((worst, H), np.uint16)
    y_worst[:S] = y_np
    cwx, _, _ = buf.combine(_bf16(y_worst, dev), hw, bias=_bf16(b_np, dev))
    expect_plain = ref.ht_combine(list(all_idx), [f[0] for f in all_folded], E,
                                  bias=[(f[2], None) for f in all_folded],
                                  ranks_per_node=ranks_per_node)[rank]
    np.testing.assert_array_equal(_bits(cwx), expect_plain[0])

    # FP8 rows and scales at the same slots, scales TMA-aligned column-major
    (q, sf), _, _, _, _ = buf.dispatch(x8, topk_idx=idx, num_experts=E, expert_alignment=align,
                                       do_expand=True, use_tma_aligned_col_major_sf=True)
    assert q.shape == (S, H) and sf.shape == (S, H // 128)
    assert sf.stride() == (1, (S + 3) // 4 * 4)
    np.testing.assert_array_equal(_bits(q)[at], want8["recv_x"][0][rows])
    np.testing.assert_array_equal(sf.cpu().numpy()[at], want8["recv_x"][1][rows])

    # a combine input that is not the handle's slot count is refused by name
    bad = _bf16(np.zeros((S + 1, H), np.uint16), dev)
    _check_raises(epx.EPXValueError, "combine: x: has", lambda: buf.combine(bad, h))
    assert h.num_sms == num_sms

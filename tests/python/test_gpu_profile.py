"""What a profile shows of EPX's low-latency ops through the DeepEP API: one kernel named
"dispatch" and one named "combine", in hook mode and without, as DeepEP's own
tests/test_low_latency.py times them (its bench_kineto counts the profile's rows whose
name holds "dispatch" / "combine", and in hook mode sorts the events named "::dispatch" /
"::combine" into send and receive launches). One process, one rank, on one GPU; the
combined output is checked against the weighted sum each time. Run: pytest tests/python -m gpu
"""

import os
import tempfile

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

os.environ.setdefault("EPX_TIMEOUT_S", "60")
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")


@pytest.fixture(scope="module")
def group():
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        pytest.skip("needs PyTorch")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    torch.cuda.set_device(0)
    init = "file://" + os.path.join(tempfile.mkdtemp(prefix="epx-rdv-"), "store")
    dist.init_process_group("nccl", init_method=init, rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    dist.destroy_process_group()


def _rows_with(prof, word):
    """The profile table's kernel names that hold `word` (one row per distinct kernel)."""
    return sorted({e.key for e in prof.key_averages() if word in e.key})


@pytest.mark.parametrize("hook", [False, True])
def test_one_dispatch_and_one_combine_kernel_per_op(group, hook):
    import torch

    import deep_ep

    T, H, K, E, maxT, iters = 64, 2048, 8, 32, 128, 5
    rng = np.random.default_rng()
    dev = torch.device("cuda", 0)
    idx = torch.from_numpy(np.stack([rng.permutation(E)[:K] for _ in range(T)])).to(dev)
    idx[rng.random((T, K)) < 0.1] = -1  # some picks dropped
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    w = torch.rand(T, K, device=dev)
    valid = (idx >= 0).to(torch.float32)
    want = (x.float() * (w * valid).sum(1, keepdim=True)).to(torch.bfloat16).float()

    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(maxT, H, 1, E)
    # num_qps_per_rank as DeepEP's tests pass it (num_experts // num_ranks): 128 here,
    # more than EPX's 32 contexts per peer, which it then counts as.
    buf = deep_ep.Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=4 * E,
                         explicitly_destroy=True)
    try:
        def op():
            recv, count, handle, _, recv_hook = buf.low_latency_dispatch(
                x, idx, maxT, E, use_fp8=False, async_finish=False, return_recv_hook=hook)
            if hook:
                recv_hook()
            out = torch.full((T, H), float("nan"), device=dev, dtype=torch.bfloat16)
            combined, _, combine_hook = buf.low_latency_combine(
                recv, idx, w, handle, async_finish=False, return_recv_hook=hook, out=out)
            if hook:
                combine_hook()
            return combined

        torch.testing.assert_close(op().float(), want, rtol=2e-2, atol=2e-2)  # warm, checked
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            outs = [op() for _ in range(iters)]
            torch.cuda.synchronize()
        for out in outs:
            torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
        for word in ("dispatch", "combine"):
            rows = _rows_with(prof, word)
            assert len(rows) == 1, f"{word}: kernels {rows}"
            launches = [e for e in prof.events() if f"::{word}" in e.name]
            assert len(launches) == iters * (2 if hook else 1), \
                f"{word}: {len(launches)} launches of {rows[0]} for {iters} ops"
    finally:
        buf.destroy()

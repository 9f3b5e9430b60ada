"""Fuzzed bad input, Python side (hypothesis; no GPU, no PyTorch): the low-latency dispatch
and combine, the small ops and Config. What is fuzzed and how each set is judged:
fuzz_harness.py; DLPack, the layout and the high-throughput ops: test_fuzz.py.
EPX_FUZZ_SEED=N repeats a run.
"""

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

import epx
from epx import _core
from fuzz_harness import (
    N_CONFIG,
    N_LL_COMBINE,
    N_LL_DISPATCH,
    N_SMALL,
    ANY,
    D,
    Dev,
    Launched,
    Verdict,
    _testing,
    as_int,
    check_tally,
    describe,
    devices,
    faults,
    fuzz_settings,
    int_arg,
    judge,
    ll_size_rules,
    make_buffer,
    non_ints,
    ranks,
    rule_config,
    rule_int,
    tensor_arg,
    tensor_ok,
    vectors_ok,
)


LL_DISPATCH_ARGS = ["num_max_dispatch_tokens_per_rank", "num_experts", "x", "hidden", "topk_idx",
                    "use_fp8", "use_ue8m0", "cumulative_local_expert_recv_stats",
                    "dispatch_wait_recv_cost_stats", "compat"]


def test_fuzz_low_latency_dispatch():
    tally = Counter()

    @fuzz_settings(N_LL_DISPATCH)
    @given(st.data())
    def run(data):
        _, pb = data.draw(faults(LL_DISPATCH_ARGS))
        R, dev = data.draw(ranks), data.draw(devices)
        hit = lambda name: data.draw(st.floats(0, 1)) < pb(name)  # noqa: E731
        maxT = data.draw(int_arg(st.sampled_from([1, 32, 128, 1024]),
                                 pb("num_max_dispatch_tokens_per_rank")))
        E = data.draw(int_arg(st.integers(1, 1024 // R).map(lambda k: R * k), pb("num_experts")))
        ok_t, t_cap = as_int(maxT)
        T = data.draw(st.integers(0, min(t_cap, 300) if ok_t and t_cap > 0 else 300))
        if hit("x") and ok_t and 0 < t_cap < 300:
            T = t_cap + 1
        H = 128 * data.draw(st.integers(1, 128))
        if hit("hidden"):
            H = data.draw(st.sampled_from([0, -128, 64, 100, 16512, 20000]))
        x = data.draw(tensor_arg(D.bfloat16, [T, H], dev, pb("x")))
        idx = data.draw(tensor_arg(D.int64, [T, data.draw(st.integers(1, 16))], dev,
                                   pb("topk_idx")))
        if isinstance(idx, Dev) and len(idx.shape) == 2 and hit("topk_idx"):
            idx = Dev(idx.dtype, [idx.shape[0], data.draw(st.sampled_from([0, 17]))], idx.device)
        use_fp8 = data.draw(st.booleans())
        round_scale = data.draw(st.booleans()) if use_fp8 or hit("use_fp8") else False
        use_ue8m0 = data.draw(st.booleans()) if round_scale or hit("use_fp8") else False
        if hit("use_ue8m0"):
            use_fp8, round_scale, use_ue8m0 = True, False, True
        ok_e, e = as_int(E)
        local = e // R if ok_e and e > 0 else 1
        stats = data.draw(tensor_arg(D.int32, [local], dev, pb(
            "cumulative_local_expert_recv_stats"))) if data.draw(st.booleans()) else None
        wait = data.draw(tensor_arg(D.int64, [R], dev, pb("dispatch_wait_recv_cost_stats"))) \
            if data.draw(st.booleans()) else None
        compat = {}
        if hit("compat"):
            name = data.draw(st.sampled_from(["use_nvfp4", "use_ue8m0_for_sf", "x_global_scale",
                                              "topk_weights"]))
            compat[name] = True if name.startswith("use") else Dev(D.float32, [])

        v = Verdict()
        for name in compat:
            v.flag(True, name)
        if not compat:  # the compatibility arguments are refused before anything else
            m = rule_int(v, maxT, "num_max_dispatch_tokens_per_rank")
            n_e = rule_int(v, E, "num_experts")
            v.flag(not tensor_ok(x, D.bfloat16, [ANY, ANY], dev) or not vectors_ok(x), "x")
            v.flag(not isinstance(idx, Dev), "topk_idx")
            v.flag(not use_fp8 and (round_scale or use_ue8m0), "use_fp8")
            v.flag(use_ue8m0 and not round_scale, "use_ue8m0")
            for name, t in (("cumulative_local_expert_recv_stats", stats),
                            ("dispatch_wait_recv_cost_stats", wait)):
                v.flag(t is not None and not isinstance(t, Dev), name)
            if isinstance(x, Dev) and len(x.shape) == 2:
                Tx, Hx = x.shape
                ll_size_rules(v, m, Hx, n_e, R)
                v.flag(m is not None and Tx > m, "x")
                v.flag(not tensor_ok(idx, D.int64, [Tx, ANY], dev), "topk_idx")
                v.flag(isinstance(idx, Dev) and len(idx.shape) == 2
                       and not 1 <= idx.shape[1] <= 16, "topk_idx")
                if stats is not None and n_e is not None:
                    v.flag(not tensor_ok(stats, D.int32, [n_e // R], dev),
                           "cumulative_local_expert_recv_stats")
                if wait is not None:
                    v.flag(not tensor_ok(wait, D.int64, [R], dev), "dispatch_wait_recv_cost_stats")

        judge(tally, v, lambda: make_buffer(R, dev).low_latency_dispatch(
            x, idx, maxT, E, cumulative_local_expert_recv_stats=stats,
            dispatch_wait_recv_cost_stats=wait, use_fp8=use_fp8, round_scale=round_scale,
            use_ue8m0=use_ue8m0, **compat),
            describe(R=R, dev=dev, maxT=maxT, E=E, x=x, idx=idx, fp8=use_fp8, round=round_scale,
                     ue8m0=use_ue8m0, stats=stats, wait=wait, compat=compat))

    run()
    check_tally("low_latency_dispatch", tally, N_LL_DISPATCH,
                [a for a in LL_DISPATCH_ARGS if a != "compat"] + ["use_nvfp4", "x_global_scale"])


LL_COMBINE_ARGS = ["handle", "x", "topk_idx", "topk_weights", "out",
                   "combine_wait_recv_cost_stats", "overlap"]


def test_fuzz_low_latency_combine():
    tally = Counter()

    @fuzz_settings(N_LL_COMBINE)
    @given(st.data())
    def run(data):
        _, pb = data.draw(faults(LL_COMBINE_ARGS))
        R, dev = data.draw(ranks), data.draw(devices)
        hit = lambda name: data.draw(st.floats(0, 1)) < pb(name)  # noqa: E731
        E, maxT = R * data.draw(st.integers(1, 32)), data.draw(st.sampled_from([1, 8, 32, 128]))
        H, K = 128 * data.draw(st.integers(1, 16)), data.draw(st.integers(1, 16))
        T = data.draw(st.integers(0, maxT))
        if hit("handle") and data.draw(st.booleans()):
            handle = data.draw(st.sampled_from(
                [None, (1, 2), _testing().dispatch_handle(R, 1, 1, 128)]))
        else:
            handle = _testing().low_latency_handle(
                (2 * R if R < 8 else 4) if hit("handle") else R, E, maxT, H, T, K)
        x = data.draw(tensor_arg(D.bfloat16, [E // R, R * maxT, H], dev, pb("x")))
        idx = data.draw(tensor_arg(D.int64, [T, K], dev, pb("topk_idx")))
        w = data.draw(tensor_arg(D.float32, [T, K], dev, pb("topk_weights")))
        out = data.draw(tensor_arg(D.bfloat16, [T, H], dev, pb("out"))) \
            if data.draw(st.booleans()) else None
        stats = data.draw(tensor_arg(D.int64, [R], dev, pb("combine_wait_recv_cost_stats"))) \
            if data.draw(st.booleans()) else None
        overlap = hit("overlap")

        v = Verdict()
        if overlap:
            v.flag(True, "overlap")
        elif not isinstance(handle, _core.LowLatencyHandle):
            v.flag(True, "handle")
        else:
            v.flag(handle.num_ranks != R, "handle")
            v.flag(not tensor_ok(x, D.bfloat16, [E // R, R * maxT, H], dev) or not vectors_ok(x),
                   "x")
            v.flag(not tensor_ok(idx, D.int64, [T, K], dev), "topk_idx")
            v.flag(not tensor_ok(w, D.float32, [T, K], dev), "topk_weights")
            if out is not None:
                v.flag(not tensor_ok(out, D.bfloat16, [T, H], dev) or not vectors_ok(out), "out")
            if stats is not None:
                v.flag(not tensor_ok(stats, D.int64, [R], dev), "combine_wait_recv_cost_stats")

        judge(tally, v, lambda: make_buffer(R, dev).low_latency_combine(
            x, idx, w, handle, out=out, combine_wait_recv_cost_stats=stats, overlap=overlap),
            describe(R=R, dev=dev, x=x, idx=idx, w=w, handle=handle, out=out, stats=stats,
                     overlap=overlap))

    run()
    check_tally("low_latency_combine", tally, N_LL_COMBINE, LL_COMBINE_ARGS)


SMALL_ARGS = ["num_max_dispatch_tokens_per_rank", "hidden", "num_experts", "num_ranks",
              "rank_to_mask", "mask_status", "num_sms", "new_num_sms"]


def test_fuzz_small_ops():
    """clean_low_latency_buffer, the shrink mask calls, get_low_latency_rdma_size_hint and
    set_num_sms: int arguments and their ranges."""
    tally = Counter()
    saved = epx.Buffer.num_sms

    @fuzz_settings(N_SMALL)
    @given(st.data())
    def run(data):
        _, pb = data.draw(faults(SMALL_ARGS))
        R, dev = data.draw(ranks), data.draw(devices)
        op = data.draw(st.sampled_from(["clean", "mask", "query", "hint", "sms"]))
        v = Verdict()
        buf = make_buffer(R, dev)
        if op in ("clean", "hint"):
            maxT = data.draw(int_arg(st.sampled_from([1, 128, 1024]),
                                     pb("num_max_dispatch_tokens_per_rank")))
            H = data.draw(int_arg(st.integers(1, 128).map(lambda k: 128 * k), pb("hidden")))
            E = data.draw(int_arg(st.integers(1, 1024 // R).map(lambda k: R * k),
                                  pb("num_experts")))
            m = rule_int(v, maxT, "num_max_dispatch_tokens_per_rank")
            h = rule_int(v, H, "hidden")
            e = rule_int(v, E, "num_experts")
            if op == "clean":
                ll_size_rules(v, m, h, e, R)
                call = lambda: buf.clean_low_latency_buffer(maxT, H, E)  # noqa: E731
            else:
                n = data.draw(int_arg(st.just(R), pb("num_ranks")))
                r = rule_int(v, n, "num_ranks")
                # Low-latency ops run across nodes: up to 160 ranks (20 nodes of 8).
                v.flag(r is not None and not 1 <= r <= 160, "num_ranks")
                if r is not None and 1 <= r <= 160:
                    ll_size_rules(v, m, h, e, r)

                def call():
                    assert epx.Buffer.get_low_latency_rdma_size_hint(maxT, H, n, E) > 0
                    raise Launched
            desc = describe(op=op, R=R, maxT=maxT, H=H, E=E)
        elif op == "mask":
            rank = data.draw(int_arg(st.integers(0, R - 1), pb("rank_to_mask")))
            k = rule_int(v, rank, "rank_to_mask")
            v.flag(k is not None and not 0 <= k < R, "rank_to_mask")
            call = lambda: buf.low_latency_update_mask_buffer(rank, True)  # noqa: E731
            desc = describe(op=op, R=R, rank=rank)
        elif op == "query":
            status = data.draw(tensor_arg(D.int32, [R], dev, pb("mask_status")))
            v.flag(not tensor_ok(status, D.int32, [R], dev), "mask_status")
            call = lambda: buf.low_latency_query_mask_buffer(status)  # noqa: E731
            desc = describe(op=op, R=R, status=status)
        else:
            # A set aimed at new_num_sms breaks its type (only a non-int is named
            # so: a wrong int is the num_sms rule); aimed anywhere else, int_arg's
            # mix. A wild int's share of the non-ints alone left some seeds
            # with no set naming new_num_sms in 1000.
            if data.draw(st.floats(0, 1)) < pb("new_num_sms"):
                n = data.draw(non_ints())
            else:
                n = data.draw(int_arg(st.integers(1, 66).map(lambda k: 2 * k), pb("num_sms")))
            k = rule_int(v, n, "new_num_sms")
            v.flag(k is not None and (k < 2 or k % 2), "num_sms")

            def call():
                epx.Buffer.set_num_sms(n)
                assert epx.Buffer.num_sms == n and _core.Buffer.num_sms() == n
                raise Launched
            desc = describe(op=op, n=n)
        judge(tally, v, call, desc)

    try:
        run()
    finally:
        epx.Buffer.set_num_sms(saved)
    check_tally("small ops", tally, N_SMALL, SMALL_ARGS)


CONFIG_ARGS = ["num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
               "num_max_rdma_chunked_send_tokens",
               "num_max_rdma_chunked_recv_tokens", "hidden_bytes", "num_ranks", "num_topk"]


def test_fuzz_config():
    """epx.Config's arguments and its buffer-size hints."""
    tally = Counter()

    @fuzz_settings(N_CONFIG)
    @given(st.data())
    def run(data):
        _, pb = data.draw(faults(CONFIG_ARGS))
        sms = data.draw(int_arg(st.integers(1, 33).map(lambda k: 2 * k), pb("num_sms")))
        send = data.draw(int_arg(st.integers(1, 64), pb("num_max_nvl_chunked_send_tokens")))
        recv = data.draw(int_arg(st.integers(64, 8192), pb("num_max_nvl_chunked_recv_tokens")))
        rdma = (data.draw(int_arg(st.just(6), pb("num_max_rdma_chunked_send_tokens"))),
                data.draw(int_arg(st.just(256), pb("num_max_rdma_chunked_recv_tokens"))))
        hidden_bytes = data.draw(int_arg(st.integers(1, 8192).map(lambda k: 2 * k),
                                         pb("hidden_bytes")))
        R = data.draw(int_arg(ranks, pb("num_ranks")))
        K = data.draw(int_arg(st.integers(1, 16), pb("num_topk")))
        v = Verdict()
        ring = (0, 2**20)  # the ring dispatch's sizes (0: EPX's own)
        vals = [rule_int(v, val, name, *bounds) for val, name, *bounds in
                ((sms, "num_sms"), (send, "num_max_nvl_chunked_send_tokens"),
                 (recv, "num_max_nvl_chunked_recv_tokens"),
                 (rdma[0], "num_max_rdma_chunked_send_tokens", ring),
                 (rdma[1], "num_max_rdma_chunked_recv_tokens", ring))]
        hb = rule_int(v, hidden_bytes, "hidden_bytes", (0, 2**64 - 1))
        r = rule_int(v, R, "num_ranks")
        k = rule_int(v, K, "num_topk")
        if not v.broken:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", epx.EPXIgnoredArgumentWarning)
                c = epx.Config(*vals)
            rule_config(v, c, r, sms=0)
            # More than 8 ranks: nodes of 8 (the internode hint), up to 160 ranks.
            across = r > 8
            v.flag(not (1 <= r <= 8 or (across and r % 8 == 0 and r <= 160)), "num_ranks")
            v.flag(not 0 < hb <= (2**30 if across else 2**32), "hidden_bytes")
            v.flag(not 1 <= k <= 16, "num_topk")

        def call():
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", epx.EPXIgnoredArgumentWarning)
                c = epx.Config(sms, send, recv, *rdma)
            assert c.get_nvl_buffer_size_hint(hidden_bytes, R, K) > 0
            assert c.get_rdma_buffer_size_hint(hidden_bytes, R) == 0
            raise Launched

        judge(tally, v, call, describe(sms=sms, send=send, recv=recv, rdma=rdma,
                                       hidden_bytes=hidden_bytes, R=R, K=K))

    run()
    check_tally("Config", tally, N_CONFIG, CONFIG_ARGS + ["config.num_sms",
                                                          "config.num_max_send_tokens",
                                                          "config.num_max_recv_tokens"])

"""CPU tests of scripts/scaling_model.py (docs/scaling.md): its expectations against
brute force over every routing of small cases, and invariants of the full-size model.
Standard library and pytest only."""

import importlib.util
import itertools
import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "scaling_model.py")
_spec = importlib.util.spec_from_file_location("scaling_model", SCRIPT)
sm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sm)


def scheme_rows(dest_ranks, sender, gpus_per_node):
    """Rows one token costs under the two-level scheme, counted from its definition:
    one network crossing per destination node other than the sender's, landing on the
    GPU with the sender's local index there; an NVLink store for every destination
    GPU that is neither that landing GPU nor the sender itself."""
    s_node, s_local = divmod(sender, gpus_per_node)
    nodes = {r // gpus_per_node for r in dest_ranks}
    rdma = sum(1 for m in nodes if m != s_node)
    landing = {m * gpus_per_node + s_local for m in nodes}  # includes the sender
    nvl = sum(1 for r in dest_ranks if r not in landing)
    return rdma, nvl


def brute_force(routings, ranks, gpus_per_node, experts):
    """Exact E|N|, E|R|, RDMA and NVLink rows per token over equally likely routings
    (each a set of experts), averaged over every sender rank."""
    per_rank = experts // ranks
    n = len(routings)
    e_nodes = e_ranks = rdma = nvl = 0.0
    for picked in routings:
        dest = {e // per_rank for e in picked}
        e_nodes += len({r // gpus_per_node for r in dest}) / n
        e_ranks += len(dest) / n
        for s in range(ranks):
            a, b = scheme_rows(dest, s, gpus_per_node)
            rdma += a / n / ranks
            nvl += b / n / ranks
    return e_nodes, e_ranks, rdma, nvl


@pytest.mark.parametrize("ranks,gpn,experts,topk", [(4, 2, 8, 2), (6, 2, 12, 3), (8, 4, 16, 4)])
def test_uniform_matches_brute_force(ranks, gpn, experts, topk):
    routings = list(itertools.combinations(range(experts), topk))
    bn, br, brdma, bnvl = brute_force(routings, ranks, gpn, experts)
    m = sm.model(ranks, tokens=1, hidden=128, topk=topk, experts=experts, gpus_per_node=gpn)
    assert m["dest_nodes"] == pytest.approx(bn, rel=1e-12)
    assert m["dest_ranks"] == pytest.approx(br, rel=1e-12)
    assert m["rdma_rows_per_token"] == pytest.approx(brdma, rel=1e-12)
    assert m["nvlink_rows_per_token"] == pytest.approx(bnvl, rel=1e-12)


def node_limited_routings(experts, nodes, limit, topk):
    """Every ranking of i.i.d. scores (all permutations), routed as DeepEP's test does:
    keep the `limit` nodes with the highest maximum score, then top-k of their experts."""
    per_node = experts // nodes
    out = []
    for scores in itertools.permutations(range(experts)):
        group_max = [max(scores[g * per_node:(g + 1) * per_node]) for g in range(nodes)]
        kept = sorted(range(nodes), key=lambda g: -group_max[g])[:limit]
        allowed = [e for e in range(experts) if e // per_node in kept]
        out.append(sorted(allowed, key=lambda e: -scores[e])[:topk])
    return out


def test_node_limited_monte_carlo_matches_brute_force():
    ranks, gpn, experts, topk, limit = 6, 2, 6, 2, 2  # 3 nodes, at most 2 per token
    routings = node_limited_routings(experts, ranks // gpn, limit, topk)
    bn, br, brdma, bnvl = brute_force(routings, ranks, gpn, experts)
    m = sm.model(ranks, tokens=1, hidden=128, topk=topk, experts=experts, gpus_per_node=gpn,
                 node_limit=limit, samples=40000)
    # 40000 samples: standard errors ~0.003 here.
    assert m["dest_nodes"] == pytest.approx(bn, abs=0.015)
    assert m["dest_ranks"] == pytest.approx(br, abs=0.015)
    assert m["rdma_rows_per_token"] == pytest.approx(brdma, abs=0.015)
    assert m["nvlink_rows_per_token"] == pytest.approx(bnvl, abs=0.015)
    assert bn < sm.model(ranks, topk=topk, experts=experts, gpus_per_node=gpn)["dest_nodes"]


def test_rdma_grows_with_nodes_toward_all_remote():
    rows = [sm.model(ep)["rdma_rows_per_token"] for ep in (16, 32, 64, 128, 256)]
    assert all(a < b for a, b in zip(rows, rows[1:]))
    assert rows[-1] < 8  # top-8: at most 8 crossings a token
    # One expert per node (the limit): every pick is its own node, k (n-1)/n crossings.
    m = sm.model(8, topk=4, experts=8, gpus_per_node=1)
    assert m["rdma_rows_per_token"] == pytest.approx(4 * 7 / 8)


def test_bytes_and_reported_bandwidth():
    for ep in (16, 32, 64):
        m = sm.model(ep)
        o = m["ops"]
        assert o["dispatch_fp8"]["rdma_bytes"] / o["dispatch_bf16"]["rdma_bytes"] == \
            pytest.approx((1 + 4 / 128) / 2)
        assert o["combine_bf16"]["rdma_bytes"] == o["dispatch_bf16"]["rdma_bytes"]
        n = m["nodes"]
        for op in o.values():
            assert op["t_bound_us"] == max(op["t_rdma_us"], op["t_nvlink_us"])
            if op["bound_by"] == "RDMA":  # DeepEP counts its own node: 50 n/(n-1) at line rate
                assert op["deepep_rdma_gbps"] == pytest.approx(50 * n / (n - 1))
        # Node-limited routing never exceeds its limit and crosses the network less.
        lim = sm.model(ep, node_limit=4, samples=5000)
        assert lim["dest_nodes"] <= min(4, n) + 1e-9
        assert lim["rdma_rows_per_token"] <= m["rdma_rows_per_token"] + 1e-9
    # A slow NVLink makes EP16 NVLink-bound (DeepEP's explanation of its H800 EP16 figure).
    assert sm.model(16, nvlink_gbps=160)["ops"]["dispatch_fp8"]["bound_by"] == "NVLink"


def test_needs_at_ceiling_is_line_rate():
    m = sm.model(32)
    ceiling = 50 * 4 / 3
    n = sm.needs(m, "dispatch_fp8", ceiling)
    assert n["nic_fraction"] == pytest.approx(1.0)
    assert n["time_us"] == pytest.approx(m["ops"]["dispatch_fp8"]["t_rdma_us"])


def test_cli_markdown_and_json():
    out = subprocess.run([sys.executable, SCRIPT, "--ep", "16", "32"], check=True,
                         capture_output=True, text=True).stdout
    assert "| EP | nodes |" in out and out.count("| 16 |") == 3
    data = json.loads(subprocess.run([sys.executable, SCRIPT, "--json", "--ep", "64"], check=True,
                                     capture_output=True, text=True).stdout)
    assert [r["node_limit"] for r in data["rows"]] == [None, 4]
    out = subprocess.run([sys.executable, SCRIPT, "--needs"], check=True,
                         capture_output=True, text=True).stdout
    assert "NIC line rate needed" in out

#!/usr/bin/env python3
"""A bandwidth model of two-level (RDMA + NVLink) high-throughput dispatch and combine.

Usage: scripts/scaling_model.py [--json] [--ep 16 32 64] [--nvlink-gbps 343] ...

EPX has no NIC to measure on (one host; its "network" there is a copy engine),
so this model stands in for cluster measurements. docs/scaling.md explains it.

The scheme (DeepEP V1's normal kernels, and what EPX would implement): a token
crosses the network once per destination node other than its own, to the GPU
with the sender's local index on that node, which forwards it over NVLink to
the destination GPUs there; destinations on the sender's own node get it over
NVLink directly. Combine is the same traffic in reverse (rows reduced inside a
node before they cross the network), always BF16.

Per token, with W = ranks, n = nodes, G = GPUs per node, |N| = distinct
destination nodes and |R| = distinct destination ranks:
  rows over RDMA  = |N| - [own node in N]           (expected |N| (n-1)/n)
  rows over NVLink = |R| - #{m in N: GPU (m, local) in R}  (expected |R| (G-1)/G)
Both expectations use only that routing is symmetric over nodes and over local
indices, so they hold for uniform top-k and for node-limited (group) top-k.

The lower bound on time is max(RDMA bytes / NIC rate, NVLink bytes / NVLink
rate): perfect overlap, line rate, uniform load. DeepEP's tests report
"RDMA bandwidth" as T * E|N| * row / time, counting the own node's rows too
(tests/legacy/test_internode.py), and "NVL bandwidth" as received rows * row /
time; the model reports both for its bound so they sit beside published figures.

No dependencies beyond the standard library.
"""

import argparse
import json
import random
import sys
from math import comb

# Bytes of one row as DeepEP V1's test counts them: BF16 2*H; FP8 H + one FP32
# scale per 128 values (fp8_factor = (1 + 4/128) / 2 of BF16). No top-k ids or
# weights (DeepEP V2's test adds them: +96 bytes a row with int64 ids, ~1.3% of FP8).
def row_bytes(hidden, fmt):
    if fmt == "bf16":
        return 2 * hidden
    if fmt == "fp8":
        return hidden + hidden // 128 * 4
    raise ValueError(fmt)


def p_hit(experts, topk, group):
    """P(a given block of `group` experts holds at least one of top-k uniform distinct picks)."""
    return 1.0 - comb(experts - group, topk) / comb(experts, topk)


def expected_counts(ranks, gpus_per_node, experts, topk, node_limit=None,
                    samples=20000, seed=1):
    """(E|N|, E|R|) per token: distinct destination nodes and ranks.

    node_limit None (or >= nodes): top-k uniform over all experts, exact.
    Otherwise DeepEP's test routing: i.i.d. scores, the node_limit nodes with the
    highest per-node maximum are kept, top-k among their experts; Monte Carlo
    with a fixed seed (i.i.d. scores make the ranking a uniform permutation).
    """
    if ranks % gpus_per_node or experts % ranks:
        raise ValueError("ranks must fill nodes and divide experts")
    nodes = ranks // gpus_per_node
    if node_limit is None or node_limit >= nodes:
        return (nodes * p_hit(experts, topk, experts // nodes),
                ranks * p_hit(experts, topk, experts // ranks))
    per_node, per_rank = experts // nodes, experts // ranks
    rng = random.Random(seed)
    perm = list(range(experts))
    sum_nodes = sum_ranks = 0
    for _ in range(samples):
        rng.shuffle(perm)  # perm[0] has the highest score
        kept, picked_ranks, taken = set(), set(), 0
        for e in perm:
            node = e // per_node
            if node not in kept:
                # An expert's node has its maximum at or before it, so a node
                # not kept yet is met here for the first time.
                if len(kept) == node_limit:
                    continue
                kept.add(node)
            picked_ranks.add(e // per_rank)
            taken += 1
            if taken == topk:
                break
        sum_nodes += len({r // gpus_per_node for r in picked_ranks})
        sum_ranks += len(picked_ranks)
    return sum_nodes / samples, sum_ranks / samples


def model(ep, *, tokens=4096, hidden=7168, topk=8, experts=256, gpus_per_node=8,
          nic_gbps=50.0, nvlink_gbps=343.0, node_limit=None, samples=20000):
    nodes = ep // gpus_per_node
    e_nodes, e_ranks = expected_counts(ep, gpus_per_node, experts, topk, node_limit, samples)
    rdma_rows = e_nodes * (nodes - 1) / nodes      # per token, network crossings
    nvl_rows = e_ranks * (gpus_per_node - 1) / gpus_per_node  # per token, NVLink stores
    out = {"ep": ep, "nodes": nodes,
           "node_limit": node_limit if node_limit is not None and node_limit < nodes else None,
           "dest_nodes": e_nodes, "dest_ranks": e_ranks,
           "rdma_rows_per_token": rdma_rows, "nvlink_rows_per_token": nvl_rows,
           "nic_gbps": nic_gbps, "nvlink_gbps": nvlink_gbps, "ops": {}}
    for op, fmt in (("dispatch_bf16", "bf16"), ("dispatch_fp8", "fp8"), ("combine_bf16", "bf16")):
        row = row_bytes(hidden, fmt)
        rdma = tokens * rdma_rows * row
        nvl = tokens * nvl_rows * row
        t_rdma, t_nvl = rdma / (nic_gbps * 1e9), nvl / (nvlink_gbps * 1e9)
        t = max(t_rdma, t_nvl)
        out["ops"][op] = {
            "row_bytes": row, "rdma_bytes": rdma, "nvlink_bytes": nvl,
            "t_rdma_us": t_rdma * 1e6, "t_nvlink_us": t_nvl * 1e6, "t_bound_us": t * 1e6,
            "bound_by": "RDMA" if t_rdma >= t_nvl else "NVLink",
            # What DeepEP's test counts, and would print at this time.
            "deepep_rdma_bytes": tokens * e_nodes * row,
            "deepep_rdma_gbps": tokens * e_nodes * row / t / 1e9,
            "deepep_nvl_gbps": tokens * e_ranks * row / t / 1e9,
        }
    return out


def needs(m, op, published_gbps):
    """What a run must reach for DeepEP's test to print `published_gbps` "RDMA" for op
    under model m: the time, the fraction of NIC line rate, the NVLink store rate."""
    o = m["ops"][op]
    t = o["deepep_rdma_bytes"] / (published_gbps * 1e9)
    return {"time_us": t * 1e6,
            "nic_fraction": o["rdma_bytes"] / t / 1e9 / m["nic_gbps"],
            "nvlink_gbps": o["nvlink_bytes"] / t / 1e9}


# Published internode figures in DeepEP's "RDMA" unit (GB/s), FP8 dispatch and BF16
# combine, 4096 tokens per rank unless noted; docs/scaling.md gives the systems.
V1 = "https://github.com/deepseek-ai/DeepEP/blob/main/docs/legacy.md"
PR521 = "https://github.com/deepseek-ai/DeepEP/pull/521 (README-NCCL.md)"
V2 = "https://github.com/deepseek-ai/DeepEP/blob/main/README.md"
UCCL = "https://github.com/uccl-project/uccl/blob/main/ep/README.md"
PUBLISHED = [
    # (system, ep, dispatch_fp8, combine_bf16, source)
    ("DeepEP V1, H800 + CX7 400G", 16, 43, 43, V1),
    ("DeepEP V1, H800 + CX7 400G", 32, 58, 57, V1),
    ("DeepEP V1, H800 + CX7 400G", 64, 51, 50, V1),
    ("DeepEP V1 NVSHMEM, H100 + IB 400G", 16, 79.7, 66.4, PR521),
    ("DeepEP V1 NVSHMEM, H100 + IB 400G", 32, 62.9, 62.9, PR521),
    ("DeepEP V1 NVSHMEM, H100 + IB 400G", 64, 53.5, 53.2, PR521),
    ("DeepEP V1 NCCL GIN, H100 + IB 400G", 16, 76.9, 66.2, PR521),
    ("DeepEP V1 NCCL GIN, H100 + IB 400G", 32, 61.7, 62.3, PR521),
    ("DeepEP V1 NCCL GIN, H100 + IB 400G", 64, 52.7, 52.9, PR521),
    ("DeepEP V2 (NCCL GIN), SM90 + CX7, 8K tokens, 12 SMs", 16, 90, 81, V2),
    ("DeepEP V2 (NCCL GIN), SM90 + CX7, 8K tokens, 6 SMs", 32, 61, 61, V2),
    ("UCCL-EP, H200 + 2x200G EFA (p5en)", 16, 50, 18, UCCL),
    ("UCCL-EP, H200 + 2x200G EFA (p5en)", 32, 54, 43, UCCL),
    ("UCCL-EP, B200 + 400G EFA (p6-b200)", 16, 53, 60, UCCL),
    ("UCCL-EP, B200 + 400G EFA (p6-b200)", 32, 53, 57, UCCL),
]


def needs_table(kw, groups=4):
    """Per published figure: the share of NIC line rate and the NVLink store rate a
    two-level implementation must sustain to print it (DeepEP's test routing)."""
    lines = ["| system | EP | op | published GB/s | model ceiling GB/s | NIC line rate needed | "
             "NVLink GB/s needed |", "|---|---|---|---|---|---|---|"]
    cache = {}
    for system, ep, disp, comb_, _src in PUBLISHED:
        if ep not in cache:
            cache[ep] = model(ep, node_limit=groups or None, **kw)
        m = cache[ep]
        ceiling = m["nic_gbps"] * m["nodes"] / (m["nodes"] - 1)
        for op, v in (("dispatch_fp8", disp), ("combine_bf16", comb_)):
            n = needs(m, op, v)
            lines.append(f"| {system} | {ep} | {op} | {v:g} | {ceiling:.1f} | "
                         f"{100 * n['nic_fraction']:.0f}% | {n['nvlink_gbps']:.0f} |")
    return "\n".join(lines)


def table(rows):
    head = ("| EP | nodes | routing | dest nodes | op | RDMA MB/GPU | NVLink MB/GPU | "
            "t_RDMA us | t_NVLink us | bound us | by | DeepEP \"RDMA\" GB/s | DeepEP \"NVL\" GB/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for m in rows:
        routing = "uniform" if m["node_limit"] is None else f"<= {m['node_limit']} nodes"
        for op, o in m["ops"].items():
            lines.append(
                f"| {m['ep']} | {m['nodes']} | {routing} | {m['dest_nodes']:.3f} | {op} | "
                f"{o['rdma_bytes'] / 1e6:.1f} | {o['nvlink_bytes'] / 1e6:.1f} | "
                f"{o['t_rdma_us']:.0f} | {o['t_nvlink_us']:.0f} | {o['t_bound_us']:.0f} | "
                f"{o['bound_by']} | {o['deepep_rdma_gbps']:.1f} | {o['deepep_nvl_gbps']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ep", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--nic-gbps", type=float, default=50.0,
                    help="NIC rate per GPU per direction, GB/s (400 Gb/s = 50)")
    ap.add_argument("--nvlink-gbps", type=float, default=343.0,
                    help="NVLink store rate per GPU, GB/s (343: EPX's probe on H200, 8 SMs)")
    ap.add_argument("--deepep-groups", type=int, default=4,
                    help="also model DeepEP's test routing, <= this many nodes a token "
                         "(its default min(nodes, 4)); 0 to skip")
    ap.add_argument("--samples", type=int, default=20000, help="Monte Carlo samples (node-limited)")
    ap.add_argument("--needs", action="store_true",
                    help="print what matching each published figure takes instead")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    kw = dict(tokens=a.tokens, hidden=a.hidden, topk=a.topk, experts=a.experts,
              gpus_per_node=a.gpus_per_node, nic_gbps=a.nic_gbps, nvlink_gbps=a.nvlink_gbps,
              samples=a.samples)
    if a.needs:
        print(needs_table(kw, a.deepep_groups))
        return 0
    rows = []
    for ep in a.ep:
        rows.append(model(ep, **kw))
        if a.deepep_groups and ep // a.gpus_per_node > a.deepep_groups:
            rows.append(model(ep, node_limit=a.deepep_groups, **kw))
    if a.json:
        json.dump({"params": vars(a), "rows": rows}, sys.stdout, indent=1)
        print()
    else:
        print(f"{a.tokens} tokens/rank, hidden {a.hidden}, top-{a.topk} of {a.experts}, "
              f"{a.gpus_per_node} GPUs/node, NIC {a.nic_gbps:g} GB/s, NVLink {a.nvlink_gbps:g} GB/s per GPU\n")
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

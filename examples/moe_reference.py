"""Single-process NumPy reference of the MoE layer in moe_layer.py.

Dense and plain: every expert is applied to every token, and each token's
output is the sum over its top-k experts of weight * expert(x). No
communication, no grouping, no PyTorch. The weights come from a seeded NumPy
generator and are rounded to BF16-representable values, so the BF16 copies the
layer makes of them on the GPU are exact.

Expert e: ``silu(x @ w1[e]) @ w2[e]`` with w1 [E, H, I], w2 [E, I, H].
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np


def round_bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest BF16 value (ties to even), as float32.
    Finite inputs only."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def expert_weights(seed: int, num_experts: int, hidden: int, intermediate: int
                   ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gate [H, E], w1 [E, H, I], w2 [E, I, H]) float32, BF16-representable, scaled so
    that activations stay O(1)."""
    rng = np.random.default_rng(seed)
    gate = rng.standard_normal((hidden, num_experts), dtype=np.float32) / np.sqrt(hidden)
    w1 = rng.standard_normal((num_experts, hidden, intermediate), dtype=np.float32)
    w2 = rng.standard_normal((num_experts, intermediate, hidden), dtype=np.float32)
    w1 /= np.sqrt(hidden)
    w2 /= np.sqrt(intermediate)
    return round_bf16(gate), round_bf16(w1), round_bf16(w2)


def random_tokens(seed: int, num_tokens: int, hidden: int) -> np.ndarray:
    """[T, H] float32, BF16-representable, standard normal."""
    rng = np.random.default_rng(seed)
    return round_bf16(rng.standard_normal((num_tokens, hidden), dtype=np.float32))


def silu(a: np.ndarray) -> np.ndarray:
    return a / (1.0 + np.exp(-a))


def moe_forward(x: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray,
                w1: np.ndarray, w2: np.ndarray) -> np.ndarray:
    """Dense MoE in float64: x [T, H], topk_idx [T, K] (global expert ids, -1 = none),
    topk_weights [T, K] -> [T, H] = sum_k weight[t, k] * expert_{idx[t, k]}(x[t])."""
    x = np.asarray(x, np.float64)
    topk_idx = np.asarray(topk_idx)
    topk_weights = np.asarray(topk_weights, np.float64)
    T, H = x.shape
    E = w1.shape[0]
    if topk_idx.size and (topk_idx.max() >= E or topk_idx.min() < -1):
        raise ValueError(f"topk_idx: expert ids must be in [-1, {E}), got "
                         f"[{topk_idx.min()}, {topk_idx.max()}]")
    out = np.zeros((T, H), np.float64)
    for e in range(E):
        coef = np.where(topk_idx == e, topk_weights, 0.0).sum(axis=1)  # [T]
        y = silu(x @ np.asarray(w1[e], np.float64)) @ np.asarray(w2[e], np.float64)
        out += coef[:, None] * y
    return out


def fp8_roundtrip(x: np.ndarray) -> np.ndarray:
    """What a low-latency FP8 dispatch delivers for BF16 tokens x [T, H]: the tokens
    quantized to e4m3 with per-128-channel scales, dequantized (float32). Uses the EPX
    reference model, which matches the kernels bit for bit."""
    from epx import reference as ref

    q, scales = ref.quantize_fp8(np.asarray(x, np.float32))
    return ref.dequantize_fp8(q, scales)


def compare(got: np.ndarray, want: np.ndarray, rtol: float = 2.0 ** -5) -> Optional[str]:
    """None when ``got`` matches ``want`` to BF16 accuracy, else a message.

    Element-wise ``|got - want| <= rtol * (|want| + rms(want))`` and a relative error of
    the whole tensor ``||got - want|| / ||want|| <= rtol / 2``. BF16 keeps 8 bits of
    mantissa (relative step 2^-8), and the layer rounds a few times; a token that
    misses one of its experts, a wrong weight or a wrong row is off by far more.
    """
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape:
        return f"shape {got.shape} != expected {want.shape}"
    if not np.isfinite(got).all():
        bad = np.argwhere(~np.isfinite(got))
        return f"{len(bad)} non-finite values, first at {tuple(bad[0])}"
    scale = float(np.sqrt(np.mean(want ** 2))) if want.size else 0.0
    if want.size and scale == 0.0:
        return "the expected output is all zeros: the check would prove nothing"
    err = np.abs(got - want)
    bound = rtol * (np.abs(want) + scale)
    if (err > bound).any():
        i = np.unravel_index(np.argmax(err - bound), err.shape)
        return (f"{int((err > bound).sum())} of {err.size} values out of tolerance; worst at "
                f"{tuple(int(v) for v in i)}: got {got[i]:.6g}, expected {want[i]:.6g}")
    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want)) if want.size else 0.0
    if rel > rtol / 2:
        return f"relative error {rel:.3g} > {rtol / 2:.3g}"
    return None

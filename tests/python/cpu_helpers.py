"""What the CPU test files share: independent NumPy models of EPX's numerics and
routing, their generator, and a clean-interpreter runner."""

import subprocess
import sys

import numpy as np

RNG = np.random.default_rng(1234)


def np_bf16_bits(x):
    """float32 -> bf16 bits with round-to-nearest-even, via float64 arithmetic."""
    x = np.asarray(x, np.float32)
    u = x.view(np.uint32).astype(np.int64)
    upper, lower = u >> 16, u & 0xFFFF
    up = (lower > 0x8000) | ((lower == 0x8000) & (upper & 1 == 1))
    return (upper + up).astype(np.uint16)


def np_bf16_float(bits):
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def _fp8_values():
    """The finite FP8 e4m3fn values of bytes 0..255 (NaN at 0x7F and 0xFF)."""
    vals = np.empty(256, np.float64)
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 15, b & 7
        v = m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        vals[b] = -v if s else v
    vals[0x7F] = vals[0xFF] = np.nan
    return vals


FP8 = _fp8_values()


def np_fp8_bits(x):
    """Round to nearest e4m3fn (ties to even mantissa), saturating at +-448."""
    out = np.empty(np.shape(x), np.uint8)
    pos = FP8[:0x7F]  # 0x00..0x7E, increasing
    for i, v in np.ndenumerate(np.asarray(x, np.float64)):
        a = min(abs(v), 448.0)
        j = int(np.searchsorted(pos, a))
        if j < len(pos) and pos[j] == a:
            b = j
        else:
            lo, hi = j - 1, j
            dl, dh = a - pos[lo], pos[hi] - a
            b = lo if dl < dh or (dl == dh and lo % 2 == 0) else hi
        out[i] = b | (0x80 if v < 0 or (v == 0 and np.signbit(v)) else 0)
    return out


def np_quantize(x, round_scale=False):
    x = np.asarray(x, np.float32)
    T, H = x.shape
    g = x.reshape(T, H // 128, 128)
    amax = np.maximum(np.abs(g).max(-1), np.float32(1e-4))
    scale = (amax / np.float32(448.0)).astype(np.float32)
    if round_scale:
        scale = (2.0 ** np.ceil(np.log2(scale.astype(np.float64)))).astype(np.float32)
    q = np_fp8_bits((g / scale[..., None]).astype(np.float32)).reshape(T, H)
    return q, scale


def np_layout(topk_idx, E, R):
    T = topk_idx.shape[0]
    per_expert = np.zeros(E, np.int32)
    in_rank = np.zeros((T, R), bool)
    for t in range(T):
        for e in set(int(e) for e in topk_idx[t] if e >= 0):
            per_expert[e] += 1
            in_rank[t, e // (E // R)] = True
    return in_rank.sum(0).astype(np.int32), per_expert, in_rank


def random_topk(T, K, E, drop=0.1):
    idx = np.stack([RNG.choice(E, K, replace=False) for _ in range(T)]) if T else np.zeros((0, K))
    idx = idx.astype(np.int64)
    idx[RNG.random(idx.shape) < drop] = -1
    return idx


def random_bf16(shape, scale=1.0):
    return np_bf16_bits((RNG.standard_normal(shape) * scale).astype(np.float32))


def _run_clean(code):
    """Runs `code` in a fresh interpreter with this one's sys.path and a minimal
    environment; fails the test with the child's stderr when it exits non-zero."""
    env_path = [p for p in sys.path if p]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"PYTHONPATH": ":".join(env_path), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr

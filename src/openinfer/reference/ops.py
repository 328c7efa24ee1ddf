"""fp32 NumPy reference ops: the oracle for the CUDA kernels.

Shapes: T tokens, H hidden, nH query heads, nKV KV heads, D head_dim, V vocab. KV cache layout
(docs/architecture.md): [num_blocks][num_layers][2 (K, V)][nKV][block_size][D].
"""
from __future__ import annotations

import numpy as np

F32 = np.float32


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(F32, copy=False)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + F32(eps)) * w


def add_rmsnorm(x: np.ndarray, residual: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """Fused residual add + RMSNorm: returns (rmsnorm(x + residual), x + residual)."""
    r = x + residual
    return rmsnorm(r, w, eps), r


def rope_cos_sin(positions: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, D/2]; angles in float64 so the oracle stays exact at long positions."""
    inv_freq = float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    return np.cos(ang).astype(F32), np.sin(ang).astype(F32)


def rope_neox(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, heads, D]; rotate halves (not interleaved)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def qk_norm_rope(q, k, q_norm_w, k_norm_w, positions, theta: float, eps: float):
    """Per-head RMSNorm over D, then neox RoPE. q [T, nH, D], k [T, nKV, D]."""
    cos, sin = rope_cos_sin(positions, q.shape[-1], theta)
    return rope_neox(rmsnorm(q, q_norm_w, eps), cos, sin), rope_neox(rmsnorm(k, k_norm_w, eps), cos, sin)


def kv_write(cache: np.ndarray, layer: int, k: np.ndarray, v: np.ndarray, slot_mapping: np.ndarray) -> None:
    """Stores K/V [T, nKV, D] at their slots; slot -1 rows are skipped."""
    bs = cache.shape[4]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].astype(np.int64)
    blk, off = slots // bs, slots % bs
    # advanced indices (blk, off) around the head slice put the token axis first: [t, nKV, D]
    cache[blk, layer, 0, :, off, :] = k[keep]
    cache[blk, layer, 1, :, off, :] = v[keep]


# Row-invariant BLAS calls: OpenBLAS picks its kernel, blocking and threads from the matrix's shape, so a
# row's sums round differently with the number of rows beside it (even past 16). Every product runs as a
# stack of MIN_ROWS-row matrices (the last one padded), so each row is computed by a call of one shape
# whatever the step: what keeps a prompt's results independent of how it was cut into steps and batched.
MIN_ROWS = 16
SEGMENT = 256  # keys per attention segment: the sums over keys run segment by segment, in order


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [M, K] @ w[N, K].T, each row's result the same whatever M (MIN_ROWS rows per BLAS call)."""
    m = len(x)
    if m == 0:
        return np.zeros((0, w.shape[0]), np.result_type(x, w))
    mp = -(-m // MIN_ROWS) * MIN_ROWS
    if mp != m:
        xp = np.zeros((mp, x.shape[1]), x.dtype)
        xp[:m] = x
    else:
        xp = np.ascontiguousarray(x)
    return np.matmul(xp.reshape(mp // MIN_ROWS, MIN_ROWS, -1), w.T).reshape(mp, -1)[:m]


def paged_attention(q: np.ndarray, cache: np.ndarray, layer: int, positions: np.ndarray,
                    query_start_loc: np.ndarray, context_lens: np.ndarray, block_tables: np.ndarray) -> np.ndarray:
    """Causal GQA attention over each sequence's cached tokens. q [T, nH, D] -> [T, nH, D].

    Query token i of sequence b sees cache positions 0..positions[i] (of its own block table). A row's
    result does not depend on the other rows of the step or on the context length beyond its position:
    keys are padded to whole SEGMENTs, the query rows to MIN_ROWS, and the sums over keys run per segment
    (fixed shapes), folded in segment order.
    """
    T, nH, D = q.shape
    nKV, bs = cache.shape[3], cache.shape[4]
    g = nH // nKV
    out = np.zeros_like(q)
    scale = F32(1.0 / np.sqrt(D))
    for b in range(len(context_lens)):
        s, e, n = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(context_lens[b])
        if e == s or n == 0:
            continue
        t, nseg = e - s, -(-n // SEGMENT)
        blocks = block_tables[b, :-(-n // bs)]
        kv = cache[blocks, layer]  # [nb, 2, nKV, bs, D]
        kv = kv.transpose(1, 2, 0, 3, 4).reshape(2, nKV, -1, D)[:, :, :n]  # [2, nKV, n, D]
        kv = np.concatenate([kv, np.zeros((2, nKV, nseg * SEGMENT - n, D), kv.dtype)], 2)
        R = MIN_ROWS
        tp = -(-t // R) * R
        qb = np.zeros((nKV, g, tp, D), F32)
        qb[:, :, :t] = q[s:e].reshape(t, nKV, g, D).transpose(1, 2, 0, 3)
        qb = qb.reshape(nKV, g, tp // R, R, D)
        pos = np.full(tp, -1)
        pos[:t] = positions[s:e]
        keys = kv[0].reshape(nKV, nseg, SEGMENT, D)
        # every product below is a stack of [R, D] @ [D, SEGMENT] or [R, SEGMENT] @ [SEGMENT, D] matrices
        scores = np.empty((nKV, g, tp // R, R, nseg, SEGMENT), F32)
        for j in range(nseg):
            scores[..., j, :] = qb @ keys[:, None, None, j].swapaxes(-1, -2)
        scores *= scale
        masked = np.arange(nseg * SEGMENT).reshape(nseg, SEGMENT)[None] > pos.reshape(tp // R, R)[..., None, None]
        scores = np.where(masked, F32(-np.inf), scores)
        m = scores.max((-2, -1), keepdims=True)
        p = np.exp(scores - np.where(np.isfinite(m), m, F32(0)))  # padding rows: all -inf, p = 0
        num, den = np.zeros((nKV, g, tp // R, R, D), F32), np.zeros((nKV, g, tp // R, R), F32)
        for j in range(nseg):
            den += p[..., j, :].sum(-1)
            num += p[..., j, :] @ kv[1][:, None, None, j * SEGMENT:(j + 1) * SEGMENT]
        num, den = num.reshape(nKV, g, tp, D), den.reshape(nKV, g, tp)
        o = num[:, :, :t] / den[:, :, :t, None]
        out[s:e] = o.transpose(2, 0, 1, 3).reshape(t, nH, D)
    return out


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return gate / (F32(1) + np.exp(-gate)) * up


# ---- sampling (docs/architecture.md, "Sampling") ----
_U64 = np.uint64


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, wrapping uint64 arithmetic."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> _U64(30))
        x = x * _U64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> _U64(27))
        x = x * _U64(0x94D049BB133111EB)
        return x ^ (x >> _U64(31))


def gumbel_noise(seed: int, pos: int, vocab: int) -> np.ndarray:
    """g_i = -log(-log(u_i)) for i < vocab, u from the counter hash of (seed, pos, i); float32."""
    with np.errstate(over="ignore"):
        base = _U64(seed) * _U64(0x9E3779B97F4A7C15) + _U64(pos + 1) * _U64(0xD1B54A32D192ED03)
        h = mix64(base + np.arange(vocab, dtype=_U64))
    u = ((h >> _U64(41)).astype(F32) + F32(0.5)) * F32(2.0 ** -23)  # exact: u < 1 always
    with np.errstate(divide="ignore"):
        return -np.log(-np.log(u))


def keep_mask(l: np.ndarray, top_p: float, top_k: int) -> np.ndarray:
    """Tokens that survive top-k then top-p (ties at either threshold are kept)."""
    V = l.shape[0]
    keep = np.ones(V, dtype=bool)
    if 0 < top_k < V:
        keep = l >= np.partition(l, V - top_k)[V - top_k]
    if top_p < 1.0:
        lk = l[keep]
        p = np.exp(lk - lk.max())
        p /= p.sum()
        ps = np.sort(p)[::-1]
        k = min(int(np.searchsorted(np.cumsum(ps), F32(top_p))), len(ps) - 1)  # first cumsum >= top_p
        keep[keep] = p >= ps[k]
    return keep


def sample(logits: np.ndarray, temperature: np.ndarray, top_p: np.ndarray, top_k: np.ndarray,
           seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """One token per row of logits [S, V]; positions are those of the sampled rows."""
    out = np.empty(len(logits), dtype=np.int32)
    for r, row in enumerate(logits):
        t = float(temperature[r])
        if t <= 0:
            out[r] = np.argmax(row)  # first maximum: lowest id on ties
            continue
        l = row / F32(t)
        keep = keep_mask(l, float(top_p[r]), int(top_k[r]))
        score = np.where(keep, l + gumbel_noise(int(seeds[r]), int(positions[r]), len(row)), F32(-np.inf))
        out[r] = np.argmax(score)
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    m = logits.max(-1, keepdims=True)
    z = logits - m
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def top_logprobs(lp: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-n ids (descending, lowest id first on ties) and their log-probs, per row."""
    ids = np.argsort(-lp, axis=-1, kind="stable")[:, :n].astype(np.int32)
    return ids, np.take_along_axis(lp, ids, axis=-1).astype(F32)

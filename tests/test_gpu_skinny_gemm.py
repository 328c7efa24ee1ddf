"""skinny_gemm (csrc/gemm/skinny_gemm.cu): the wgmma + TMA GEMM for 1-64 rows, against the NumPy fp32 reference.

Read the layout tests first when something fails: with one-hot inputs or weights every output is a single exact
product, so a wrong shared-memory descriptor, swizzle, TMA box or coordinate, accumulator mapping or split range shows
up as an output that picked the wrong element, and the message names the first wrong (m, n) and what it read instead:
  - test_layout_weight_rows / _weight_k: the A operand (weights) and the output columns;
  - test_layout_input_rows / _input_k: the B operand (input rows) and the output rows;
  - test_layout_stages_and_splits: K offsets across ring stages and splits, the cluster reduction, edge tiles.
OPENINFER_TEST_SKINNY_DEBUG=1 (with pytest -s) prints for every check a map of which rows and 64-column blocks are wrong.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from openinfer.reference import ops as ref
from openinfer.safetensors_io import bf16_to_f32, f32_to_bf16
from gpu_util import TOL, f32, rand_bf16, rel_err, requires_gpu

pytestmark = requires_gpu

DEBUG = os.environ.get("OPENINFER_TEST_SKINNY_DEBUG", "") not in ("", "0")
V = 151936
GEMMS = {  # (N, K) of each projection
    "4b": [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)],
    "8b": [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)],
    "32b": [(10240, 5120), (5120, 8192), (51200, 5120), (5120, 25600)],
}
ALL_M = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64]


def ops():
    from openinfer import _engine
    return _engine.ops


def skinny(x, w, M, N, K, y0=None, out_f32=False, silu_up=False, splits=0, graph_replays=0):
    got = ops().skinny_gemm(x, w, M, N, K, y0, out_f32, silu_up, splits, graph_replays)
    assert got is not None, f"skinny_gemm refused M={M} N={N} K={K}"
    return got


def bf(a) -> np.ndarray:
    return f32_to_bf16(np.asarray(a, np.float32))


def error_map(got: np.ndarray, want: np.ndarray, bad: np.ndarray) -> str:
    """Which input rows and which 64-column blocks hold wrong outputs (a row pattern points at the B operand or the
    X box, a block pattern at the A operand, a W box or a tile edge, everything at the descriptors)."""
    rows = np.flatnonzero(bad.any(axis=1)).tolist()
    blocks = [b for b in range(-(-bad.shape[1] // 64)) if bad[:, 64 * b:64 * (b + 1)].any()]
    return (f"  wrong rows m: {rows[:64]}\n  wrong 64-column blocks: {blocks[:64]}\n"
            f"  wrong per row: {bad.sum(axis=1).tolist()[:64]}")


def check_exact(got: np.ndarray, want: np.ndarray, what: str, decode=None):
    """Bit-for-bit; on failure the first wrong (m, n), and `decode(m, n, value)` says what the value means."""
    bad = got != want
    if DEBUG:
        print(f"[skinny {what}] {int(bad.sum())} of {bad.size} wrong\n{error_map(got, want, bad)}")
    if not bad.any():
        return
    m, n = (int(v) for v in np.argwhere(bad)[0])
    msg = (f"{what}: {int(bad.sum())} of {bad.size} outputs wrong; first (m={m}, n={n}): got {float(got[m, n])}, "
           f"want {float(want[m, n])}")
    if decode is not None:
        msg += f" ({decode(m, n, got[m, n])})"
    pytest.fail(msg + "\n" + error_map(got, want, bad))


def check_close(got: np.ndarray, want: np.ndarray, tol: float, what: str):
    """The suite's relative Frobenius error; on failure the first (m, n) off by more than a few bf16 roundings."""
    err = rel_err(got, want)
    scale = float(np.sqrt(np.mean(np.square(want, dtype=np.float64)))) or 1.0
    bad = np.abs(np.asarray(got, np.float64) - want) > 4 * 2.0 ** -8 * (np.abs(want) + scale)
    if DEBUG:
        print(f"[skinny {what}] rel_err {err:.2e} (tol {tol:.0e}), {int(bad.sum())} outliers\n{error_map(got, want, bad)}")
    if err < tol:
        return
    first = ""
    if bad.any():
        m, n = (int(v) for v in np.argwhere(bad)[0])
        first = f"; first outlier (m={m}, n={n}): got {float(got[m, n])}, want {float(want[m, n])}\n" + error_map(
            got, want, bad)
    pytest.fail(f"{what}: rel_err {err:.3e} >= {tol:.0e}, {int(bad.sum())} of {bad.size} outliers{first}")


# ---- layout: one tile (128 weight rows), one 64-wide K block, exact products ----

def _one_hot(rows: int, cols: int, pos) -> np.ndarray:
    a = np.zeros((rows, cols), np.float32)
    a[np.arange(rows), pos] = 1.0
    return bf(a)


@pytest.mark.parametrize("M,N", [(8, 64), (8, 128), (64, 128)])
def test_layout_weight_rows(M, N):
    """W[n, k] = n + 1 (every k), X[m] one-hot: Y[m, n] = n + 1. Which weight row reached output column n. The
    smallest case (8 x 64 x 64) is one wgmma row block, one stage, one split."""
    K = 64
    w = bf(np.repeat(np.arange(1, N + 1, dtype=np.float32)[:, None], K, axis=1))
    for shift in range(0, 64, 8):
        q = (9 * np.arange(M) + shift) % K  # 9 is prime to 64: M = 64 puts a one at every k
        got = f32(skinny(_one_hot(M, K, q), w, M, N, K))
        want = np.tile(np.arange(1, N + 1, dtype=np.float32), (M, 1))
        check_exact(got, want, f"weight rows M={M} shift={shift}",
                    lambda m, n, v: f"output column n read weight row {v - 1:g}")


@pytest.mark.parametrize("M", [8, 64])
def test_layout_weight_k(M):
    """W[n, k] = k + 1, X[m] one-hot at q(m): Y[m, n] = q(m) + 1. Whether the weights' K positions line up with the
    inputs' (the two operands' swizzles and 16-wide K steps agree)."""
    N, K = 128, 64
    w = bf(np.tile(np.arange(1, K + 1, dtype=np.float32), (N, 1)))
    for shift in range(0, 64, 8):
        q = (9 * np.arange(M) + shift) % K
        got = f32(skinny(_one_hot(M, K, q), w, M, N, K))
        want = np.repeat((q + 1).astype(np.float32)[:, None], N, axis=1)
        check_exact(got, want, f"weight k M={M} shift={shift}",
                    lambda m, n, v: f"input k {q[m]} met weight k {v - 1:g}")


@pytest.mark.parametrize("M", [1, 8, 13, 64])
def test_layout_input_rows(M):
    """X[m, k] = m + 1 (every k), W[n] one-hot: Y[m, n] = m + 1. Which input row reached output row m."""
    N, K = 128, 64
    x = bf(np.repeat(np.arange(1, M + 1, dtype=np.float32)[:, None], K, axis=1))
    p = (5 * np.arange(N) + 3) % K
    got = f32(skinny(x, _one_hot(N, K, p), M, N, K))
    want = np.repeat(np.arange(1, M + 1, dtype=np.float32)[:, None], N, axis=1)
    check_exact(got, want, f"input rows M={M}", lambda m, n, v: f"output row m read input row {v - 1:g}")


@pytest.mark.parametrize("M", [8, 64])
def test_layout_input_k(M):
    """X[m, k] = k + 1, W[n] one-hot at p(n): Y[m, n] = p(n) + 1."""
    N, K = 128, 64
    x = bf(np.tile(np.arange(1, K + 1, dtype=np.float32), (M, 1)))
    p = (5 * np.arange(N) + 3) % K
    got = f32(skinny(x, _one_hot(N, K, p), M, N, K))
    want = np.tile((p + 1).astype(np.float32), (M, 1))
    check_exact(got, want, f"input k M={M}", lambda m, n, v: f"weight k {p[n]} met input k {v - 1:g}")


@pytest.mark.parametrize("splits", [1, 2, 4, 8])
@pytest.mark.parametrize("M", [3, 64])
def test_layout_stages_and_splits(M, splits):
    """K = 2560 (40 blocks of 64: many ring rounds, 8 splits of 5), N = 448 (three tiles and a half one): W[n, k] =
    block(k) + 1 + 64 * (n % 2), X[m] one-hot at q(m) anywhere in K: Y[m, n] = block(q(m)) + 1 + 64 (n % 2). Says which
    K block an output took its product from (wrong stage, coordinate or split range) and, through n % 2, that the row
    reached its column; the other splits add exact zeros through the cluster reduction."""
    N, K = 448, 2560
    blk = (np.arange(K) // 64).astype(np.float32)
    w = bf(blk[None, :] + 1 + 64 * (np.arange(N) % 2)[:, None])
    q = (997 * np.arange(M) + 13) % K
    got = f32(skinny(_one_hot(M, K, q), w, M, N, K, splits=splits))
    want = (blk[q][:, None] + 1 + 64 * (np.arange(N) % 2)[None, :]).astype(np.float32)
    check_exact(got, want, f"stages M={M} splits={splits}",
                lambda m, n, v: f"input k {q[m]} (block {q[m] // 64}) met weight block {(v - 1) % 64:g}")


def test_layout_silu_pairs():
    """SiLU·up pairs gate row i with up row I + i: W gate rows = 1, up rows = (i % 64) + 1 (exact), X one-hot: Y[m, i]
    = bf16(SiLU(1) * (i % 64 + 1))."""
    I, K, M = 200, 64, 8  # 200: a part tile of gate rows whose up rows sit at I + ...
    w = np.ones((2 * I, K), np.float32)
    w[I:] = ((np.arange(I) % 64) + 1)[:, None]
    got = f32(skinny(_one_hot(M, K, np.arange(M) * 7 % K), bf(w), M, 2 * I, K, silu_up=True))
    s = np.float32(1.0) / (np.float32(1.0) + np.exp(np.float32(-1.0), dtype=np.float32))
    want = f32(bf(np.tile(s * ((np.arange(I) % 64) + 1).astype(np.float32), (M, 1))))
    # __expf is an approximation: equal to within one bf16 step, then the up row is certain
    bad = np.abs(got - want) > np.abs(want) * 2.0 ** -7
    if bad.any():
        m, i = (int(v) for v in np.argwhere(bad)[0])
        pytest.fail(f"SiLU·up pairs: first (m={m}, i={i}) got {got[m, i]}, want {want[m, i]}: its up value was "
                    f"~{got[m, i] / s:.1f}, want {i % 64 + 1}\n" + error_map(got, want, bad))


# ---- numerics at the models' shapes ----

def _case(rng, M, N, K):
    return rand_bf16(rng, (M, K)), rand_bf16(rng, (N, K), 1.0 / np.sqrt(K))


@pytest.mark.parametrize("model", list(GEMMS))
def test_model_shapes(model):
    """Every projection at every row count (4B) or a spread of them (8B, 32B), plain and with the residual."""
    Ms = ALL_M if model == "4b" else [1, 8, 17, 64]
    rng = np.random.default_rng(len(model))
    for N, K in GEMMS[model]:
        w = rand_bf16(rng, (N, K), 1.0 / np.sqrt(K))
        wf = f32(w)
        for M in Ms:
            x = rand_bf16(rng, (M, K))
            want = f32(x) @ wf.T
            check_close(f32(skinny(x, w, M, N, K)), want, TOL["bf16_gemm"], f"{model} N={N} K={K} M={M}")
            y0 = rand_bf16(rng, (M, N))
            check_close(f32(skinny(x, w, M, N, K, y0)), want + f32(y0), TOL["bf16_gemm"],
                        f"{model} N={N} K={K} M={M} residual")


@pytest.mark.parametrize("M", [1, 7, 33, 64])
def test_lm_head_fp32(M):
    rng = np.random.default_rng(M)
    K = 2560
    x, w = _case(rng, M, V, K)
    got = skinny(x, w, M, V, K, out_f32=True)
    assert got.dtype == np.float32
    check_close(got, f32(x) @ f32(w).T, 1e-4, f"lm_head M={M}")  # fp32 out: only the summation order differs


@pytest.mark.parametrize("N,K", [(64, 64), (200, 72), (1032, 1000), (136, 4104), (2560, 64), (384, 200)])
def test_awkward_shapes(N, K):
    """Off every tile: N not a multiple of 128 (a lone half tile, tiles ending 8 or 72 rows into a half), K not a
    multiple of 64 (a last block the copy engine zero-fills; 64 and 72: shorter than the ring), fp32 out with the
    residual."""
    rng = np.random.default_rng(N + K)
    for M in (1, 3, 17, 33, 64):
        x, w = _case(rng, M, N, K)
        want = f32(x) @ f32(w).T
        check_close(f32(skinny(x, w, M, N, K)), want, TOL["bf16_gemm"], f"N={N} K={K} M={M}")
        y0 = rng.standard_normal((M, N)).astype(np.float32)
        got = skinny(x, w, M, N, K, y0, out_f32=True)
        np.testing.assert_allclose(got, want + y0, rtol=1e-4, atol=1e-4, err_msg=f"N={N} K={K} M={M} fp32 residual")


@pytest.mark.parametrize("M", [1, 8, 64])
def test_forced_splits(M):
    """4B o (20 tiles, 64 K blocks) at every split count: each within the tolerance (the reduction adds the splits in
    order; the counts give different sums in the last bits, never a wrong one)."""
    rng = np.random.default_rng(M)
    N, K = 2560, 4096
    x, w = _case(rng, M, N, K)
    want = f32(x) @ f32(w).T
    for s in range(1, 9):
        assert ops().skinny_gemm_splits(M, N, K, False, s)["splits"] == s
        check_close(f32(skinny(x, w, M, N, K, splits=s)), want, TOL["bf16_gemm"], f"M={M} splits={s}")


def test_split_rule():
    """The launch rule: the smallest power of two with tiles x splits >= SMs, at most 8 and at most the K blocks."""
    for N, K, silu in [(6144, 2560, False), (2560, 4096, False), (19456, 2560, True), (2560, 9728, False),
                       (V, 2560, False), (10240, 5120, False), (256, 128, False)]:
        r = ops().skinny_gemm_splits(8, N, K, silu)
        tiles, kb = (N + 127) // 128, (K + 63) // 64
        s = 1
        while s < 8 and tiles * s < r["num_sms"]:
            s *= 2
        assert r["splits"] == min(s, kb), (N, K, r)


@pytest.mark.parametrize("M", [1, 5, 16, 64])
def test_silu_up(M):
    """SiLU·up fused: equal bit for bit to the same kernel's bf16 output followed by silu_mul where I is a multiple of
    64 (the same sums in the same order: the tiles, splits and each row's place in its 64-row block match; at I = 72
    the up rows sit elsewhere in their blocks, so only close), and close to the fp32 reference."""
    rng = np.random.default_rng(M + 100)
    for I, K in [(9728, 2560), (12288, 4096), (72, 200)]:
        x, w = _case(rng, M, 2 * I, K)
        fused = skinny(x, w, M, 2 * I, K, silu_up=True)
        unfused = ops().silu_mul(skinny(x, w, M, 2 * I, K), I)
        if I % 64 == 0:
            np.testing.assert_array_equal(fused, unfused, err_msg=f"I={I} K={K} M={M}")
        check_close(f32(fused), f32(unfused), TOL["bf16_out"], f"silu fused vs unfused I={I} K={K} M={M}")
        rb = bf16_to_f32(f32_to_bf16(f32(x) @ f32(w).T))
        check_close(f32(fused), ref.silu_mul(rb[:, :I], rb[:, I:]), TOL["bf16_gemm"], f"silu I={I} K={K} M={M}")


@pytest.mark.parametrize("case", [(8, 2560, 4096, 0, False), (64, 6144, 2560, 0, False), (17, 19456, 2560, 0, False),
                                  (3, 2560, 9728, 8, False), (33, 1032, 1000, 2, True)])
def test_graph_replay_equals_eager(case):
    """The call captured in a CUDA graph and replayed (three times, Y reset inside the graph) gives the eager bits: the
    split reduction keeps no state between launches. Split clusters (4B o and down, qkv), one split (gate_up), fp32
    with the residual."""
    M, N, K, splits, f32_out = case
    rng = np.random.default_rng(M * 3 + N)
    x, w = _case(rng, M, N, K)
    y0 = rng.standard_normal((M, N)).astype(np.float32) if f32_out else rand_bf16(rng, (M, N))
    for y_init in (None, y0):
        eager, replay = skinny(x, w, M, N, K, y_init, out_f32=f32_out, splits=splits, graph_replays=3)
        np.testing.assert_array_equal(replay, eager, err_msg=f"{case} residual={y_init is not None}")


@pytest.mark.parametrize("M", [2, 8, 64])
def test_pdl_chain(M):
    """Three dependent launches (h = x·w1ᵀ; o = h·w2ᵀ; o += h·w2ᵀ): back to back under programmatic dependent launch
    and replayed in a graph they equal the launches run alone, bit for bit (no input read before the previous kernel
    finished, no output written before it), and o is close to the fp32 reference."""
    rng = np.random.default_rng(M)
    N1, K, N2 = 2560, 4096, 6144  # o's shape, then qkv's: 8- and 4-way split clusters
    x, w1 = _case(rng, M, N1, K)
    w2 = rand_bf16(rng, (N2, N1), 1.0 / np.sqrt(N1))
    h0, o0 = ops().skinny_gemm_chain(x, w1, w2, M, N1, K, N2, 0)
    check_close(f32(h0), f32(x) @ f32(w1).T, TOL["bf16_gemm"], f"chain h M={M}")
    for mode in (1, 2):
        h, o = ops().skinny_gemm_chain(x, w1, w2, M, N1, K, N2, mode)
        np.testing.assert_array_equal(h, h0, err_msg=f"h, mode {mode}")
        np.testing.assert_array_equal(o, o0, err_msg=f"o, mode {mode}")
    one = f32(h0) @ f32(w2).T
    check_close(f32(o0), f32(bf(one)) + one, TOL["bf16_gemm"], f"chain M={M}")


def test_refusals():
    rng = np.random.default_rng(0)
    x, w = rand_bf16(rng, (65, 64)), rand_bf16(rng, (128, 64))
    assert ops().skinny_gemm(x, w, 65, 128, 64, None, False) is None  # more than 64 rows
    assert ops().skinny_gemm(x[:8, :60].copy(), w[:, :60].copy(), 8, 128, 60, None, False) is None  # K % 8
    assert ops().skinny_gemm(x[:8], w[:124], 8, 124, 64, None, False) is None  # N % 8
    assert ops().skinny_gemm(x[:8], w[:56], 8, 56, 64, None, False) is None  # N < 64: a box would pass the tensor
    assert ops().skinny_gemm(x[:8, :56].copy(), w[:, :56].copy(), 8, 128, 56, None, False) is None  # K < 64
    y0 = rand_bf16(rng, (8, 64))
    assert ops().skinny_gemm(x[:8], w, 8, 128, 64, y0, False, True) is None  # SiLU·up with the residual
    assert ops().skinny_gemm(x[:8], w, 8, 128, 64, None, True, True) is None  # SiLU·up in fp32
    assert ops().skinny_gemm_splits(65, 128, 64)["splits"] == 0


def test_gemm_config_routes_here():
    """Gemm::run with config GEMM_SKINNY takes this kernel (same bits) where it takes the shape, cuBLASLt above 64 rows."""
    rng = np.random.default_rng(1)
    N, K = 2560, 4096
    for M in (8, 100):
        x, w = _case(rng, M, N, K)
        got = ops().gemm(x, w, M, N, K, None, False, config=ops().GEMM_SKINNY)
        check_close(f32(got), f32(x) @ f32(w).T, TOL["bf16_gemm"], f"Gemm::run M={M}")
        if M <= 64:
            np.testing.assert_array_equal(got, skinny(x, w, M, N, K))

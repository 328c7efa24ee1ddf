"""skinny_gemm's batch-invariant mode (skinny_gemm_invariant, csrc/gemm/skinny_gemm.h): the --deterministic GEMM on
sm_90 (fixed_gemm where it refuses a shape, and on other devices). A row's output bits must be a function of that row's
input and the weights alone, whatever M is, wherever the row sits in X and whatever the other rows hold.

Read the small tests first when something fails; each names one piece:
  - test_chunk_rows_land_in_place: the row-chunk grid dimension (which input row reached which output row; rows past
    M never written, the binding's NaN fill survives there);
  - test_column_position_does_not_change_bits: the hardware assumption (an output column of wgmma depends only on its
    own B column, and not on where that column sits among the 64): one row at every position of a 64-row chunk beside
    other rows of huge, tiny and zero values;
  - test_split_rule: the split count is a function of (N, K) alone (never of M), at the table's values;
  - test_rows_do_not_depend_on_m: the contract at the 4B/8B/32B projections, M from 1 to 2,500, windows at several
    row offsets;
  - test_epilogues_*: residual add, fp32 out (with and without the residual), SiLU·up, each invariant and against
    the fp32 NumPy reference;
  - test_graph_replay_equals_eager, test_gemm_run_routes_here: the launch under capture and the engine's entry point;
  - test_multi_chunk_*: from 65 rows a block takes 2 or 4 row chunks (one warpgroup each, sharing the weight stages):
    bit for bit the single-chunk kernel's rows (chunks_per_block=1) at the models' shapes and every epilogue, the
    block-size rule, idle chunks of a last block (rows landing in place), a row at every warpgroup's columns.
The engine's deterministic tests (tests/test_deterministic.py, test_gpu_graphs.py, test_gpu_drafter.py,
test_gpu_verify_graphs.py, `-k deterministic`) exercise the mode through the engine.
"""
from __future__ import annotations

import numpy as np
import pytest

from openinfer.reference import ops as ref
from openinfer.safetensors_io import bf16_to_f32, f32_to_bf16
from gpu_util import TOL, f32, rand_bf16, rel_err, requires_gpu

pytestmark = requires_gpu

V = 151936
GEMMS = {  # (N, K) of each projection: qkv, o, gate_up, down
    "4b": [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)],
    "8b": [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)],
    "32b": [(10240, 5120), (5120, 8192), (51200, 5120), (5120, 25600)],
}
INVARIANT_M = [1, 2, 3, 31, 64, 65, 200, 1024, 2500]


def ops():
    from openinfer import _engine
    return _engine.ops


@pytest.fixture(autouse=True, scope="module")
def _hopper():
    if ops().skinny_gemm_splits(1, 128, 64, invariant=True)["splits"] == 0:
        pytest.skip("skinny_gemm_invariant takes compute capability 9.0 only")


def inv(x, w, M, N, K, y0=None, out_f32=False, silu_up=False, graph_replays=0, chunks=0):
    """skinny_gemm_invariant; chunks: its 64-row chunks per block forced (1 the single-chunk kernel, 2, 4; 0 the
    rule)."""
    got = ops().skinny_gemm(x, w, M, N, K, y0, out_f32, silu_up, 0, graph_replays, invariant=True,
                            chunks_per_block=chunks)
    assert got is not None, f"skinny_gemm_invariant refused M={M} N={N} K={K} chunks={chunks}"
    return got


def bf(a) -> np.ndarray:
    return f32_to_bf16(np.asarray(a, np.float32))


def check_rows_equal(got: np.ndarray, want: np.ndarray, what: str):
    """Bit for bit (as raw bits: NaN == NaN); on failure the first wrong (row, column) and which rows are wrong."""
    g, w = np.ascontiguousarray(got), np.ascontiguousarray(want)
    g = g.view(np.uint32 if g.dtype == np.float32 else np.uint16)
    w = w.view(np.uint32 if w.dtype == np.float32 else np.uint16)
    bad = g != w
    if not bad.any():
        return
    m, n = (int(v) for v in np.argwhere(bad)[0])
    rows = np.flatnonzero(bad.any(axis=1)).tolist()
    pytest.fail(f"{what}: {int(bad.sum())} of {bad.size} outputs differ; first (row {m}, col {n}); "
                f"rows that differ: {rows[:32]}{' ...' if len(rows) > 32 else ''}")


def ref_rows(x, w, rows):
    """fp32 NumPy reference of the given rows."""
    return f32(x[rows]) @ f32(w).T


# ---- the pieces ----

@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("M", [1, 63, 64, 65, 129, 200, 2500])
def test_chunk_rows_land_in_place(M, chunks):
    """X[m, 0] = m % 128 + 1, X[m, 1] = m // 128 + 1, W[n, 0] = 1, W[n, 1] = 256 (the rest zero), fp32 out: Y[m, n] =
    m % 128 + 1 + 256 (m // 128 + 1) exactly. An output that read another input row says which; the binding fills Y
    with NaN first, so a row never stored shows as NaN. At 2 and 4 chunks per block the last block has idle chunks
    (M = 65, 129, 200, 2500)."""
    N, K = 200, 64  # 200: a full tile and a part one
    x = np.zeros((M, K), np.float32)
    x[:, 0] = np.arange(M) % 128 + 1
    x[:, 1] = np.arange(M) // 128 + 1
    w = np.zeros((N, K), np.float32)
    w[:, 0], w[:, 1] = 1, 256
    got = inv(bf(x), bf(w), M, N, K, out_f32=True, chunks=chunks)
    want = (x[:, 0] + 256 * x[:, 1])[:, None] * np.ones((1, N), np.float32)
    bad = ~(got == want)
    if bad.any():
        m, n = (int(v) for v in np.argwhere(bad)[0])
        v = got[m, n]
        read = "never written (NaN)" if np.isnan(v) else f"input row {int(v % 256) - 1 + 128 * (int(v // 256) - 1)}"
        pytest.fail(f"M={M} chunks={chunks}: {int(bad.sum())} wrong; output row {m} (col {n}) holds {v}: {read}")


def test_column_position_does_not_change_bits():
    """The hardware assumption the mode rests on: one input row at each of the 64 positions of a chunk (so at every
    wgmma B column), beside rows of huge (~1e30), tiny and zero values that change with the position, gives the same
    bits every time, alone (M = 1: the other 63 columns the copy engine's zeros) and in every place."""
    rng = np.random.default_rng(11)
    N, K = 2560, 4096  # the 4B o projection: 8 splits, the cluster sum
    w = rand_bf16(rng, (N, K), 1.0 / np.sqrt(K))
    row = rand_bf16(rng, (1, K))
    alone = inv(row, w, 1, N, K)
    for pos in range(64):
        others = rng.standard_normal((64, K)).astype(np.float32) * np.float32(
            [1e30, 1e-30, 0.0, 1.0][pos % 4])
        x = bf(others)
        x[pos] = row[0]
        got = inv(x, w, 64, N, K)
        check_rows_equal(got[pos:pos + 1], alone, f"the row at B column {pos}")


def test_split_rule():
    """Splits = the smallest power of two with tiles x S >= 132 (a fixed count, not the device's SMs), at most 8 and
    at most the K blocks, and nothing else: not M (the binding's M is ignored in the invariant mode)."""
    want = {  # (N, K, silu_up): splits
        (6144, 2560, False): 4, (2560, 4096, False): 8, (19456, 2560, True): 1, (2560, 9728, False): 8,
        (V, 2560, False): 1, (4096, 4096, False): 8, (10240, 5120, False): 2, (5120, 8192, False): 4,
        (51200, 5120, True): 1, (256, 128, False): 2, (200, 64, False): 1,
    }
    for (N, K, silu), s in want.items():
        for M in (1, 64, 4096):
            got = ops().skinny_gemm_splits(M, N, K, silu, 0, invariant=True)["splits"]
            assert got == s, (N, K, silu, M, got)


# ---- the contract at the models' shapes ----

def _windows(Mmax: int, M: int):
    """Offsets of M-row windows into the Mmax-row batch: the start, a place off the 64-row grid, the end."""
    return sorted({o for o in (0, 37, Mmax - M) if 0 <= o <= Mmax - M})


@pytest.mark.parametrize("model", list(GEMMS))
def test_rows_do_not_depend_on_m(model):
    """Every row of a call equals the same row computed in a call of another M and at another offset, bit for bit
    (4B: M = 1, 2, 3, 31, 64, 65, 200, 1024 windows of a 2,500-row call; 8B and 32B, whose weights take longer to
    copy per call: 1, 2, 31, 65, 1024 of 1,100), and the call is a correct GEMM (fp32 NumPy on a sample of rows: the
    first, the 64-row edges, the last)."""
    rng = np.random.default_rng(len(model) + 40)
    Ms = INVARIANT_M if model == "4b" else [1, 2, 31, 65, 1024, 1100]
    Mmax = Ms[-1]
    for N, K in GEMMS[model]:
        x, w = rand_bf16(rng, (Mmax, K)), rand_bf16(rng, (N, K), 1.0 / np.sqrt(K))
        full = inv(x, w, Mmax, N, K)
        sample = [0, 63, 64, 65, 1023, 1024, Mmax - 1]
        assert rel_err(f32(full[sample]), ref_rows(x, w, sample)) < TOL["bf16_gemm"], (model, N, K)
        for M in Ms[:-1]:
            for o in _windows(Mmax, M):
                part = inv(np.ascontiguousarray(x[o:o + M]), w, M, N, K)
                check_rows_equal(part, full[o:o + M], f"{model} N={N} K={K} M={M} at row {o}")


def test_lm_head_rows_do_not_depend_on_m():
    """The lm_head (fp32 logits, 1,187 tiles, one split): a sampled row alone equals the same row among 64 and 130."""
    rng = np.random.default_rng(3)
    K = 2560
    x, w = rand_bf16(rng, (130, K)), rand_bf16(rng, (V, K), 1.0 / np.sqrt(K))
    many = inv(x, w, 130, V, K, out_f32=True)
    assert many.dtype == np.float32
    assert rel_err(many[[0, 64, 129]], ref_rows(x, w, [0, 64, 129])) < 1e-4  # fp32 out: only the order differs
    for M, o in ((1, 0), (1, 77), (7, 60), (64, 3), (64, 66)):
        check_rows_equal(inv(np.ascontiguousarray(x[o:o + M]), w, M, V, K, out_f32=True), many[o:o + M],
                         f"lm_head M={M} at row {o}")


@pytest.mark.parametrize("N,K", [(64, 64), (200, 72), (1032, 1000), (136, 4104), (2560, 64), (384, 200), (6152, 2560)])
def test_awkward_shapes(N, K):
    """Off every tile: N not a multiple of 128 (a lone half tile, tiles ending 8 or 72 rows into a half), K = 64 (one
    K block: one split) and K not a multiple of 64 (a last block the copy engine zero-fills), M = 1 and M past the
    64-row grid; invariant across M and close to fp32, plain and fp32 out with the residual."""
    rng = np.random.default_rng(N + K)
    Mmax = 150
    x, w = rand_bf16(rng, (Mmax, K)), rand_bf16(rng, (N, K), 1.0 / np.sqrt(K))
    y0 = rng.standard_normal((Mmax, N)).astype(np.float32)
    full = inv(x, w, Mmax, N, K)
    logits = inv(x, w, Mmax, N, K, y0, out_f32=True)
    want = f32(x) @ f32(w).T
    assert rel_err(f32(full), want) < TOL["bf16_gemm"]
    np.testing.assert_allclose(logits, want + y0, rtol=1e-4, atol=1e-4)
    for M in (1, 5, 64, 65, 149):
        for o in (0, Mmax - M):
            xs = np.ascontiguousarray(x[o:o + M])
            check_rows_equal(inv(xs, w, M, N, K), full[o:o + M], f"N={N} K={K} M={M} at row {o}")
            check_rows_equal(inv(xs, w, M, N, K, np.ascontiguousarray(y0[o:o + M]), out_f32=True), logits[o:o + M],
                             f"N={N} K={K} M={M} at row {o}, fp32 residual")


# ---- epilogues ----

@pytest.mark.parametrize("model", list(GEMMS))
def test_epilogues_residual(model):
    """Y += X·Wᵀ (o and down: the residual add, summed in fp32 and rounded once): invariant across M and close to
    fp32."""
    rng = np.random.default_rng(len(model) + 7)
    for N, K in (GEMMS[model][1], GEMMS[model][3]):
        Mmax = 300
        x, w = rand_bf16(rng, (Mmax, K)), rand_bf16(rng, (N, K), 1.0 / np.sqrt(K))
        y0 = rand_bf16(rng, (Mmax, N))
        full = inv(x, w, Mmax, N, K, y0)
        sample = [0, 64, 299]
        assert rel_err(f32(full[sample]), ref_rows(x, w, sample) + f32(y0[sample])) < TOL["bf16_gemm"], (N, K)
        for M, o in ((1, 0), (1, 130), (3, 62), (64, 1), (65, 200), (299, 1)):
            got = inv(np.ascontiguousarray(x[o:o + M]), w, M, N, K, np.ascontiguousarray(y0[o:o + M]))
            check_rows_equal(got, full[o:o + M], f"{model} residual N={N} K={K} M={M} at row {o}")


@pytest.mark.parametrize("model", list(GEMMS))
def test_epilogues_silu_up(model):
    """SiLU(gate)·up fused (W = [gate; up], Y [M, I]): invariant across M; equal bit for bit to the invariant GEMM's
    bf16 output followed by silu_mul (the same tiles and splits, each gate and up row at the same place in its 64-row
    block: I is a multiple of 64 at every model); close to the fp32 reference."""
    rng = np.random.default_rng(len(model) + 9)
    N, K = GEMMS[model][2]
    I = N // 2
    Mmax = 200
    x, w = rand_bf16(rng, (Mmax, K)), rand_bf16(rng, (N, K), 1.0 / np.sqrt(K))
    fused = inv(x, w, Mmax, N, K, silu_up=True)
    assert fused.shape == (Mmax, I)
    unfused = ops().silu_mul(inv(x, w, Mmax, N, K), I)
    check_rows_equal(fused, unfused, f"{model} SiLU·up fused against unfused")
    sample = [0, 64, 199]
    rb = bf16_to_f32(f32_to_bf16(ref_rows(x, w, sample)))
    assert rel_err(f32(fused[sample]), ref.silu_mul(rb[:, :I], rb[:, I:])) < TOL["bf16_gemm"]
    for M, o in ((1, 0), (1, 101), (2, 63), (31, 5), (64, 64), (65, 0), (199, 1)):
        got = inv(np.ascontiguousarray(x[o:o + M]), w, M, N, K, silu_up=True)
        check_rows_equal(got, fused[o:o + M], f"{model} SiLU·up M={M} at row {o}")


def test_epilogues_silu_up_part_tile():
    """SiLU·up at I = 200 (a part tile of gate rows) and M across the 64-row grid: invariant, close to fp32."""
    rng = np.random.default_rng(5)
    I, K, Mmax = 200, 200, 130
    x, w = rand_bf16(rng, (Mmax, K)), rand_bf16(rng, (2 * I, K), 1.0 / np.sqrt(K))
    fused = inv(x, w, Mmax, 2 * I, K, silu_up=True)
    rb = bf16_to_f32(f32_to_bf16(f32(x) @ f32(w).T))
    assert rel_err(f32(fused), ref.silu_mul(rb[:, :I], rb[:, I:])) < TOL["bf16_gemm"]
    for M, o in ((1, 7), (64, 66), (129, 1)):
        check_rows_equal(inv(np.ascontiguousarray(x[o:o + M]), w, M, 2 * I, K, silu_up=True), fused[o:o + M],
                         f"SiLU·up I={I} M={M} at row {o}")


# ---- launches ----

@pytest.mark.parametrize("case", [(1, 2560, 4096, False), (64, 6144, 2560, False), (130, 19456, 2560, False),
                                  (70, 1032, 1000, True)])
def test_graph_replay_equals_eager(case):
    """Captured in a CUDA graph and replayed three times (Y reset inside the graph), the eager bits: 8- and 4-way
    split clusters, one split, several row chunks, fp32 with the residual."""
    M, N, K, f32_out = case
    rng = np.random.default_rng(M * 3 + N)
    x, w = rand_bf16(rng, (M, K)), rand_bf16(rng, (N, K), 1.0 / np.sqrt(K))
    y0 = rng.standard_normal((M, N)).astype(np.float32) if f32_out else rand_bf16(rng, (M, N))
    for y_init in (None, y0):
        eager, replay = inv(x, w, M, N, K, y_init, out_f32=f32_out, graph_replays=3)
        check_rows_equal(replay, eager, f"{case} residual={y_init is not None}")


def test_gemm_run_routes_here():
    """Gemm::run(fixed) at config -1 (the engine's) and GEMM_SKINNY is this kernel bit for bit at any M; GEMM_FIXED
    is fixed_gemm (also batch-invariant, in other bits)."""
    rng = np.random.default_rng(1)
    N, K = 2560, 4096
    for M in (1, 8, 100):
        x, w = rand_bf16(rng, (M, K)), rand_bf16(rng, (N, K), 1.0 / np.sqrt(K))
        forced = ops().gemm(x, w, M, N, K, None, False, fixed=True, config=ops().GEMM_SKINNY)
        check_rows_equal(forced, inv(x, w, M, N, K), f"Gemm::run GEMM_SKINNY M={M}")
        picked = ops().gemm(x, w, M, N, K, None, False, fixed=True)
        check_rows_equal(picked, forced, f"Gemm::run config -1 M={M}")
        old = ops().gemm(x, w, M, N, K, None, False, fixed=True, config=ops().GEMM_FIXED)
        assert rel_err(f32(old), f32(forced)) < 2 * TOL["bf16_gemm"], M  # fixed_gemm: another order


def test_refusals():
    """What it does not take it refuses at every M (so a shape's rows all go to fixed_gemm): N or K below 64 or not a
    multiple of 8, SiLU·up with the residual or fp32."""
    rng = np.random.default_rng(0)
    for M in (1, 64, 200):
        x, w = rand_bf16(rng, (M, 64)), rand_bf16(rng, (128, 64))
        call = ops().skinny_gemm
        assert call(np.ascontiguousarray(x[:, :60]), np.ascontiguousarray(w[:, :60]), M, 128, 60, None, False,
                    invariant=True) is None  # K % 8
        assert call(x, w[:124], M, 124, 64, None, False, invariant=True) is None  # N % 8
        assert call(x, w[:56], M, 56, 64, None, False, invariant=True) is None  # N < 64
        assert call(np.ascontiguousarray(x[:, :56]), np.ascontiguousarray(w[:, :56]), M, 128, 56, None, False,
                    invariant=True) is None  # K < 64
        assert call(x, w, M, 128, 64, rand_bf16(rng, (M, 64)), False, True, invariant=True) is None  # SiLU·up + res
        assert call(x, w, M, 128, 64, None, True, True, invariant=True) is None  # SiLU·up in fp32
    with pytest.raises(ValueError):
        ops().skinny_gemm(x, w, 200, 128, 64, None, False, False, 2, invariant=True)  # splits are the mode's own


# ---- several row chunks per block (2 or 4 warpgroups sharing each weight stage) ----

MULTI_M = [65, 127, 128, 129, 255, 1000, 2500]


def test_multi_chunk_rule():
    """The chunks per block skinny_gemm_invariant picks: 1 up to 64 rows, 2 from 65, 4 from 256 (a speed choice; the
    bits are the same, tested below). Not a function of the shape except where the device cannot hold the cluster
    at the larger block (then 1)."""
    for M, want in ((1, 1), (64, 1), (65, 2), (128, 2), (255, 2), (256, 4), (2500, 4)):
        for N, K in GEMMS["4b"]:
            got = ops().skinny_gemm_splits(M, N, K, False, 0, invariant=True)["chunks_per_block"]
            assert got == want, (M, N, K, got)


@pytest.mark.parametrize("model", list(GEMMS))
def test_multi_chunk_bits_equal_single_chunk(model):
    """At the 4B/8B/32B projections and M = 65, 127, 128, 129, 255, 1,000, 2,500 (M-row prefixes of one input): the
    2- and 4-chunk blocks give the single-chunk kernel's bits in every row (gate_up here without SiLU·up; the fused
    epilogue has its own test), and the result is the GEMM (fp32 NumPy on the rows at the chunk and block edges)."""
    rng = np.random.default_rng(len(model) + 60)
    Mmax = MULTI_M[-1]
    for N, K in GEMMS[model]:
        x, w = rand_bf16(rng, (Mmax, K)), rand_bf16(rng, (N, K), 1.0 / np.sqrt(K))
        for M in MULTI_M:
            xs = np.ascontiguousarray(x[:M])
            single = inv(xs, w, M, N, K, chunks=1)
            sample = sorted({0, 63, 64, 127, 128, 255, M - 1} & set(range(M)))
            assert rel_err(f32(single[sample]), ref_rows(x, w, sample)) < TOL["bf16_gemm"], (model, N, K, M)
            for chunks in (2, 4):
                check_rows_equal(inv(xs, w, M, N, K, chunks=chunks), single,
                                 f"{model} N={N} K={K} M={M}: {chunks} chunks per block against 1")


@pytest.mark.parametrize("model", list(GEMMS))
def test_multi_chunk_epilogues(model):
    """Every epilogue at 2 and 4 chunks per block equals the single-chunk kernel bit for bit: the residual add (o,
    down), fp32 out with and without the residual (qkv), SiLU·up (gate_up: [M, I]); each close to fp32 NumPy."""
    rng = np.random.default_rng(len(model) + 70)
    qkv, o, gate_up, down = GEMMS[model]
    Ms = (65, 129, 255, 1000)
    Mmax = Ms[-1]
    for N, K in (o, down):
        x, w = rand_bf16(rng, (Mmax, K)), rand_bf16(rng, (N, K), 1.0 / np.sqrt(K))
        y0 = rand_bf16(rng, (Mmax, N))
        for M in Ms:
            xs, ys = np.ascontiguousarray(x[:M]), np.ascontiguousarray(y0[:M])
            single = inv(xs, w, M, N, K, ys, chunks=1)
            sample = [0, 64, M - 1]
            assert rel_err(f32(single[sample]), ref_rows(x, w, sample) + f32(y0[sample])) < TOL["bf16_gemm"]
            for chunks in (2, 4):
                check_rows_equal(inv(xs, w, M, N, K, ys, chunks=chunks), single,
                                 f"{model} residual N={N} K={K} M={M}: {chunks} chunks per block against 1")
    N, K = qkv
    x, w = rand_bf16(rng, (Mmax, K)), rand_bf16(rng, (N, K), 1.0 / np.sqrt(K))
    y0 = rng.standard_normal((Mmax, N)).astype(np.float32)
    for M in Ms:
        xs, ys = np.ascontiguousarray(x[:M]), np.ascontiguousarray(y0[:M])
        for y_init in (None, ys):
            single = inv(xs, w, M, N, K, y_init, out_f32=True, chunks=1)
            want = ref_rows(x, w, [0, M - 1]) + (0 if y_init is None else y_init[[0, M - 1]])
            np.testing.assert_allclose(single[[0, M - 1]], want, rtol=1e-3, atol=1e-3)
            for chunks in (2, 4):
                check_rows_equal(inv(xs, w, M, N, K, y_init, out_f32=True, chunks=chunks), single,
                                 f"{model} fp32 out residual={y_init is not None} M={M}: {chunks} chunks against 1")
    N, K = gate_up
    I = N // 2
    x, w = rand_bf16(rng, (Mmax, K)), rand_bf16(rng, (N, K), 1.0 / np.sqrt(K))
    for M in Ms:
        xs = np.ascontiguousarray(x[:M])
        single = inv(xs, w, M, N, K, silu_up=True, chunks=1)
        assert single.shape == (M, I)
        sample = [0, 64, M - 1]
        rb = bf16_to_f32(f32_to_bf16(ref_rows(x, w, sample)))
        assert rel_err(f32(single[sample]), ref.silu_mul(rb[:, :I], rb[:, I:])) < TOL["bf16_gemm"]
        for chunks in (2, 4):
            check_rows_equal(inv(xs, w, M, N, K, silu_up=True, chunks=chunks), single,
                             f"{model} SiLU·up M={M}: {chunks} chunks per block against 1")


def test_multi_chunk_row_at_every_warpgroup():
    """One input row at the first and last column of every warpgroup of a 4-chunk block (and of two 2-chunk blocks),
    beside rows of huge, tiny and zero values, gives the bits of that row alone (M = 1, the single-chunk kernel)."""
    rng = np.random.default_rng(12)
    N, K = 2560, 4096  # 8 splits: the cluster sum over the four partial tiles
    w = rand_bf16(rng, (N, K), 1.0 / np.sqrt(K))
    row = rand_bf16(rng, (1, K))
    alone = inv(row, w, 1, N, K)
    for pos in (0, 63, 64, 127, 128, 191, 192, 255):
        others = rng.standard_normal((256, K)).astype(np.float32) * np.float32([1e30, 1e-30, 0.0, 1.0][pos % 4])
        x = bf(others)
        x[pos] = row[0]
        for chunks in (2, 4):
            check_rows_equal(inv(x, w, 256, N, K, chunks=chunks)[pos:pos + 1], alone,
                             f"the row at position {pos} of 256, {chunks} chunks per block")


@pytest.mark.parametrize("case", [(129, 2560, 4096, False, 2), (1000, 2560, 9728, True, 4), (300, 19456, 2560, False, 4)])
def test_multi_chunk_graph_replay(case):
    """Captured and replayed three times: the eager bits at 2 and 4 chunks per block (8-way split clusters, one
    split), and the eager bits equal the single-chunk kernel's."""
    M, N, K, f32_out, chunks = case
    rng = np.random.default_rng(M + N)
    x, w = rand_bf16(rng, (M, K)), rand_bf16(rng, (N, K), 1.0 / np.sqrt(K))
    y0 = rng.standard_normal((M, N)).astype(np.float32) if f32_out else rand_bf16(rng, (M, N))
    eager, replay = inv(x, w, M, N, K, y0, out_f32=f32_out, graph_replays=3, chunks=chunks)
    check_rows_equal(replay, eager, f"{case} replay")
    check_rows_equal(eager, inv(x, w, M, N, K, y0, out_f32=f32_out, chunks=1), f"{case} against 1 chunk per block")


def test_multi_chunk_argument_checks():
    """chunks_per_block is the invariant mode's, and 1, 2 or 4."""
    rng = np.random.default_rng(0)
    x, w = rand_bf16(rng, (100, 64)), rand_bf16(rng, (128, 64))
    for bad in (3, 8, -1):
        with pytest.raises(ValueError):
            ops().skinny_gemm(x, w, 100, 128, 64, None, False, invariant=True, chunks_per_block=bad)
    with pytest.raises(ValueError):
        ops().skinny_gemm(x, w, 100, 128, 64, None, False, chunks_per_block=2)  # the plain mode: up to 64 rows

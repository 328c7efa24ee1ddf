"""Every CUDA kernel against the NumPy fp32 reference, at the 0.6B/4B/8B/32B shapes and awkward ones."""
from __future__ import annotations

import numpy as np
import pytest

from openinfer.reference import ops as ref
from gpu_util import TOL, f32, rand_bf16, rel_err, requires_gpu

pytestmark = requires_gpu

# (hidden, intermediate, heads, kv_heads) of the real models
SHAPES = {"0.6b": (1024, 3072, 16, 8), "4b": (2560, 9728, 32, 8), "8b": (4096, 12288, 32, 8), "32b": (5120, 25600, 64, 8)}
D = 128
V = 151936


def ops():
    from openinfer import _engine
    return _engine.ops


@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("T", [1, 7, 129])
def test_rmsnorm(model, T):
    H = SHAPES[model][0]
    rng = np.random.default_rng(T * 7 + H)
    x, w = rand_bf16(rng, (T, H), 3.0), rand_bf16(rng, (H,), 1.0)
    got = ops().rmsnorm(x, w, 1e-6)
    assert rel_err(f32(got), ref.rmsnorm(f32(x), f32(w), 1e-6)) < TOL["bf16_out"]


@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("T", [1, 5])
def test_silu_mul(model, T):
    I = SHAPES[model][1]
    rng = np.random.default_rng(I + T)
    gu = rand_bf16(rng, (T, 2 * I), 2.0)
    got = ops().silu_mul(gu, I)
    g = f32(gu)
    assert rel_err(f32(got), ref.silu_mul(g[:, :I], g[:, I:])) < TOL["bf16_out"]


@pytest.mark.parametrize("H", [1024, 2560, 5120])
def test_embedding_is_exact(H):
    rng = np.random.default_rng(H)
    table = rand_bf16(rng, (V, H))
    ids = np.array([0, V - 1, 17, 17, 151643, 5], dtype=np.int32)
    np.testing.assert_array_equal(ops().embedding(table, ids, H), table[ids])


GEMMS = {  # (N, K) of each projection
    "4b": [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)],
    "8b": [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)],
    "32b": [(10240, 5120), (5120, 8192), (51200, 5120), (5120, 25600)],
}


@pytest.mark.parametrize("model", list(GEMMS))
@pytest.mark.parametrize("M", [1, 37, 256])
def test_gemm(model, M):
    rng = np.random.default_rng(M)
    for N, K in GEMMS[model]:
        x, w = rand_bf16(rng, (M, K)), rand_bf16(rng, (N, K), 1.0 / np.sqrt(K))
        want = f32(x) @ f32(w).T
        got = ops().gemm(x, w, M, N, K, None, False)
        assert rel_err(f32(got), want) < TOL["bf16_gemm"], (N, K)
        # the residual rides in the epilogue: y = y0 + x·wᵀ
        y0 = rand_bf16(rng, (M, N))
        got = ops().gemm(x, w, M, N, K, y0, False)
        assert rel_err(f32(got), want + f32(y0)) < TOL["bf16_gemm"], (N, K)


def _fixed(config=None):
    """fixed_gemm itself (its own pick of family, or `config`), not the engine's batch-invariant path, which sends
    the shapes skinny_gemm's invariant mode takes there (tests/test_gpu_det_skinny.py tests that mode)."""
    return dict(fixed=True, config=ops().GEMM_FIXED if config is None else config)


@pytest.mark.parametrize("model", ["4b", "8b", "32b"])
def test_fixed_gemm_rows_do_not_depend_on_m(model):
    """The batch-invariant GEMM (--deterministic): every row of a call equals the same row computed in a call
    of other M, bit for bit (1 row, odd counts, the few-row kernel's 8 / 16-row edges, the tiled kernel from
    65 rows, a prefill's 2500), with and without the residual in the epilogue; every kernel family gives the
    same bits on the same rows (the launcher picks them by M and N; the few-row kernel's split-K counters
    are reused by every call); and it is a correct GEMM against fp32."""
    rng = np.random.default_rng(7)
    Ms = [1, 2, 5, 8, 9, 16, 17, 33, 64, 65, 127, 129, 1000, 2500]
    for N, K in GEMMS[model]:
        x, w = rand_bf16(rng, (max(Ms), K)), rand_bf16(rng, (N, K), 1.0 / np.sqrt(K))
        y0 = rand_bf16(rng, (max(Ms), N))
        full = ops().gemm(x, w, max(Ms), N, K, None, False, **_fixed())
        full_acc = ops().gemm(x, w, max(Ms), N, K, y0, False, **_fixed())
        assert rel_err(f32(full[-64:]), f32(x[-64:]) @ f32(w).T) < TOL["bf16_gemm"], (N, K)
        assert rel_err(f32(full_acc[-64:]), f32(x[-64:]) @ f32(w).T + f32(y0[-64:])) < TOL["bf16_gemm"], (N, K)
        for M in Ms[:-1]:
            part = ops().gemm(x[-M:], w, M, N, K, None, False, **_fixed())  # the last M rows, alone
            np.testing.assert_array_equal(part, full[-M:], err_msg=f"N={N} K={K} M={M}")
            part = ops().gemm(x[-M:], w, M, N, K, y0[-M:], False, **_fixed())
            np.testing.assert_array_equal(part, full_acc[-M:], err_msg=f"N={N} K={K} M={M}, residual")
        for config in range(ops().FIXED_GEMM_CONFIGS):
            for M in (3, 12, 80):
                got = ops().gemm(x[-M:], w, M, N, K, None, False, **_fixed(config=config))
                np.testing.assert_array_equal(got, full[-M:], err_msg=f"N={N} K={K} M={M} config {config}")
                got = ops().gemm(x[-M:], w, M, N, K, y0[-M:], False, **_fixed(config=config))
                np.testing.assert_array_equal(got, full_acc[-M:], err_msg=f"N={N} K={K} M={M} config {config}, residual")


@pytest.mark.parametrize("N,K", [(1034, 1032), (258, 72), (2, 8)])
def test_fixed_gemm_awkward_shapes(N, K):
    """The batch-invariant GEMM at shapes off every tile: N past a tile edge, K not a multiple of the K step
    (1032 = 8 x 129: a last 8-wide chunk; 72: fewer stages than the pipeline holds), a 2 x 8 weight; fp32
    out with the accumulate epilogue. Rows and tile families as in the test above."""
    rng = np.random.default_rng(N + K)
    x, w = rand_bf16(rng, (300, K)), rand_bf16(rng, (N, K), 1.0 / np.sqrt(K))
    y0 = rng.standard_normal((300, N)).astype(np.float32)
    full = ops().gemm(x, w, 300, N, K, None, False, **_fixed())
    assert rel_err(f32(full), f32(x) @ f32(w).T) < TOL["bf16_gemm"]
    logits = ops().gemm(x, w, 300, N, K, y0, True, **_fixed())
    np.testing.assert_allclose(logits, f32(x) @ f32(w).T + y0, rtol=1e-4, atol=1e-4)
    for M in (1, 5, 17, 64, 65, 299):
        np.testing.assert_array_equal(ops().gemm(x[-M:], w, M, N, K, None, False, **_fixed()), full[-M:])
        np.testing.assert_array_equal(ops().gemm(x[-M:], w, M, N, K, y0[-M:], True, **_fixed()), logits[-M:])
    for config in range(ops().FIXED_GEMM_CONFIGS):
        np.testing.assert_array_equal(ops().gemm(x, w, 300, N, K, None, False, **_fixed(config=config)), full)


def test_fixed_gemm_fp32_logits_do_not_depend_on_m():
    """The lm_head through the batch-invariant GEMM: fp32 logits, a sampled row alone equals the same row
    among 64, and both are close to fp32."""
    rng = np.random.default_rng(3)
    K = 2560
    x, w = rand_bf16(rng, (64, K)), rand_bf16(rng, (V, K), 1.0 / np.sqrt(K))
    many = ops().gemm(x, w, 64, V, K, None, True, **_fixed())
    assert many.dtype == np.float32 and rel_err(many, f32(x) @ f32(w).T) < TOL["bf16_gemm"]
    for M in (1, 7):
        np.testing.assert_array_equal(ops().gemm(x[-M:], w, M, V, K, None, True, **_fixed()), many[-M:])


def test_gemm_fp32_out_lm_head():
    rng = np.random.default_rng(0)
    M, N, K = 3, V, 2560
    x, w = rand_bf16(rng, (M, K)), rand_bf16(rng, (N, K), 1.0 / np.sqrt(K))
    got = ops().gemm(x, w, M, N, K, None, True)
    assert got.dtype == np.float32
    assert rel_err(got, f32(x) @ f32(w).T) < 1e-4  # fp32 out: only accumulation order differs


def _cache(rng, num_blocks, num_layers, nKV):
    return rand_bf16(rng, (num_blocks, num_layers, 2, nKV, 16, D))


@pytest.mark.parametrize("model", ["0.6b", "4b", "32b"])
def test_qk_norm_rope_kv_write(model):
    _, _, nH, nKV = SHAPES[model]
    rng = np.random.default_rng(nH)
    T, L, layer, nb = 41, 3, 1, 12
    qkv = rand_bf16(rng, (T, (nH + 2 * nKV) * D), 2.0)
    qw, kw = f32_to_bf16_pos(rng, D), f32_to_bf16_pos(rng, D)
    positions = np.concatenate([np.arange(20), rng.integers(20, 32768, T - 20)]).astype(np.int32)
    slots = rng.permutation(nb * 16)[:T].astype(np.int32)
    slots[[3, 17, 40]] = -1  # padding rows: no write
    cache = _cache(rng, nb, L, nKV)
    q_out, cache_out = ops().qk_norm_rope_kv_write(qkv, qw, kw, positions, slots, cache.reshape(-1), layer, L, nH,
                                                   nKV, 1e6, 1e-6, 40960)
    cache_out = cache_out.reshape(cache.shape)
    x = f32(qkv).reshape(T, nH + 2 * nKV, D)
    q_ref, k_ref = ref.qk_norm_rope(x[:, :nH], x[:, nH:nH + nKV], f32(qw), f32(kw), positions, 1e6, 1e-6)
    assert rel_err(f32(q_out).reshape(T, -1, D)[:, :nH], q_ref) < TOL["bf16_out"]
    np.testing.assert_array_equal(q_out.reshape(T, -1, D)[:, nH:], qkv.reshape(T, -1, D)[:, nH:])  # k/v untouched
    want = f32(cache).copy()
    ref.kv_write(want, layer, k_ref, x[:, nH + nKV:], slots)
    written = np.zeros(cache.shape, dtype=bool)
    ok = slots >= 0
    written[slots[ok] // 16, layer, :, :, slots[ok] % 16, :] = True
    # every slot not written is bit-identical (padding rows and other layers included)
    np.testing.assert_array_equal(cache_out[~written], cache[~written])
    assert rel_err(f32(cache_out)[written], want[written]) < TOL["bf16_out"]
    # V is a copy: exact
    np.testing.assert_array_equal(cache_out[slots[ok] // 16, layer, 1, :, slots[ok] % 16, :],
                                  qkv.reshape(T, -1, D)[ok, nH + nKV:])


def f32_to_bf16_pos(rng, n):
    from openinfer.safetensors_io import f32_to_bf16
    return f32_to_bf16(1.0 + 0.1 * rng.standard_normal(n).astype(np.float32))


def _attention_case(rng, nH, nKV, seqs, L=2, layer=1):
    """seqs: list of (cached_prefix, new_tokens). Returns the op inputs and the fp32 reference."""
    total_blocks = sum(-(-(p + n) // 16) for p, n in seqs) + 3
    perm = rng.permutation(np.arange(1, total_blocks))  # shuffled, non-consecutive physical blocks
    cache = _cache(rng, total_blocks, L, nKV)
    M = max(-(-(p + n) // 16) for p, n in seqs)
    bt = np.zeros((len(seqs), M), dtype=np.int32)
    qsl, ctx, pos = [0], [], []
    used = 0
    for b, (p, n) in enumerate(seqs):
        nb = -(-(p + n) // 16)
        bt[b, :nb] = perm[used:used + nb]
        used += nb
        qsl.append(qsl[-1] + n)
        ctx.append(p + n)
        pos.extend(range(p, p + n))
    T = qsl[-1]
    qkv = rand_bf16(rng, (T, (nH + 2 * nKV) * D))
    qsl, ctx, pos = (np.array(a, dtype=np.int32) for a in (qsl, ctx, pos))
    q = f32(qkv).reshape(T, -1, D)[:, :nH]
    want = ref.paged_attention(q, f32(cache), layer, pos, qsl, ctx, bt)
    return (qkv, cache.reshape(-1), bt, qsl, ctx, pos, layer, L, nH, nKV), want


ATTN_CASES = {
    "decode_b1_ctx1": [(0, 1)],
    "decode_b1_block_edges": [(15, 1)],
    "decode_b1_17": [(16, 1)],
    "decode_b1_1000": [(999, 1)],
    "decode_b1_32k": [(32767, 1)],
    "decode_b7_mixed": [(0, 1), (15, 1), (16, 1), (31, 1), (32, 1), (100, 1), (4097, 1)],
    "prefill_one_shot_odd": [(0, 111)],
    "prefill_chunk_after_prefix": [(37, 50)],
    "prefill_chunk_at_block_edge": [(32, 16)],
    "mixed_prefill_and_decode": [(0, 33), (70, 1), (5, 17), (200, 1)],
    # a few tokens per item keep the one-warp decode kernel (and its split clusters) with causal masks
    "decode_multi_token_chunks": [(4000, 2), (300, 1), (2000, 3)],
}


@pytest.mark.parametrize("model", ["0.6b", "4b", "32b"])
@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_paged_attention(model, case):
    _, _, nH, nKV = SHAPES[model]
    rng = np.random.default_rng(abs(hash((model, case))) % 2**32)
    args, want = _attention_case(rng, nH, nKV, ATTN_CASES[case])
    # single pass, the launch heuristic, an odd count (no clusters), clusters of 2, 4 (12 splits), 16 (48)
    for splits in (1, 0, 7, 2, 12, 48):
        got, used = ops().paged_attention(*args, splits)
        err = rel_err(f32(got).reshape(want.shape), want)
        assert err < TOL["attention"], (splits, used, err)


@pytest.mark.parametrize("cap", [8, 2, 1])
def test_paged_attention_smaller_cluster_cap(cap):
    """A device that cannot hold a cluster of 16 (MPS SM limits, small MIG slices) gets smaller clusters
    and the workspace merge between them (cap 1: no clusters); forced here on any GPU."""
    _, _, nH, nKV = SHAPES["4b"]
    rng = np.random.default_rng(cap)
    args, want = _attention_case(rng, nH, nKV, ATTN_CASES["decode_b7_mixed"])
    for splits in (2, 12, 16, 48):
        got, used = ops().paged_attention(*args, splits, cluster_cap=cap)
        err = rel_err(f32(got).reshape(want.shape), want)
        assert err < TOL["attention"], (cap, splits, err)


@pytest.mark.parametrize("model", ["4b", "32b"])
@pytest.mark.parametrize("case", ["decode_b1_ctx1", "decode_b1_17", "decode_b1_1000", "decode_b1_32k",
                                  "decode_b7_mixed", "decode_two_token_chunks"])
def test_decode_key_warps_equal_one_warp_blocks(model, case):
    """Decode blocks of four warps that split the keys (split counts that are multiples of 4) compute
    what one-warp blocks compute, with merges in one cluster, across clusters (the workspace) and in
    clusters of 1; 4B fills 4 of a block's 16 query rows per token, 32B 8 (16 with two tokens)."""
    import zlib

    _, _, nH, nKV = SHAPES[model]
    group = nH // nKV
    seqs = {"decode_two_token_chunks": [(4000, 2), (300, 1), (2000, 2)]}.get(case) or ATTN_CASES[case]
    rng = np.random.default_rng(zlib.crc32(f"{model}/{case}".encode()))
    args, want = _attention_case(rng, nH, nKV, seqs)
    num_work, max_rows = len(seqs), max(n for _, n in seqs) * group  # decode items: one per sequence
    assert max_rows <= 16
    for cap in (0, 2):  # the device's clusters, then clusters of at most 2 (several per item)
        for splits in (4, 12, 16, 48, 64, 0):
            got = {}
            for on in (True, False):
                out, used = ops().paged_attention(*args, splits, key_warps=on, cluster_cap=cap)
                shape = ops().attention_launch_shape(num_work, max_rows, used, key_warps=on, cluster_cap=cap)
                assert shape["key_warps"] == (on and used % 4 == 0), (splits, used, shape)
                got[on] = f32(out).reshape(want.shape)
                assert rel_err(got[on], want) < TOL["attention"], (cap, splits, on)
            assert rel_err(got[True], got[False]) < TOL["attention"] / 2, (cap, splits)


# Verify spans (8 tokens: DSpark; 16: DFlash) after 0, 5, 1,000 and 4,095 cached keys, one sequence or three.
SHORT_CASES = {f"span{n}_{name}": [(p, n) for p in prefixes] for n in (8, 16)
               for name, prefixes in (("after0", [0]), ("after5", [5]), ("after1000", [1000]), ("after4095", [4095]),
                                      ("three_0_5_1000", [0, 5, 1000]), ("three_5_1000_4095", [5, 1000, 4095]))}


def _short_case(model, case):
    import zlib

    _, _, nH, nKV = SHAPES[model]
    seqs = SHORT_CASES[case]
    rng = np.random.default_rng(zlib.crc32(f"short/{model}/{case}".encode()))
    args, want = _attention_case(rng, nH, nKV, seqs)
    return args, want, nH // nKV, seqs


@pytest.mark.parametrize("model", ["4b", "32b"])
@pytest.mark.parametrize("case", list(SHORT_CASES))
def test_paged_attention_short_items(model, case):
    """Short chunks in items of 16 query rows (attention_work's short items: 4 tokens at the 4B's group of 4, 2 at
    the 32B's 8), several items per sequence side by side with causal masks inside each: the decode launch (key
    warps and cluster merges at split counts that are multiples of 4, one-warp blocks and the merge kernel at 7,
    one pass at 1) against the reference, at any context (the op cuts whatever the context, as a verify graph)."""
    args, want, group, seqs = _short_case(model, case)
    items, max_rows = ops().attention_work(args[3], group, short_items=True)
    assert max_rows == 16 and len(items) == sum(n for _, n in seqs) * group // 16, items
    assert all(lead == tok - args[3][seq] for seq, tok, _, lead in items)
    for splits in (1, 0, 7, 4, 12, 16, 48, 64):
        got, used = ops().paged_attention(*args, splits, short_items=True)
        shape = ops().attention_launch_shape(len(items), max_rows, used)
        assert shape["key_warps"] == (used % 4 == 0), (splits, used, shape)
        err = rel_err(f32(got).reshape(want.shape), want)
        assert err < TOL["attention"], (splits, used, err)


@pytest.mark.parametrize("model", ["4b", "32b"])
@pytest.mark.parametrize("case", list(SHORT_CASES))
def test_short_items_equal_long_items(model, case):
    """The same spans as one row-warp item per sequence (the items of steps past ATTN_SHORT_ITEMS_MAX_CTX keys,
    and of --deterministic ones) and as short items: the same function, within the kernels' tolerance."""
    args, want, group, seqs = _short_case(model, case)
    items, max_rows = ops().attention_work(args[3], group)
    assert len(items) == len(seqs) and max_rows == seqs[0][1] * group
    for splits in (0, 1):
        short, _ = ops().paged_attention(*args, splits, short_items=True)
        whole, _ = ops().paged_attention(*args, splits)
        assert rel_err(f32(whole).reshape(want.shape), want) < TOL["attention"], splits
        assert rel_err(f32(short), f32(whole)) < TOL["attention"], splits


@pytest.mark.parametrize("batch,ctx", [(b, c) for b in (1, 3, 64, 256) for c in (1, 17, 1024, 8191)
                                       if (b, c) != (256, 8191)])
def test_split_attention_equals_single_pass(batch, ctx):
    """Flash-decoding splits must compute the same function as one pass (4B geometry). Not 256 x 8191:
    its grid fills the GPU with one split (nothing to compare) and its reference took 99 s of the suite."""
    _, _, nH, nKV = SHAPES["4b"]
    rng = np.random.default_rng(batch * 100003 + ctx)
    lens = rng.integers(max(1, ctx // 2), ctx + 1, batch)
    args, want = _attention_case(rng, nH, nKV, [(int(c) - 1, 1) for c in lens], L=1, layer=0)
    one, _ = ops().paged_attention(*args, 1)
    split, used = ops().paged_attention(*args, 0)
    assert rel_err(f32(one).reshape(want.shape), want) < TOL["attention"]
    assert rel_err(f32(split), f32(one)) < TOL["attention"] / 2, used


@pytest.mark.parametrize("model", ["4b", "32b"])
@pytest.mark.parametrize("n", [1, 17, 1024, 1025, 2500, 5000, 17000])
def test_segmented_attention_rows_do_not_depend_on_the_step(model, n):
    """Chunk-invariant attention (AttnArgs::segment, steps with prompt tokens): a token's row is the same
    bits whether computed inside the whole prompt (items of 16 or 8 tokens from position 0), in a tail of
    16 after its cached prefix, alone, beside other sequences (other rows per block), as one of 64 decode
    rows, split one segment per block or folded in one block; and the tail is close to the fp32 reference."""
    _, _, nH, nKV = SHAPES[model]
    S = ops().ATTN_SEGMENT
    rng = np.random.default_rng(n * 31 + nH)
    nb = -(-n // 16)
    bt = rng.permutation(np.arange(1, nb + 4))[:nb].astype(np.int32)[None, :]  # scattered pages
    cache = _cache(rng, nb + 4, 2, nKV)
    qkv = rand_bf16(rng, (n, (nH + 2 * nKV) * D))
    i32 = lambda *a: np.array(a[0] if len(a) == 1 else a, dtype=np.int32)  # noqa: E731

    def run(seqs, splits):
        """seqs: (first position, count, context) of the one sequence's tokens, each its own sequence
        in the launch over the same pages; out rows in the order given."""
        rows = np.concatenate([np.arange(p0, p0 + k) for p0, k, _ in seqs])
        qsl = i32(np.cumsum([0] + [k for _, k, _ in seqs]))
        ctx = i32([c for _, _, c in seqs])
        out, used = ops().paged_attention(qkv[rows], cache.reshape(-1), np.repeat(bt, len(seqs), 0), qsl, ctx,
                                          i32(rows), 1, 2, nH, nKV, splits, segment=S)
        return out, used, rows

    full, used, _ = run([(0, n, n)], 1)
    assert used == 1
    segments = -(-n // S)
    t = min(16, n)
    cases = {"tail": [(n - t, t, n)], "last_row": [(n - 1, 1, n)],
             "tail_beside_others": [(0, min(n, 100), min(n, 100)), (n - t, t, n), (0, 1, 1)],
             "64_decode_rows": [(int(p), 1, int(p) + 1) for p in np.sort(rng.integers(0, n, 63))] + [(n - 1, 1, n)]}
    for name, seqs in cases.items():
        for splits in (1, 0):  # folded in one block; the launch's choice (a split per segment on a small grid)
            out, used, rows = run(seqs, splits)
            assert splits == 1 or used in (1, segments), (name, used)
            np.testing.assert_array_equal(out, full[rows], err_msg=f"{name}, splits {splits} (used {used})")
    if 1 < segments <= 20:  # a split per segment, forced, for the whole prompt too (17,000 rows x 67: 19 GB)
        out, used, _ = run([(0, n, n)], segments)
        np.testing.assert_array_equal(out, full, err_msg="whole prompt split per segment")
    q = f32(qkv[n - t:]).reshape(t, -1, D)[:, :nH]
    want = ref.paged_attention(q, f32(cache), 1, i32(np.arange(n - t, n)), i32(0, t), i32([n]), bt)
    assert rel_err(f32(full[n - t:]).reshape(want.shape), want) < TOL["attention"]


def test_split_attention_32k_batch1_fills_gpu():
    _, _, nH, nKV = SHAPES["4b"]
    rng = np.random.default_rng(32)
    args, want = _attention_case(rng, nH, nKV, [(32767, 1)], L=1, layer=0)
    got, used = ops().paged_attention(*args, 0)
    assert used >= 16, f"batch 1 at 32k should split the keys across blocks, used {used}"
    assert rel_err(f32(got).reshape(want.shape), want) < TOL["attention"]


def _logits(rng, S, scale=3.0):
    return (rng.standard_normal((S, V)) * scale).astype(np.float32)


@pytest.mark.parametrize("S", [1, 5, 33])
def test_sampling_matches_reference(S):
    rng = np.random.default_rng(S)
    logits = _logits(rng, S)
    temp = rng.choice([0.0, 0.5, 1.0, 1.3], S).astype(np.float32)
    top_p = rng.choice([1.0, 0.9, 0.5, 0.05], S).astype(np.float32)
    top_k = rng.choice([0, 1, 20, 1000], S).astype(np.int32)
    temp[0], top_p[0], top_k[0] = 0.8, 0.95, 20  # the releases' defaults in row 0
    _sample_like_reference(rng, logits, temp, top_p, top_k, 5)


def _sample_like_reference(rng, logits, temp, top_p, top_k, num_logprobs):
    """Samples with random seeds and positions; tokens, their logprobs and the top logprobs must be the
    reference's. Returns the tokens."""
    S = len(logits)
    seeds = rng.integers(0, 2**63, S, dtype=np.uint64)
    pos = rng.integers(0, 40000, S).astype(np.int32)
    tok, lp, top_ids, top_lps = ops().sample(logits, temp, top_p, top_k, seeds, pos, num_logprobs)
    np.testing.assert_array_equal(tok, ref.sample(logits, temp, top_p, top_k, seeds, pos))
    lsm = ref.log_softmax(logits)
    np.testing.assert_allclose(lp, lsm[np.arange(S), tok], rtol=1e-5, atol=1e-4)
    want_ids, want_lps = ref.top_logprobs(lsm, num_logprobs)
    np.testing.assert_array_equal(top_ids, want_ids)
    np.testing.assert_allclose(top_lps, want_lps, rtol=1e-5, atol=1e-4)
    return tok


def test_sampling_gather_and_whole_row_paths():
    """The survivors are usually gathered (logits above a pivot from the threads' maxima, at most 1024)
    and sorted; many ties, a top-k above 1024 or a nucleus wider than 256 candidates read the whole row
    instead, and so do top-logprobs past the gather. Both paths draw what the reference draws, and the
    same again on a second run."""
    rng = np.random.default_rng(7)
    S = 8
    logits = _logits(rng, S)
    logits[0, rng.choice(V, 2000, replace=False)] = 12.0  # top-k 20 keeps 2000 ties: past the gather
    logits[1, rng.choice(V, 700, replace=False)] = 12.0  # 700 ties: gathered
    temp = np.full(S, 0.7, np.float32)
    top_p = np.array([0.9, 0.9, 0.95, 1.0, 0.5, 0.3, 0.99, 0.9], np.float32)
    # 1024 and 1025 crowd the gather; no top-k: a narrow nucleus (gathered), a wide one (whole row)
    top_k = np.array([20, 20, 5000, 1024, 1025, 0, 0, 1], np.int32)
    seeds = rng.integers(0, 2**63, S, dtype=np.uint64)
    pos = rng.integers(0, 40000, S).astype(np.int32)
    tok, _, top_ids, top_lps = ops().sample(logits, temp, top_p, top_k, seeds, pos, 7)
    np.testing.assert_array_equal(tok, ref.sample(logits, temp, top_p, top_k, seeds, pos))
    assert tok[7] == logits[7].argmax()
    want_ids, want_lps = ref.top_logprobs(ref.log_softmax(logits), 7)  # row 0: 2000 ties, past the gather
    np.testing.assert_array_equal(top_ids, want_ids)
    np.testing.assert_allclose(top_lps, want_lps, rtol=1e-5, atol=1e-4)
    again, *_ = ops().sample(logits, temp, top_p, top_k, seeds, pos, 0)
    np.testing.assert_array_equal(again, tok)


def test_sampling_greedy_ties_and_seed_reproducible():
    rng = np.random.default_rng(1)
    logits = _logits(rng, 4)
    logits[0, [10, 20]] = 100.0  # a tie: the lowest id wins
    zeros = np.zeros(4, np.float32)
    tok, *_ = ops().sample(logits, zeros, np.ones(4, np.float32), np.zeros(4, np.int32),
                           np.zeros(4, np.uint64), np.zeros(4, np.int32), 0)
    assert tok[0] == 10
    np.testing.assert_array_equal(tok, logits.argmax(1))
    args = (logits, np.ones(4, np.float32), np.full(4, 0.9, np.float32), np.zeros(4, np.int32),
            np.array([7, 7, 8, 9], np.uint64), np.full(4, 3, np.int32), 0)
    a, b = ops().sample(*args)[0], ops().sample(*args)[0]
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("vocab", [V, V - 1])
def test_sampling_row_layouts_and_ties(vocab):
    """The row passes read float4 with several loads in flight per thread (V a multiple of 4) or scalars
    (any other V); greedy ties go to the lowest id inside one float4, across one thread's loads and
    across threads, and both layouts draw what the reference draws."""
    rng = np.random.default_rng(vocab)
    S = 6
    logits = (rng.standard_normal((S, vocab)) * 3.0).astype(np.float32)
    logits[0, [9, 8]] = 100.0  # one float4 (elements 8..11)
    logits[1, [40 + 32768, 40 + 4096, 40]] = 100.0  # one thread: the same lane, later loads
    logits[2, [4 * 1023 + 3, 4 * 5]] = 100.0  # two threads
    temp = np.array([0.0, 0.0, 0.0, 0.7, 0.7, 1.0], np.float32)
    top_p = np.array([1.0, 1.0, 1.0, 0.95, 0.6, 1.0], np.float32)
    top_k = np.array([0, 0, 0, 20, 0, 1000], np.int32)
    tok = _sample_like_reference(rng, logits, temp, top_p, top_k, 4)
    assert list(tok[:3]) == [8, 40, 20]


def test_sampling_signed_zero_and_rows_without_a_maximum():
    """-0 ties with +0 (top-k 1 keeps both, as the reference does), and a row of -inf only (no maximum)
    gives token 0 instead of reading past the row."""
    S = 12
    logits = np.full((S, V), -10.0, np.float32)
    logits[:, 5], logits[:, 3] = 0.0, -0.0
    logits[-1] = -np.inf
    temp, top_p, top_k = np.ones(S, np.float32), np.ones(S, np.float32), np.ones(S, np.int32)
    seeds, pos = np.arange(S, dtype=np.uint64), np.zeros(S, np.int32)
    tok, *_ = ops().sample(logits, temp, top_p, top_k, seeds, pos, 0)
    np.testing.assert_array_equal(tok[:-1], ref.sample(logits[:-1], temp[:-1], top_p[:-1], top_k[:-1], seeds[:-1],
                                                       pos[:-1]))
    assert set(tok[:-1]) == {3, 5}, tok  # both drawn over 11 seeds
    assert tok[-1] == 0


def test_sampling_distribution():
    """Many draws from a small-support distribution follow its softmax (top-k 4 keeps 4 tokens)."""
    n = 4000
    logits = np.full((n, V), -20.0, np.float32)
    logits[:, [3, 9, 11, 500, 600]] = np.array([1.0, 0.5, 0.0, -0.5, -3.0], np.float32)
    tok, *_ = ops().sample(logits, np.ones(n, np.float32), np.ones(n, np.float32), np.full(n, 4, np.int32),
                           np.arange(n, dtype=np.uint64), np.zeros(n, np.int32), 0)
    assert set(np.unique(tok)) <= {3, 9, 11, 500}
    p = np.exp([1.0, 0.5, 0.0, -0.5])
    p /= p.sum()
    freq = np.array([(tok == t).mean() for t in (3, 9, 11, 500)])
    assert np.abs(freq - p).max() < 0.03, (freq, p)


def test_random_init_moments():
    from openinfer import _engine
    x = f32(_engine.ops.fill_normal_stats(1 << 22, 123, 0.0, 0.02))
    assert abs(x.mean()) < 1e-4 and abs(x.std() - 0.02) < 2e-4


# ---- fused small-batch GEMM (decode): prologue (RMSNorm, SiLU·up) and epilogue (residual add, fp32) ----
GEMV_CASES = {  # (N, K, prologue, epilogue) of each fused projection; epilogue 3 = SiLU(gate)·up
    "4b": [(6144, 2560, 1, 0), (2560, 4096, 0, 1), (19456, 2560, 1, 3), (2560, 9728, 0, 1), (V, 2560, 1, 2)],
    "8b": [(6144, 4096, 1, 0), (4096, 4096, 0, 1), (24576, 4096, 1, 3), (4096, 12288, 0, 1)],
    "32b": [(10240, 5120, 1, 0), (5120, 8192, 0, 1), (51200, 5120, 1, 3), (5120, 25600, 0, 1)],
    "odd": [(37, 512, 1, 0), (38, 768, 0, 1), (22, 512, 1, 3)],  # partial tiles
}
_W: dict = {}
GEMV_KERNELS = {"fp32_input": 1, "bf16_input": 2, "tensor_cores": 3}  # ops.gemv's kernel choices


def _weights(N, K):
    if (N, K) not in _W:  # drawn once per shape: the tests vary the rows, not the weights
        _W[(N, K)] = rand_bf16(np.random.default_rng(N + K), (N, K), 1.0 / np.sqrt(K))
    return _W[(N, K)]


def _gemv_ref(x, nw, w, pro, epi, y0):
    from openinfer.safetensors_io import bf16_to_f32, f32_to_bf16
    xf = f32(x)
    if pro == 1:
        xf = ref.rmsnorm(xf, f32(nw), 1e-6)
    out = xf @ f32(w).T
    if epi == 3:  # gate and up are rounded to bf16 before SiLU·up, as by the unfused kernels
        rb = bf16_to_f32(f32_to_bf16(out))
        half = out.shape[1] // 2
        return ref.silu_mul(rb[:, :half], rb[:, half:])
    return out if y0 is None else out + f32(y0)


@pytest.mark.parametrize("mode", ["fp32_input", "bf16_input", "tensor_cores"])
@pytest.mark.parametrize("model", list(GEMV_CASES))
@pytest.mark.parametrize("M", [1, 2])
def test_fused_gemv(model, M, mode):
    """Both stagings of the input: fp32 (the default where it fits; 32B's down projection stays bf16) and bf16;
    and the tensor-core kernel (bf16 input, two rows per warp: the odd shapes end on half a pair)."""
    kernel = GEMV_KERNELS[mode]
    for N, K, pro, epi in GEMV_CASES[model]:
        fits = (M + (pro == 1)) * K * 2 <= 200 * 1024  # the bf16 staging
        assert ops().gemv_takes_tensor_cores(M, K, pro, epi, kernel) == (mode == "tensor_cores" and fits)
    _fused_gemv_case(model, M, kernel)


def test_fused_gemv_tensor_cores_rows_agree():
    """The tensor-core kernel gives a row the same bits alone and beside another row, and stays within
    fp32-accumulation noise of the CUDA-core kernel on the bf16 staging."""
    rng = np.random.default_rng(7)
    N, K = 2560, 9728
    w = _weights(N, K)
    x = rand_bf16(rng, (2, K), 2.0)
    tc, bf16_cores = GEMV_KERNELS["tensor_cores"], GEMV_KERNELS["bf16_input"]
    two = f32(ops().gemv(x, None, w, 2, N, K, 0, 0, None, 1e-6, tc))
    one = f32(ops().gemv(x[:1], None, w, 1, N, K, 0, 0, None, 1e-6, tc))
    cuda_cores = f32(ops().gemv(x, None, w, 2, N, K, 0, 0, None, 1e-6, bf16_cores))
    np.testing.assert_array_equal(one[0], two[0])
    assert rel_err(two, cuda_cores) < TOL["bf16_out"]
    # the kernels sum in different orders, so some of the 5120 outputs round apart: the tensor cores ran
    assert not np.array_equal(two, cuda_cores)


def test_fused_gemv_kernel_choice():
    """The engine's choice (kernel 0) takes the tensor cores where they measured faster: two rows but
    lm_head's fp32 output, one row from K = 8192; the CUDA-core kernels never, the tensor-core one always
    (within the GEMV's 1-2 rows)."""
    rule = {  # (M, K, prologue, epilogue): mode 1's choice
        (1, 2560, 1, 0): False, (1, 4096, 0, 1): False, (1, 2560, 1, 3): False, (1, 9728, 0, 1): True,
        (1, 2560, 1, 2): False, (1, 25600, 0, 1): True, (2, 2560, 1, 0): True, (2, 4096, 1, 3): True,
        (2, 12288, 0, 1): True, (2, 2560, 1, 2): False, (3, 2560, 1, 0): False}
    for kernel in (0, 1, 2, 3):
        for (M, K, pro, epi), want in rule.items():
            got = ops().gemv_takes_tensor_cores(M, K, pro, epi, kernel)
            assert got == (M <= 2 and (kernel == 3 or (kernel == 0 and want))), (kernel, M, K, pro, epi)


def _fused_gemv_case(model, M, kernel):
    rng = np.random.default_rng(M * 31 + len(model))
    for N, K, pro, epi in GEMV_CASES[model]:
        x = rand_bf16(rng, (M, K), 2.0)
        nw = f32_to_bf16_pos(rng, K) if pro == 1 else None
        w = _weights(N, K)
        y0 = rand_bf16(rng, (M, N)) if epi == 1 else None
        got = ops().gemv(x, nw, w, M, N, K, pro, epi, y0, 1e-6, kernel)
        if got is None:  # staged input too large for shared memory: the engine falls back to cuBLASLt
            assert (M + (pro == 1)) * K * 2 > 200 * 1024, (N, K, M)  # staged input (and norm weight)
            continue
        want = _gemv_ref(x, nw, w, pro, epi, y0)
        tol = 1e-4 if epi == 2 else TOL["bf16_gemm"]
        if pro or epi == 3:  # the staged input / gate and up are rounded to bf16 like the unfused kernels' outputs
            tol = max(tol, TOL["bf16_out"])
        assert rel_err(f32(got) if epi != 2 else got, want) < tol, (N, K, pro, epi)


def test_fused_gemv_refuses_large_rows():
    rng = np.random.default_rng(0)
    for M in (3, 5):  # cuBLASLt from 3 rows on
        x = rand_bf16(rng, (M, 256))
        assert ops().gemv(x, None, rand_bf16(rng, (64, 256)), M, 64, 256, 0, 0, None, 1e-6) is None


@pytest.mark.parametrize("D,sampled,Vm,ties", [(1, False, 4099, False), (3, False, 4099, False), (8, True, 4099, False),
                                               (13, True, 4100, False), (16, False, 4099, True), (9, True, 4100, True)])
def test_markov_sample_one_launch(D, sampled, Vm, ties):
    """The DSpark Markov head's one-launch pass (every draft slot, left to right): each slot's logits are
    the lm_head's + W2 · W1[the kernel's own previous token] (the anchor for slot 0) within fp32 GEMV
    error, and each token is exactly what the sampler draws from the kernel's logits (greedy: the
    maximum, lowest id among ties; sampled rows with their seeds and positions). Vocabularies that are no
    multiple of the 16-row tile; 4100 rows are 16-byte aligned (the sampler's vector loads). With ties:
    equal maxima in tiles of different blocks (the lowest id must win across the blocks' partials)."""
    nd, R = 7, 256
    rng = np.random.default_rng(D * 31 + sampled)
    logits = (rng.standard_normal((nd * D, Vm)) * 2.0).astype(np.float32)
    w1, w2 = rand_bf16(rng, (Vm, R), 0.5), rand_bf16(rng, (Vm, R), 0.5)
    tie_ids = 5 + 16 * np.array([200, 40, 130, 41])  # the same lane of 4 tiles (blocks 6, 1, 4, 1 of 32 warps)
    tie_rows = np.tile(np.arange(D) % 3 == 0, nd)
    if ties:  # equal W2 rows at the same place of their tiles: bit-equal MMA sums, well above the other logits
        w2[tie_ids] = w2[tie_ids[0]]
        logits[np.ix_(tie_rows, tie_ids)] = 60.0
    anchors = rng.integers(0, Vm, D).astype(np.int32)
    temp = np.zeros(nd * D, np.float32)
    if sampled:  # a sequence's rows share its parameters in every slot; here every other sequence samples
        temp = np.tile(np.where(np.arange(D) % 2 == 1, 0.8, 0.0), nd).astype(np.float32)
    top_p = np.tile(rng.choice([1.0, 0.9], D), nd).astype(np.float32)
    top_k = np.tile(rng.choice([0, 20], D), nd).astype(np.int32)
    seeds = np.tile(rng.integers(0, 2**63, D, dtype=np.uint64), nd)
    pos = (np.arange(nd)[:, None] + rng.integers(10, 4000, D)[None, :]).reshape(-1).astype(np.int32)
    got = ops().markov_sample(logits, w1, w2, anchors, temp, top_p, top_k, seeds, pos, nd, Vm, R)
    assert got is not None
    tok, out = got
    W1, W2 = f32(w1), f32(w2)
    prev = anchors
    for j in range(nd):
        rows = slice(j * D, (j + 1) * D)
        want = logits[rows] + W1[prev] @ W2.T
        assert rel_err(out[rows], want) < 1e-5
        np.testing.assert_array_equal(tok[rows], ref.sample(out[rows], temp[rows], top_p[rows], top_k[rows],
                                                            seeds[rows], pos[rows]))
        prev = tok[rows]
    if ties:  # the case was in play: greedy tie rows took the lowest of the tied ids
        greedy_ties = tie_rows & (temp <= 0)
        assert greedy_ties.any() and (tok[greedy_ties] == tie_ids.min()).all()


def test_markov_sample_refuses_what_it_does_not_take():
    """More sequences than one launch takes, or a rank that is no multiple of 64: None (the caller runs
    the slots one by one)."""
    def call(D, R):
        z = np.zeros
        return ops().markov_sample(z((D, 64), np.float32), z((64, R), np.uint16), z((64, R), np.uint16),
                                   z(D, np.int32), z(D, np.float32), np.ones(D, np.float32), z(D, np.int32),
                                   z(D, np.uint64), z(D, np.int32), 1, 64, R)
    assert call(17, 256) is None and call(2, 96) is None and call(2, 512) is None
    assert call(2, 128) is not None

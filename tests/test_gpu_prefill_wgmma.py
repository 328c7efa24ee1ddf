"""The Hopper prefill attention kernel (csrc/kernels/attention_sm90.cu: wgmma, TMA; the engine's for prompt
chunks on compute capability 9.0) against the NumPy fp32 reference and against the mma.sync kernel it replaced.

Run it with -x: the first tests are small layout checks whose failure messages name the
broken piece (the V operand and the output rows; the N-major V descriptor; the K operand, Q layout or the P
fragments), before the real shapes, which only say that something is wrong.

prefill_wgmma=2 forces the kernel (the binding raises where it refuses the launch, so a refusal cannot pass as the
old kernel's result); 0 is the mma.sync kernel. The binding NaN-fills the output, so a row the kernel skips fails.

Tolerances. Against the reference: TOL["attention"] (1e-2 relative Frobenius), the same as the mma.sync kernel's
tests; both round P to bf16 before P·V and the output to bf16, which is ~2-4e-3 at these sizes. Against the mma.sync
kernel: the new kernel's error may not exceed 1.25 x the old one's + 1e-3 (it must be as accurate as what it
replaces, not merely inside the band), and the two outputs must agree within TOL["attention"].
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from openinfer.reference import ops as ref
from openinfer.safetensors_io import f32_to_bf16
from gpu_util import NO_GPU, TOL, f32, rand_bf16, rel_err, requires_gpu

D = 128
SHAPES = {"0.6b": (16, 8), "4b": (32, 8), "32b": (64, 8)}  # (query heads, KV heads): groups 2, 4, 8


def _why_not_hopper() -> str | None:
    if NO_GPU is not None:
        return NO_GPU
    from openinfer import _engine
    return None if _engine.ops.prefill_wgmma_device() else "the wgmma kernel needs a compute capability 9.0 GPU"


NOT_HOPPER = _why_not_hopper()
pytestmark = requires_gpu + [pytest.mark.skipif(NOT_HOPPER is not None, reason=f"sm_90 test: {NOT_HOPPER}")]


def ops():
    from openinfer import _engine
    return _engine.ops


class Case:
    """One launch's inputs: seqs = [(cached prefix, new tokens)], each sequence's pages shuffled over the cache."""

    def __init__(self, rng, nH, nKV, seqs, L=2, layer=1):
        self.nH, self.nKV, self.L, self.layer, self.seqs = nH, nKV, L, layer, seqs
        total = sum(-(-(p + n) // 16) for p, n in seqs) + 3
        perm = rng.permutation(np.arange(1, total))
        self.cache = rand_bf16(rng, (total, L, 2, nKV, 16, D))
        width = max(-(-(p + n) // 16) for p, n in seqs)
        self.bt = np.zeros((len(seqs), width), dtype=np.int32)
        qsl, ctx, pos, used = [0], [], [], 0
        for b, (p, n) in enumerate(seqs):
            nb = -(-(p + n) // 16)
            self.bt[b, :nb] = perm[used:used + nb]
            used += nb
            qsl.append(qsl[-1] + n)
            ctx.append(p + n)
            pos.extend(range(p, p + n))
        self.T = qsl[-1]
        self.qsl, self.ctx, self.pos = (np.array(a, dtype=np.int32) for a in (qsl, ctx, pos))
        self.qkv = rand_bf16(rng, (self.T, (nH + 2 * nKV) * D))

    def slot(self, b, j):
        """(block, offset) of sequence b's key j."""
        return self.bt[b, j // 16], j % 16

    def set_k(self, b, kvh, j, vec):
        blk, off = self.slot(b, j)
        self.cache[blk, self.layer, 0, kvh, off] = vec

    def v(self, b, kvh, j):
        blk, off = self.slot(b, j)
        return self.cache[blk, self.layer, 1, kvh, off]

    def q(self):
        return self.qkv.reshape(self.T, -1, D)[:, :self.nH]  # a view: writes go into qkv

    def run(self, mode):
        out, used = ops().paged_attention(self.qkv, self.cache.reshape(-1), self.bt, self.qsl, self.ctx, self.pos,
                                          self.layer, self.L, self.nH, self.nKV, 1, prefill_wgmma=mode)
        assert used == 1
        return out.reshape(self.T, self.nH, D)

    def reference(self, b=None, rows=None):
        """fp32 reference of every row, or of `rows` (token indices) of sequence b alone."""
        q = f32(self.qkv).reshape(self.T, -1, D)[:, :self.nH]
        if rows is None:
            return ref.paged_attention(q, f32(self.cache), self.layer, self.pos, self.qsl, self.ctx, self.bt)
        rows = np.asarray(rows)
        return ref.paged_attention(q[rows], f32(self.cache), self.layer, self.pos[rows],
                                   np.array([0, len(rows)], np.int32), self.ctx[b:b + 1], self.bt[b:b + 1])


def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


# ---- layout tests: small inputs with exact answers ----

@pytest.mark.parametrize("model", list(SHAPES))
def test_layout_one_key_returns_its_v_row(model):
    """One token at position 0 sees one key: softmax 1, so each head's output is its KV head's V row, exactly.
    Checks the V tile (first page, row 0), the V operand for k = 0, the zeroed tail of the tile (keys 1..127 were
    never loaded) and which output row each (token, head) lands in."""
    nH, nKV = SHAPES[model]
    c = Case(_rng("one_key", model), nH, nKV, [(0, 1)])
    got = c.run(2)[0]
    group = nH // nKV
    want = np.stack([c.v(0, h // group, 0) for h in range(nH)])
    if np.array_equal(got, want):
        return
    bad = [h for h in range(nH) if not np.array_equal(got[h], want[h])]
    h = bad[0]
    other = [h2 for h2 in range(nH) if np.array_equal(got[h], want[h2])]
    dims = np.flatnonzero(got[h] != want[h])
    raise AssertionError(
        f"heads {bad} differ from their V row; head {h}: " +
        (f"holds head {other}'s V row (output row mapping)" if other else
         f"dims {dims[:16].tolist()}... differ ({len(dims)} of 128; " +
         ("only dims 64-127: the second 64-dim half of V (its TMA box or the descriptor's leading byte offset)"
          if dims.min() >= 64 else "only dims 0-63: the first half of V" if dims.max() < 64 else
          "NaN: the tail of the tile was not zeroed, or P is not exactly 1" if np.isnan(f32(got[h])).any() else
          "both halves: the V operand (swizzle, transposed B) or the epilogue's column order") + ")"))


@pytest.mark.parametrize("model", ["4b", "32b"])
@pytest.mark.parametrize("n", [16, 200, 300])
def test_layout_zero_queries_average_v(model, n):
    """Q = 0: every visible score is 0, so row t is the plain mean of V over keys 0..t (P = 1 exactly in bf16; the
    sum in fp32). Checks P·V alone (V N-major through the descriptor, its halves, its 16-key steps), across tiles
    (n = 200: two, the second with a partial page and pages never loaded; 300: three, the stage ring wrapped)."""
    nH, nKV = SHAPES[model]
    c = Case(_rng("zero_q", model, n), nH, nKV, [(0, n)])
    c.q()[:] = 0
    got = f32(c.run(2))
    group = nH // nKV
    vals = np.stack([np.stack([f32(c.v(0, k, j)) for j in range(n)]) for k in range(nKV)])  # [nKV, n, D]
    means = np.cumsum(vals.astype(np.float64), 1) / np.arange(1, n + 1)[None, :, None]
    want = np.stack([means[h // group] for h in range(nH)], 1)  # [n, nH, D]
    err = rel_err(got, want)
    if err < TOL["bf16_out"]:
        return
    lo, hi = rel_err(got[..., :64], want[..., :64]), rel_err(got[..., 64:], want[..., 64:])
    by_tile = [rel_err(got[k:k + 128], want[k:k + 128]) for k in range(0, n, 128)]
    raise AssertionError(f"mean of V off by {err:.3g}: dims 0-63 {lo:.3g}, 64-127 {hi:.3g} (a half wrong: the V "
                         f"descriptor's leading byte offset or the second TMA box); rows by 128-token block "
                         f"{[f'{e:.3g}' for e in by_tile]} (only later blocks wrong: the stage ring or its barriers; "
                         f"the last only: the tail zeroing)")


@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("seq", [(0, 128), (0, 300), (37, 100)])
def test_layout_one_hot_scores_pick_one_key(model, seq):
    """Each key of a KV head gets a random +-8 code as its K row; each query row is 8 x the code of one visible key
    (its target). Its score is 8192 and every other key's at least 2,048 below (checked; ~260 in log2 units after the
    scale), so P is exactly one-hot and the row's output is exactly its target's V row. A wrong key names the
    piece: Q·Kᵀ's operands (Q rows, K rows, their dims) or the order of P's fragments in P·V."""
    nH, nKV = SHAPES[model]
    prefix, n = seq
    rng = _rng("one_hot", model, seq)
    c = Case(rng, nH, nKV, [seq])
    group, ctx = nH // nKV, prefix + n
    codes = rng.choice(np.array([-8.0, 8.0], np.float32), (nKV, ctx, D))
    for k in range(nKV):
        for j in range(ctx):
            c.set_k(0, k, j, f32_to_bf16(codes[k, j]))
    target = np.zeros((n, nH), np.int64)
    q = c.q()
    for i in range(n):
        p = prefix + i
        for h in range(nH):
            target[i, h] = (7 * i + 3 * h + 11 * (h // group)) % (p + 1)
            q[i, h] = f32_to_bf16(codes[h // group, target[i, h]])
            scores = codes[h // group, :p + 1] @ codes[h // group, target[i, h]]
            runner_up = np.sort(scores)[-2] if p > 0 else -np.inf
            assert runner_up <= 8192 - 2048, "codes too alike: reseed"
    got = c.run(2)
    wrong = []
    for i in range(n):
        for h in range(nH):
            want = c.v(0, h // group, target[i, h])
            if not np.array_equal(got[i, h], want):
                wrong.append((i, h))
    if not wrong:
        return
    i, h = wrong[0]
    matches = [j for j in range(prefix + i + 1) if np.array_equal(got[i, h], c.v(0, h // group, j))]
    raise AssertionError(
        f"{len(wrong)} of {n * nH} rows are not their target key's V row; first: token {i} (position {prefix + i}) "
        f"head {h}, target key {target[i, h]}, got " +
        (f"key {matches[0]}'s V row (offset {matches[0] - target[i, h]}: P's fragment order, or K rows in the wrong "
         f"place)" if matches else "no single key's V row (a blend: Q·Kᵀ is wrong, e.g. the Q or K swizzle, or "
         "dims of one half)") + f"; wrong rows (token, head) start {wrong[:8]}")


# ---- real and awkward shapes: reference and the mma.sync kernel ----

def _check(c, got_new, got_old, b=None, rows=None):
    """New and old kernel outputs (full) against the reference (every row, or `rows` of sequence b)."""
    want = c.reference(b, rows)
    sel = slice(None) if rows is None else np.asarray(rows)
    new, old = f32(got_new)[sel], f32(got_old)[sel]
    e_new, e_old = rel_err(new, want), rel_err(old, want)
    assert e_new < TOL["attention"], f"wgmma kernel vs reference {e_new:.3g} (mma.sync kernel: {e_old:.3g})"
    assert e_new <= 1.25 * e_old + 1e-3, f"wgmma kernel less accurate than the mma.sync kernel: {e_new:.3g} vs {e_old:.3g}"
    e_both = rel_err(f32(got_new), f32(got_old))
    assert e_both < TOL["attention"], f"wgmma vs mma.sync kernel over every row: {e_both:.3g}"


CASES = {
    "chunk_1024": [(0, 1024)],
    "odd_1": [(0, 1)],
    "odd_7": [(0, 7)],
    "odd_65": [(0, 65)],
    "odd_1000": [(0, 1000)],
    "prefix_37_chunk_300": [(37, 300)],
    "chunk_at_block_edge": [(32, 16)],
    "several_sequences": [(0, 1000), (37, 300), (5, 7), (0, 65), (500, 1), (16, 129)],
}


@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("case", list(CASES))
def test_prefill_matches_reference_and_mma_sync(model, case):
    nH, nKV = SHAPES[model]
    c = Case(_rng("real", model, case), nH, nKV, CASES[case])
    new, old = c.run(2), c.run(0)
    _check(c, new, old)
    np.testing.assert_array_equal(c.run(2), new, err_msg="the wgmma kernel is not deterministic")


@pytest.mark.parametrize("seq", [(0, 8192), (31744, 1024)], ids=["chunk_8192", "ctx_32k_tail_chunk"])
def test_prefill_long_4b(seq):
    """4B heads: an 8,192-token chunk, and the last 1,024 tokens of a 32k context after a cached prefix. The
    reference for a sample of rows (every row would be a 32 x 8k x 8k score tensor); every row against the mma.sync
    kernel."""
    nH, nKV = SHAPES["4b"]
    rng = _rng("long", seq)
    c = Case(rng, nH, nKV, [seq])
    n = seq[1]
    rows = np.unique(np.concatenate([np.arange(8), np.arange(n - 16, n), rng.integers(0, n, 40)]))
    new, old = c.run(2), c.run(0)
    _check(c, new, old, b=0, rows=rows)


def test_default_leaves_decode_items_to_the_old_kernels():
    """prefill_wgmma=1 (the engine's default) takes items of more than 16 rows only: a
    decode-only launch (4 rows per item) is the mma.sync path's, bit for bit; a mixed launch is the wgmma kernel's
    (max_rows > 16), as forced."""
    nH, nKV = SHAPES["4b"]
    c = Case(_rng("switch",), nH, nKV, [(15, 1), (100, 1), (4000, 1)])
    np.testing.assert_array_equal(c.run(1), c.run(0))
    m = Case(_rng("switch_mixed",), nH, nKV, [(0, 33), (70, 1), (5, 17)])
    np.testing.assert_array_equal(m.run(1), m.run(2))

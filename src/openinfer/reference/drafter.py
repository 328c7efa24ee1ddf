"""A DFlash / DSpark drafter in NumPy fp32 (the CPU backend's, and the oracle for the CUDA one).

Per committed token the target's residual streams after `target_layer_ids` become a context feature
c = hidden_norm(fc([h_l1 | h_l2 | ...])), the same for every drafter layer, projected by each layer's
k_proj (+ k_norm, RoPE at the token's position) and v_proj into the drafter's own paged K/V cache. It
shares the target's block ids (a block holds both models' K/V of its 16 tokens), so a prefix-cache hit
serves the drafter too. A round drafts one block [anchor, mask, ...] at positions p.. (p = the anchor's):
each layer's queries, keys and values of the block come from input_layernorm(x) of the block rows, and
the block attends to every context key (positions < p) and to the whole block, without a causal mask.
The Markov head (DSpark) adds W2 . W1[previous token] to each slot's logits, left to right.

Drafts are sampled with the request's sampling parameters and the noise the target's sampler uses for
the same position (docs/architecture.md, "Sampling"): a proposal the target would sample too is the
target's own sample, so acceptance is high where the drafter is good, and the tokens kept stay the
target's whatever the drafter proposes.
"""
from __future__ import annotations

import time

import numpy as np

from ..drafter import DrafterConfig
from . import ops

F32 = np.float32


class ReferenceDrafter:
    def __init__(self, cfg: DrafterConfig, weights: dict[str, np.ndarray], embed: np.ndarray, lm_head: np.ndarray,
                 num_blocks: int, block_size: int):
        self.cfg, self.w = cfg, {k: np.ascontiguousarray(v, dtype=F32) for k, v in weights.items()}
        self.embed, self.lm_head = embed, lm_head  # the target's (a DSpark checkpoint's copies are the same)
        self.block_size = block_size
        self.kv = np.zeros((num_blocks, cfg.num_hidden_layers, 2, cfg.num_key_value_heads, block_size, cfg.head_dim), F32)
        self.seconds = 0.0  # time spent drafting (the context K/V and the blocks)

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self.cfg.target_layer_ids

    def write_context(self, taps: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        """taps [T, n_taps, H]: the target's residual streams of a step's tokens; their context K/V go to
        the drafter's cache at the step's slots (-1: none)."""
        t0 = time.perf_counter()
        self._write_context(taps, positions, slots)
        self.seconds += time.perf_counter() - t0

    def _write_context(self, taps, positions, slots) -> None:
        c, w = self.cfg, self.w
        T = len(positions)
        x = taps.reshape(T, -1) @ w["fc.weight"].T
        x = ops.rmsnorm(x, w["hidden_norm.weight"], c.rms_norm_eps)
        cos, sin = ops.rope_cos_sin(np.asarray(positions), c.head_dim, c.rope_theta)
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}.self_attn."
            k = (x @ w[p + "k_proj.weight"].T).reshape(T, c.num_key_value_heads, c.head_dim)
            k = ops.rope_neox(ops.rmsnorm(k, w[p + "k_norm.weight"], c.rms_norm_eps), cos, sin)
            v = (x @ w[p + "v_proj.weight"].T).reshape(T, c.num_key_value_heads, c.head_dim)
            ops.kv_write(self.kv, i, k, v, np.asarray(slots))

    def propose(self, anchor: int, p: int, block_table: np.ndarray, temperature: float, top_p: float, top_k: int,
                seed: int) -> list[int]:
        """The round's drafts after the anchor at position p, the context being positions < p."""
        t0 = time.perf_counter()
        try:
            return self._propose(anchor, p, block_table, temperature, top_p, top_k, seed)
        finally:
            self.seconds += time.perf_counter() - t0

    def _propose(self, anchor, p, block_table, temperature, top_p, top_k, seed) -> list[int]:
        c, w = self.cfg, self.w
        logits = self.block_logits(anchor, p, block_table)
        # draft j predicts the token after position row = p + j (the target's row there draws the same noise)
        rows = p + np.arange(len(logits))
        one = (np.full(1, temperature, F32), np.full(1, top_p, F32), np.full(1, top_k, np.int32), np.full(1, seed, np.uint64))
        out, prev = [], anchor
        for j in range(len(logits)):
            lj = logits[j:j + 1] + self.markov(prev)
            prev = int(ops.sample(lj, *one, np.array([rows[j]]))[0])
            out.append(prev)
        return out

    def markov(self, prev: int) -> np.ndarray:
        """The Markov head's term for the slot after token `prev` (W2 . W1[prev]); zeros without one."""
        if not self.cfg.markov_rank:
            return np.zeros(self.cfg.vocab_size, F32)
        return self.w["markov_head.markov_w2.weight"] @ self.w["markov_head.markov_w1.weight"][prev]

    def block_logits(self, anchor: int, p: int, block_table) -> np.ndarray:
        """[num_drafts, V]: the lm_head's logits at the block's draft slots (before the Markov head's
        term), the context being positions < p."""
        c, w = self.cfg, self.w
        B, bs = c.block_size, self.block_size
        x = self.embed[[anchor] + [c.mask_token_id] * (B - 1)]
        pos = np.arange(p, p + B)
        cos, sin = ops.rope_cos_sin(pos, c.head_dim, c.rope_theta)
        nb = -(-p // bs)
        blocks = np.asarray(block_table)[:nb]
        g = c.num_attention_heads // c.num_key_value_heads
        scale = F32(1.0 / np.sqrt(c.head_dim))
        for i in range(c.num_hidden_layers):
            pre = f"layers.{i}."
            n = ops.rmsnorm(x, w[pre + "input_layernorm.weight"], c.rms_norm_eps)
            q = (n @ w[pre + "self_attn.q_proj.weight"].T).reshape(B, c.num_attention_heads, c.head_dim)
            k = (n @ w[pre + "self_attn.k_proj.weight"].T).reshape(B, c.num_key_value_heads, c.head_dim)
            v = (n @ w[pre + "self_attn.v_proj.weight"].T).reshape(B, c.num_key_value_heads, c.head_dim)
            q = ops.rope_neox(ops.rmsnorm(q, w[pre + "self_attn.q_norm.weight"], c.rms_norm_eps), cos, sin)
            k = ops.rope_neox(ops.rmsnorm(k, w[pre + "self_attn.k_norm.weight"], c.rms_norm_eps), cos, sin)
            ctx = self.kv[blocks, i].transpose(1, 2, 0, 3, 4).reshape(2, c.num_key_value_heads, -1, c.head_dim)[:, :, :p]
            keys = np.concatenate([ctx[0], k.transpose(1, 0, 2)], axis=1)  # [kv_heads, p + B, D]
            vals = np.concatenate([ctx[1], v.transpose(1, 0, 2)], axis=1)
            qh = q.reshape(B, c.num_key_value_heads, g, c.head_dim).transpose(1, 2, 0, 3)  # [kv, g, B, D]
            s = (qh @ keys[:, None].swapaxes(-1, -2)) * scale  # no mask: the block sees all of itself
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            o = (s @ vals[:, None]).transpose(2, 0, 1, 3).reshape(B, -1)
            x = x + o @ w[pre + "self_attn.o_proj.weight"].T
            m = ops.rmsnorm(x, w[pre + "post_attention_layernorm.weight"], c.rms_norm_eps)
            x = x + ops.silu_mul(m @ w[pre + "mlp.gate_proj.weight"].T, m @ w[pre + "mlp.up_proj.weight"].T) \
                @ w[pre + "mlp.down_proj.weight"].T
        h = ops.rmsnorm(x, w["norm.weight"], c.rms_norm_eps)[c.first_slot:]
        return ops.linear(h, self.lm_head)

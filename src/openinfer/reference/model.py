"""NumPy fp32 Qwen3: `ReferenceBackend.step()` (paged, the same contract as the CUDA backend) and
`dense_forward` (plain whole-sequence forward, written separately, to check the paged path)."""
from __future__ import annotations

from collections import deque

import numpy as np

from ..backend import StepOutput
from ..config import ModelConfig
from . import ops

F32 = np.float32


class ReferenceBackend:
    def __init__(self, model_config: ModelConfig, weights: dict[str, np.ndarray], num_blocks: int,
                 block_size: int = 16):
        c = self.cfg = model_config
        self.block_size = block_size
        self.num_kv_blocks = num_blocks
        self.w = {k: np.ascontiguousarray(v, dtype=F32) for k, v in weights.items()}
        self.embed = self.w["model.embed_tokens.weight"]
        self.lm_head = self.w.get("lm_head.weight", self.embed) if not c.tie_word_embeddings else self.embed
        # one block = every layer's K and V for block_size tokens (docs/architecture.md)
        self.kv_cache = np.zeros((num_blocks, c.num_hidden_layers, 2, c.num_key_value_heads, block_size,
                                  c.head_dim), dtype=F32)
        self._pending: deque[StepOutput] = deque()
        self._last: StepOutput | None = None

    def close(self) -> None:
        self.w, self.kv_cache = {}, None

    def launch(self, prev_rows=None, **args) -> None:
        """The overlapped-step contract of the CUDA backend, computed at once: prev_rows[b] >= 0 takes
        row b's input token from the previous launch's output."""
        if prev_rows is not None:
            prev_rows = np.asarray(prev_rows)
            fed = np.flatnonzero(prev_rows >= 0)
            qsl = np.asarray(args["query_start_loc"])
            # the CUDA engine's rules: a step launched before, fed rows are one token at their own index
            if self._last is None or (prev_rows >= len(self._last.tokens)).any() or (prev_rows < -1).any() or \
                    (qsl[fed] != fed).any() or (qsl[fed + 1] != fed + 1).any():
                raise ValueError("prev_rows: fed rows must be one token at their own index, from a step launched before")
            ids = np.array(args["input_ids"], dtype=np.int32)
            ids[fed] = self._last.tokens[prev_rows[fed]]
            args["input_ids"] = ids
        if len(self._pending) >= 2:
            raise RuntimeError("launch() with two steps already pending: collect() first")
        self._pending.append(self.step(**args))

    def collect(self) -> StepOutput:
        return self._pending.popleft()

    def step(self, input_ids, positions, query_start_loc, context_lens, block_tables, slot_mapping,
             sample_idx, temperature, top_p, top_k, seeds, num_logprobs: int = 0,
             return_logits: bool = False) -> StepOutput:
        T, B = len(input_ids), len(context_lens)
        if len(positions) != T or len(slot_mapping) != T or len(query_start_loc) != B + 1 \
                or block_tables.shape[0] != B or query_start_loc[-1] != T:
            raise ValueError("step(): inconsistent array lengths")
        hidden = self._forward(input_ids, positions, query_start_loc, context_lens, block_tables, slot_mapping,
                               sample_idx)
        logits = hidden @ self.lm_head.T  # [S, V], only rows that sample
        tokens = ops.sample(logits, temperature, top_p, top_k, seeds, positions[sample_idx])
        lp = ops.log_softmax(logits)
        out = StepOutput(tokens=tokens, logprobs=lp[np.arange(len(tokens)), tokens].astype(F32))
        if num_logprobs > 0:
            out.top_ids, out.top_logprobs = ops.top_logprobs(lp, num_logprobs)
        if return_logits:
            out.logits = logits
        self._last = out
        return out

    def _forward(self, input_ids, positions, qsl, context_lens, block_tables, slot_mapping, sample_idx):
        c, w = self.cfg, self.w
        T, eps = len(input_ids), c.rms_norm_eps
        h = self.embed[input_ids]
        residual = None
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            if residual is None:
                x, residual = ops.rmsnorm(h, w[p + "input_layernorm.weight"], eps), h
            else:
                x, residual = ops.add_rmsnorm(h, residual, w[p + "input_layernorm.weight"], eps)
            q = (x @ w[p + "self_attn.q_proj.weight"].T).reshape(T, c.num_attention_heads, c.head_dim)
            k = (x @ w[p + "self_attn.k_proj.weight"].T).reshape(T, c.num_key_value_heads, c.head_dim)
            v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(T, c.num_key_value_heads, c.head_dim)
            q, k = ops.qk_norm_rope(q, k, w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"],
                                    positions, c.rope_theta, eps)
            ops.kv_write(self.kv_cache, i, k, v, slot_mapping)  # before attention, per the contract
            a = ops.paged_attention(q, self.kv_cache, i, positions, qsl, context_lens, block_tables)
            h = a.reshape(T, -1) @ w[p + "self_attn.o_proj.weight"].T
            x, residual = ops.add_rmsnorm(h, residual, w[p + "post_attention_layernorm.weight"], eps)
            h = ops.silu_mul(x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T) \
                @ w[p + "mlp.down_proj.weight"].T
        return ops.rmsnorm((h + residual)[sample_idx], w["model.norm.weight"], eps)

    def dense_forward(self, token_ids) -> np.ndarray:
        return dense_forward(self.cfg, self.w, token_ids)


def dense_forward(cfg: ModelConfig, weights: dict[str, np.ndarray], token_ids) -> np.ndarray:
    """Logits [T, V] of one whole sequence: no cache, no pages, HF-style math written out again
    (rotate_half RoPE over full-width cos/sin, KV heads repeated, triangular mask)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    T, D, nH, nKV = len(ids), cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    W = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(cfg.rms_norm_eps)) * w

    inv = 1.0 / cfg.rope_theta ** (np.arange(0, D, 2) / D)
    freqs = np.outer(np.arange(T), inv)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb).astype(np.float32)[:, None], np.sin(emb).astype(np.float32)[:, None]

    def rope(x):  # [T, heads, D]
        rot = np.concatenate([-x[..., D // 2:], x[..., :D // 2]], axis=-1)
        return x * cos + rot * sin

    causal = np.triu(np.ones((T, T), dtype=bool), k=1)
    h = W["model.embed_tokens.weight"][ids]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        x = norm(h, W[p + "input_layernorm.weight"])
        q = norm((x @ W[p + "self_attn.q_proj.weight"].T).reshape(T, nH, D), W[p + "self_attn.q_norm.weight"])
        k = norm((x @ W[p + "self_attn.k_proj.weight"].T).reshape(T, nKV, D), W[p + "self_attn.k_norm.weight"])
        v = (x @ W[p + "self_attn.v_proj.weight"].T).reshape(T, nKV, D)
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, nH // nKV, axis=1), np.repeat(v, nH // nKV, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.float32(np.sqrt(D))
        s[:, causal] = -np.inf
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        h = h + np.einsum("hqk,khd->qhd", s, v).reshape(T, nH * D) @ W[p + "self_attn.o_proj.weight"].T
        x = norm(h, W[p + "post_attention_layernorm.weight"])
        g = x @ W[p + "mlp.gate_proj.weight"].T
        h = h + ((g / (1 + np.exp(-g))) * (x @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"]) if not cfg.tie_word_embeddings \
        else W["model.embed_tokens.weight"]
    return norm(h, W["model.norm.weight"]) @ head.T

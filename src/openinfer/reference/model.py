"""NumPy fp32 Qwen3: `ReferenceBackend` (paged, the step contract of openinfer.step, as the CUDA backend)
and `dense_forward` (plain whole-sequence forward, written separately, to check the paged path)."""
from __future__ import annotations

import time
from collections import deque

import numpy as np

from ..config import ModelConfig
from ..step import StepInput, StepOutput
from . import ops

F32 = np.float32


class ReferenceBackend:
    """The step contract (openinfer.step) in NumPy fp32, copies of the host tier included.

    copy_latency: a batch of KV copies lands (its data moves) only when that many later steps have been
    launched, instead of at once; tests raise it so that a block reused while its copy is in flight
    shows up as wrong data, as it would on the GPU."""

    def __init__(self, model_config: ModelConfig, weights: dict[str, np.ndarray], num_blocks: int,
                 block_size: int = 16, num_host_blocks: int = 0, copy_latency: int = 0, drafter=None):
        """drafter: (DrafterConfig, its fp32 weights) for speculative decoding, or None."""
        c = self.cfg = model_config
        self.block_size = block_size
        self.num_kv_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.copy_latency = copy_latency
        self.w = {k: np.ascontiguousarray(v, dtype=F32) for k, v in weights.items()}
        self.embed = self.w["model.embed_tokens.weight"]
        self.lm_head = self.w.get("lm_head.weight", self.embed) if not c.tie_word_embeddings else self.embed
        # one block = every layer's K and V for block_size tokens (docs/architecture.md)
        shape = (c.num_hidden_layers, 2, c.num_key_value_heads, block_size, c.head_dim)
        # Written through once here: np.zeros' pages count in RSS only when first written, and a pool that
        # fills up over a server's first minutes reads as a leak (the GPU pool, too, is all allocated at start).
        self.kv_cache = np.full((num_blocks, *shape), 0.0, dtype=F32)
        self.host_kv = np.zeros((num_host_blocks, *shape), dtype=F32)
        self._pending: deque[StepOutput] = deque()
        self._last: StepOutput | None = None
        self._launches = 0
        self._copies: deque[tuple[int, np.ndarray, np.ndarray]] = deque()  # (launch, saves, loads) not landed
        self._stats = dict(saved_bytes=0, restored_bytes=0, restore_seconds=0.0)
        self.drafter = None
        if drafter is not None:
            from .drafter import ReferenceDrafter
            self.drafter = ReferenceDrafter(*drafter, self.embed, self.lm_head, num_blocks, block_size)

    def close(self) -> None:
        self.w, self.kv_cache, self.host_kv = {}, None, None

    # ---- the step contract ----
    def step(self, step: StepInput) -> StepOutput:
        if self._pending:
            raise RuntimeError("step() with launched steps not collected")
        self.launch(step)
        return self.collect()

    def launch(self, step: StepInput) -> None:
        if len(self._pending) >= 2:
            raise RuntimeError("launch() with two steps already pending: collect() first")
        ids = self._check(step)
        self._launches += 1
        for src, dst in np.asarray(step.kv_copy):  # on the step's stream, before its forward
            self.kv_cache[dst] = self.kv_cache[src]
            if self.drafter is not None:
                self.drafter.kv[dst] = self.drafter.kv[src]
        if len(step.kv_save) or len(step.kv_load):
            self._copies.append((self._launches, np.asarray(step.kv_save), np.asarray(step.kv_load)))
        # kv_load_wait: this step reads what its loads bring (the GPU orders it layer by layer)
        self._land(self._launches if step.kv_load_wait else self._launches - self.copy_latency)
        out = self._run(step, ids)
        self._last = out
        self._pending.append(out)

    def collect(self) -> StepOutput:
        if not self._pending:
            raise RuntimeError("collect() with no step launched")
        return self._pending.popleft()

    def copy_progress(self) -> tuple[int, int]:
        done = self._copies[0][0] - 1 if self._copies else self._launches
        return done, done

    def wait_copies(self) -> None:
        self._land(self._launches)

    def copy_stats(self) -> dict:
        return dict(self._stats)

    def _land(self, upto: int) -> None:
        block_bytes = self.kv_cache[0].nbytes if len(self.kv_cache) else 0
        while self._copies and self._copies[0][0] <= upto:
            _, saves, loads = self._copies.popleft()
            if len(saves):
                self.host_kv[saves[:, 1]] = self.kv_cache[saves[:, 0]]
                self._stats["saved_bytes"] += len(saves) * block_bytes
            if len(loads):
                t0 = time.perf_counter()
                self.kv_cache[loads[:, 1]] = self.host_kv[loads[:, 0]]
                self._stats["restore_seconds"] += time.perf_counter() - t0
                self._stats["restored_bytes"] += len(loads) * block_bytes
    # ---- validation: what _engine checks (plan.cu), so that a bad step fails alike on both backends ----
    def _check(self, s: StepInput) -> np.ndarray:
        T, B, S = len(s.input_ids), len(s.context_lens), len(s.sample_idx)
        qsl, bt = np.asarray(s.query_start_loc), np.asarray(s.block_tables)
        if len(s.positions) != T or len(s.slot_mapping) != T or len(qsl) != B + 1 or bt.ndim != 2 \
                or bt.shape[0] != B or qsl[0] != 0 or qsl[-1] != T or (np.diff(qsl) < 1).any() or (T == 0) != (B == 0) \
                or any(len(a) != S for a in (s.temperature, s.top_p, s.top_k, s.seeds)):
            raise ValueError("step: inconsistent array lengths")
        if S and ((s.sample_idx < 0).any() or (s.sample_idx >= T).any()):
            raise ValueError("step: sample_idx out of range")
        ids = np.array(s.input_ids, dtype=np.int32)
        if s.prev_rows is not None:
            prev = np.asarray(s.prev_rows)
            fed = np.flatnonzero(prev >= 0)
            # the CUDA engine's rules: a step launched before, fed rows are one token at their own index
            if len(prev) != B or self._last is None or (prev >= len(self._last.tokens)).any() or (prev < -1).any() \
                    or (qsl[fed] != fed).any() or (qsl[fed + 1] != fed + 1).any():
                raise ValueError("prev_rows: fed rows must be one token at their own index, from a step launched before")
            ids[fed] = self._last.tokens[prev[fed]]
        L = self.cfg.num_hidden_layers
        taps = np.asarray(s.tap_layers)
        if len(taps) and ((taps < 0).any() or (taps >= L).any() or len(set(taps.tolist())) != len(taps)):
            raise ValueError("step: tap layer out of range or repeated")
        rows = np.asarray(s.tap_rows)
        if len(rows) and (not len(taps) or (rows < 0).any() or (rows >= T).any()):
            raise ValueError("step: tap rows out of range (or no tap layers)")
        for name, pairs, dev_col in (("kv_save", s.kv_save, 0), ("kv_load", s.kv_load, 1)):
            pairs = np.asarray(pairs)
            if not len(pairs):
                continue
            if not self.num_host_blocks:
                raise ValueError(f"step: {name} without a host KV tier")
            dev, host = pairs[:, dev_col], pairs[:, 1 - dev_col]
            if (dev < 1).any() or (dev >= self.num_kv_blocks).any() or (host < 0).any() \
                    or (host >= self.num_host_blocks).any():
                raise ValueError(f"step: {name} block out of range")
        copies = np.asarray(s.kv_copy)
        if len(copies) and ((copies < 1).any() or (copies >= self.num_kv_blocks).any()):
            raise ValueError("step: kv_copy block out of range")
        if s.draft is not None and (len(s.draft) != B or (np.asarray(s.draft) != 0).any() and self.drafter is None):
            raise ValueError("step: draft needs a drafter and one entry per sequence")
        if s.draft is not None:  # the CUDA drafter writes its block's K/V at positions up to p + block_size - 1
            for b in np.flatnonzero(np.asarray(s.draft)):
                end = int(s.context_lens[b]) + self.drafter.cfg.block_size  # positions [0, end) need blocks
                blocks = bt[b, :-(-end // self.block_size)]
                if end > bt.shape[1] * self.block_size or (blocks < 1).any() or (blocks >= self.num_kv_blocks).any():
                    raise ValueError(f"step: draft: sequence {b}'s block table does not cover its draft block")
        if s.verify:
            seq = np.searchsorted(qsl, s.sample_idx, side="right") - 1
            if (np.diff(s.sample_idx) < 1).any() or ((np.diff(seq) == 0) & (np.diff(s.sample_idx) != 1)).any():
                raise ValueError("verify: a sequence's sampled rows must be consecutive tokens, in order")
        return ids

    def _run(self, s: StepInput, ids: np.ndarray) -> StepOutput:
        if not len(ids):  # a step of copies only
            return StepOutput(tokens=np.zeros(0, np.int32), logprobs=np.zeros(0, F32))
        # the drafter's context needs its tap layers at every token; the step's own taps are a subset then
        asked, rows = [int(x) for x in s.tap_layers], np.asarray(s.tap_rows)
        taps = sorted(set(asked) | set(self.drafter.tap_layers)) if self.drafter else asked
        if self.drafter:
            rows = np.arange(len(ids))
        hidden, tapped = self._forward(ids, s.positions, s.query_start_loc, s.context_lens, s.block_tables,
                                       s.slot_mapping, s.sample_idx, np.array(taps, np.int32), rows)
        logits = ops.linear(hidden, self.lm_head)  # [S, V], only rows that sample; rows alike alone or batched
        tokens = ops.sample(logits, s.temperature, s.top_p, s.top_k, s.seeds, s.positions[s.sample_idx])
        lp = ops.log_softmax(logits)
        out = StepOutput(tokens=tokens, logprobs=lp[np.arange(len(tokens)), tokens].astype(F32))
        if s.num_logprobs > 0:
            out.top_ids, out.top_logprobs = ops.top_logprobs(lp, s.num_logprobs)
        if s.return_logits:
            out.logits = logits
        if s.verify:
            out.accepted = accepted_counts(ids, s.query_start_loc, s.sample_idx, tokens)
        if len(s.tap_rows):
            out.hidden = tapped[np.asarray(s.tap_rows)] if self.drafter else tapped
            out.hidden = out.hidden[:, [taps.index(l) for l in asked]]
        if self.drafter:
            t0 = self.drafter.seconds
            self.drafter.write_context(tapped[:, [taps.index(l) for l in self.drafter.tap_layers]], s.positions,
                                       s.slot_mapping)
            if s.draft is not None:
                out.drafts = self._draft(s, out)
            out.draft_ms = (self.drafter.seconds - t0) * 1e3
        return out

    def _draft(self, s: StepInput, out: StepOutput) -> np.ndarray:
        """Each drafting sequence's proposals after its last kept row's token."""
        qsl = np.asarray(s.query_start_loc)
        seq_of_row = np.searchsorted(qsl, s.sample_idx, side="right") - 1
        drafts = np.full((len(s.draft), self.drafter.cfg.num_drafts), -1, np.int32)
        for b in np.flatnonzero(np.asarray(s.draft)):
            rows = np.flatnonzero(seq_of_row == b)
            if not len(rows):
                raise ValueError(f"step: sequence {b} drafts but samples no row")
            r = rows[0] + (int(out.accepted[b]) - 1 if out.accepted is not None else len(rows) - 1)
            drafts[b] = self.drafter.propose(int(out.tokens[r]), int(s.positions[s.sample_idx[r]]) + 1,
                                             s.block_tables[b], float(s.temperature[r]), float(s.top_p[r]),
                                             int(s.top_k[r]), int(s.seeds[r]))
        return drafts

    def _forward(self, input_ids, positions, qsl, context_lens, block_tables, slot_mapping, sample_idx,
                 tap_layers=(), tap_rows=()):
        c, w = self.cfg, self.w
        T, eps = len(input_ids), c.rms_norm_eps
        h = self.embed[input_ids]
        residual = None
        slot_of = {int(l): k for k, l in enumerate(tap_layers)}
        tapped = np.zeros((len(tap_rows), len(tap_layers), c.hidden_size), F32)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            if residual is None:
                x, residual = ops.rmsnorm(h, w[p + "input_layernorm.weight"], eps), h
            else:
                x, residual = ops.add_rmsnorm(h, residual, w[p + "input_layernorm.weight"], eps)
            q = ops.linear(x, w[p + "self_attn.q_proj.weight"]).reshape(T, c.num_attention_heads, c.head_dim)
            k = ops.linear(x, w[p + "self_attn.k_proj.weight"]).reshape(T, c.num_key_value_heads, c.head_dim)
            v = ops.linear(x, w[p + "self_attn.v_proj.weight"]).reshape(T, c.num_key_value_heads, c.head_dim)
            q, k = ops.qk_norm_rope(q, k, w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"],
                                    positions, c.rope_theta, eps)
            ops.kv_write(self.kv_cache, i, k, v, slot_mapping)  # before attention, per the contract
            a = ops.paged_attention(q, self.kv_cache, i, positions, qsl, context_lens, block_tables)
            h = ops.linear(a.reshape(T, -1), w[p + "self_attn.o_proj.weight"])
            x, residual = ops.add_rmsnorm(h, residual, w[p + "post_attention_layernorm.weight"], eps)
            h = ops.linear(ops.silu_mul(ops.linear(x, w[p + "mlp.gate_proj.weight"]),
                                        ops.linear(x, w[p + "mlp.up_proj.weight"])), w[p + "mlp.down_proj.weight"])
            if i in slot_of and len(tap_rows):  # the residual stream after layer i (HF hidden_states[i + 1])
                tapped[:, slot_of[i]] = (h + residual)[tap_rows]
        return ops.rmsnorm((h + residual)[sample_idx], w["model.norm.weight"], eps), tapped

    def dense_forward(self, token_ids) -> np.ndarray:
        return dense_forward(self.cfg, self.w, token_ids)


def accepted_counts(ids, query_start_loc, sample_idx, tokens) -> np.ndarray:
    """Verify steps: per sequence, 1 + the drafts (the token after each sampled row's) that its sampled
    tokens match in order before the first mismatch; 0 for a sequence without sampled rows."""
    qsl = np.asarray(query_start_loc)
    seq = np.searchsorted(qsl, sample_idx, side="right") - 1
    out = np.zeros(len(qsl) - 1, np.int32)
    for b in range(len(out)):
        rows = np.flatnonzero(seq == b)
        n = 1 if len(rows) else 0
        while n < len(rows) and tokens[rows[n - 1]] == ids[sample_idx[rows[n - 1]] + 1]:
            n += 1
        out[b] = n
    return out


def dense_forward(cfg: ModelConfig, weights: dict[str, np.ndarray], token_ids, hidden_states: bool = False):
    """Logits [T, V] of one whole sequence: no cache, no pages, HF-style math written out again
    (rotate_half RoPE over full-width cos/sin, KV heads repeated, triangular mask). With hidden_states,
    (logits, [the residual stream after each layer]) (HF's hidden_states[1:], but the last one unnormed)."""
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
    states = []
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
        states.append(h)
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"]) if not cfg.tie_word_embeddings \
        else W["model.embed_tokens.weight"]
    logits = norm(h, W["model.norm.weight"]) @ head.T
    return (logits, states) if hidden_states else logits

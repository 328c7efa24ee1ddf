"""The CUDA backend: weights into `_engine.Engine`, and the step interface of docs/architecture.md."""
from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import numpy as np

from .backend import StepOutput
from .config import EngineConfig, ModelConfig

log = logging.getLogger("openinfer")

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _slot(name: str, m: ModelConfig) -> tuple[str, int, int] | None:
    """Checkpoint tensor name -> (engine slot, layer, row offset); q/k/v and gate/up are fused here."""
    top = {"model.embed_tokens.weight": "embed", "lm_head.weight": "lm_head", "model.norm.weight": "final_norm"}
    if name in top:
        return top[name], -1, 0
    hit = _LAYER.fullmatch(name)
    if not hit:
        return None
    layer, rest = int(hit.group(1)), hit.group(2)
    per_layer = {
        "input_layernorm.weight": ("input_norm", 0),
        "post_attention_layernorm.weight": ("post_norm", 0),
        "self_attn.q_norm.weight": ("q_norm", 0),
        "self_attn.k_norm.weight": ("k_norm", 0),
        "self_attn.q_proj.weight": ("qkv", 0),
        "self_attn.k_proj.weight": ("qkv", m.q_size),
        "self_attn.v_proj.weight": ("qkv", m.q_size + m.kv_size),
        "self_attn.o_proj.weight": ("o", 0),
        "mlp.gate_proj.weight": ("gate_up", 0),
        "mlp.up_proj.weight": ("gate_up", m.intermediate_size),
        "mlp.down_proj.weight": ("down", 0),
    }
    if rest not in per_layer:
        return None
    kind, off = per_layer[rest]
    return kind, layer, off


def _cublaslt_hint() -> str:
    """A libcublasLt.so.13 from PyPI's nvidia-cublas when installed; else the system loader decides."""
    try:
        import nvidia  # namespace package of the nvidia-* wheels
        for p in nvidia.__path__:
            for sub in ("cu13/lib", "cublas/lib"):
                f = Path(p) / sub / "libcublasLt.so.13"
                if f.is_file():
                    return str(f)
    except ImportError:
        pass
    return ""


class _Closed:
    def __getattr__(self, name):
        raise RuntimeError("this openinfer engine is closed")


class CudaBackend:
    def __init__(self, m: ModelConfig, c: EngineConfig):
        from . import _engine  # compiled module; imported here so that `import openinfer` needs no GPU

        self.model_config = m
        t0 = time.perf_counter()
        model = dict(hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                     num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
                     num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim, vocab_size=m.vocab_size,
                     rms_norm_eps=m.rms_norm_eps, rope_theta=m.rope_theta,
                     tie_word_embeddings=m.tie_word_embeddings)
        opts = dict(max_num_batched_tokens=c.max_num_batched_tokens, max_num_seqs=c.max_num_seqs,
                    max_model_len=c.max_model_len, kv_block_size=c.kv_block_size,
                    gpu_memory_utilization=c.gpu_memory_utilization, num_kv_blocks=c.num_kv_blocks or 0,
                    cublaslt_path=_cublaslt_hint(), cuda_graph=c.cuda_graph, pdl=c.pdl,
                    gemm_autotune=c.gemm_autotune)
        self.eng = _engine.Engine(model, opts)
        if c.load_format == "random":
            self.eng.init_random(c.seed)
        else:
            from .loader import Checkpoint
            for name, arr in Checkpoint(c.model_path, m).iter_tensors():
                slot = _slot(name, m)
                if slot is not None:
                    kind, layer, off = slot
                    self.eng.load_tensor(kind, layer, arr, off)
        t_load = time.perf_counter() - t0
        self.num_kv_blocks = int(self.eng.finalize())
        gib = 1 << 30
        log.info("CUDA engine on %s: weights %.2f GiB (%s, %.1f s), activations %.2f GiB, KV pool %d blocks x %.2f MiB "
                 "= %.2f GiB (gpu_memory_utilization %.2f)", self.eng.device_name, self.eng.weight_bytes / gib,
                 c.load_format, t_load, self.eng.activation_bytes / gib, self.num_kv_blocks,
                 self.eng.kv_block_bytes / (1 << 20), self.num_kv_blocks * self.eng.kv_block_bytes / gib,
                 c.gpu_memory_utilization)
        if c.cuda_graph:
            log.info("CUDA graphs captured for decode batch sizes %s", self.eng.graph_batches)
        self.last_gpu_ms = 0.0

    def close(self) -> None:
        """Frees the GPU memory now (weights, KV cache, graphs) instead of whenever the last reference
        goes; pending steps finish first. Idempotent."""
        eng, self.eng = self.eng, _Closed()
        del eng  # the C++ destructor syncs the stream and frees everything it allocated

    def launch(self, input_ids, positions, query_start_loc, context_lens, block_tables, slot_mapping, sample_idx,
               temperature, top_p, top_k, seeds, num_logprobs: int = 0, return_logits: bool = False,
               force_eager: bool = False, prev_rows=None) -> None:
        """Queues a step (at most two pending); prev_rows[b] >= 0 feeds row b the previous step's token."""
        self.eng.launch(input_ids, positions, query_start_loc, context_lens, np.atleast_2d(block_tables), slot_mapping,
                        sample_idx, temperature, top_p, top_k, np.asarray(seeds, dtype=np.uint64), num_logprobs,
                        return_logits, force_eager, prev_rows)

    def collect(self) -> StepOutput:
        return self._output(*self.eng.collect())

    def _output(self, tokens, lps, top_ids, top_lps, logits, gpu_ms) -> StepOutput:
        self.last_gpu_ms = gpu_ms
        n = top_ids.shape[1] if top_ids.ndim == 2 else 0
        return StepOutput(tokens=tokens, logprobs=lps, top_ids=top_ids if n else None,
                          top_logprobs=top_lps if n else None, logits=logits)

    def step(self, input_ids, positions, query_start_loc, context_lens, block_tables, slot_mapping, sample_idx,
             temperature, top_p, top_k, seeds, num_logprobs: int = 0, return_logits: bool = False,
             force_eager: bool = False) -> StepOutput:
        """force_eager: run a decode step's bucket without its CUDA graph (tests compare the two)."""
        return self._output(*self.eng.step(
            input_ids, positions, query_start_loc, context_lens, np.atleast_2d(block_tables), slot_mapping,
            sample_idx, temperature, top_p, top_k, np.asarray(seeds, dtype=np.uint64), num_logprobs, return_logits,
            force_eager))

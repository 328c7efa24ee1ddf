"""The CUDA backend: weights into `_engine.Engine`, and the step contract of openinfer.step."""
from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import numpy as np

from .config import EngineConfig, EngineUnavailable, ModelConfig
from .safetensors_io import bf16_to_f32
from .step import StepInput, StepOutput
from .version import engine_module

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


def cuda_engine():
    """The compiled engine, where it can run: EngineUnavailable when it is not built or no GPU is found.
    Imported on demand, so that `import openinfer` needs neither."""
    eng = engine_module()
    if eng.device_count() == 0:  # no GPU, or no driver to see one
        raise EngineUnavailable("no CUDA GPU was found; {device=cpu} runs small models on the NumPy reference backend")
    return eng


def _drafter_slot(name: str, m: ModelConfig) -> tuple[str, int, int] | None:
    """A drafter tensor's engine slot (the target's layer names without `model.`, under draft.<kind>);
    None for what the engine takes from the target (a DSpark checkpoint's copies of the embedding and
    lm_head) or does not use (the confidence head)."""
    top = {"fc.weight": "fc", "hidden_norm.weight": "hidden_norm", "norm.weight": "norm",
           "markov_head.markov_w1.weight": "markov_w1", "markov_head.markov_w2.weight": "markov_w2"}
    if name in top:
        return "draft." + top[name], -1, 0
    slot = _slot("model." + name, m) if name.startswith("layers.") else None
    return ("draft." + slot[0], slot[1], slot[2]) if slot else None


class CudaBackend:
    """The step contract (openinfer.step) on `_engine.Engine`."""

    def __init__(self, m: ModelConfig, c: EngineConfig, spec_tokens: int = 0):
        """spec_tokens: drafts verified per round (a verify step samples spec_tokens + 1 rows per sequence)."""
        _engine = cuda_engine()
        self.model_config = m
        t0 = time.perf_counter()
        self.eng = _engine.Engine(m, c, _cublaslt_hint(), c.max_num_seqs * (1 + spec_tokens))
        try:
            self._build(m, c, t0)
        except BaseException:  # free the GPU now: a traceback kept by the caller (pytest) would hold it
            self.close()
            raise

    def _build(self, m: ModelConfig, c: EngineConfig, t0: float) -> None:
        if c.drafter_config is not None:
            self._load_drafter(c)
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
        self.num_host_blocks = int(self.eng.num_host_blocks)
        gib = 1 << 30
        log.info("CUDA engine on %s: weights %.2f GiB (%s, %.1f s), activations %.2f GiB, KV pool %d blocks x %.2f MiB "
                 "= %.2f GiB (gpu_memory_utilization %.2f)", self.eng.device_name, self.eng.weight_bytes / gib,
                 c.load_format, t_load, self.eng.activation_bytes / gib, self.num_kv_blocks,
                 self.eng.kv_block_bytes / (1 << 20), self.num_kv_blocks * self.eng.kv_block_bytes / gib,
                 c.gpu_memory_utilization)
        # where the time after the weights went (start-up to ready, issue #25's 3 s): the device drained at each mark
        log.info("finalize: %s", ", ".join(f"{k} {v:.2f} s" for k, v in self.eng.finalize_seconds))
        if self.num_host_blocks:
            log.info("host KV tier: %d blocks = %.2f GiB of pinned memory", self.num_host_blocks,
                     self.num_host_blocks * self.eng.kv_block_bytes / gib)
        if c.cuda_graph and self.eng.has_drafter:
            log.info("CUDA graphs captured for verify rounds of %d tokens a sequence, batch sizes %s (%.1f MiB of device "
                     "memory)", c.drafter_config.num_drafts + 1, self.eng.verify_graph_batches,
                     self.eng.graph_bytes / (1 << 20))
        elif c.cuda_graph:
            log.info("CUDA graphs captured for decode batch sizes %s (%.1f MiB of device memory)", self.eng.graph_batches,
                     self.eng.graph_bytes / (1 << 20))
        self.last_gpu_ms = 0.0

    def _load_drafter(self, c: EngineConfig) -> None:
        from .drafter import iter_drafter_tensors

        self.eng.set_drafter(c.drafter_config)
        for name, arr in iter_drafter_tensors(c.draft_model_path, c.drafter_config):
            slot = _drafter_slot(name, self.model_config)
            if slot is not None:
                kind, layer, off = slot
                self.eng.load_tensor(kind, layer, arr, off)
        log.info("drafter %s: %d layers, block %d, taps %s%s", c.draft_model_path, c.drafter_config.num_hidden_layers,
                 c.drafter_config.block_size, list(c.drafter_config.target_layer_ids),
                 f", Markov rank {c.drafter_config.markov_rank}" if c.drafter_config.markov_rank else "")

    def close(self) -> None:
        """Frees the GPU memory now (weights, KV cache, graphs) instead of whenever the last reference
        goes; pending steps finish first. Idempotent."""
        eng, self.eng = self.eng, _Closed()
        del eng  # the C++ destructor syncs the streams and frees everything it allocated

    def launch(self, step: StepInput) -> None:
        self.eng.launch(step)

    def collect(self) -> StepOutput:
        return self._output(self.eng.collect())

    def step(self, step: StepInput) -> StepOutput:
        return self._output(self.eng.step(step))

    def _output(self, d: dict) -> StepOutput:
        out = StepOutput(**d)
        self.last_gpu_ms = out.gpu_ms
        if out.hidden is not None:  # bf16 bits [R, L * H] -> float32 [R, L, H]
            out.hidden = bf16_to_f32(out.hidden).reshape(len(out.hidden), -1, self.model_config.hidden_size)
        return out

    def copy_progress(self) -> tuple[int, int]:
        return self.eng.copy_progress()

    def wait_copies(self) -> None:
        self.eng.wait_copies()

    def copy_stats(self) -> dict:
        return self.eng.copy_stats

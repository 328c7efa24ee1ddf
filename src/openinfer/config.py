"""Typed configuration: `ModelConfig` (a model directory's config.json) and `EngineConfig`.

Environment variables are read here and nowhere else (see `ENV_VARS`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .model_files import ModelFiles

# Every environment variable the package reads, with its meaning. Nothing else calls os.environ.
ENV_VARS = {
    "OPENINFER_PROGRESS": "1/0 forces the weight-loading progress bar on/off (default: on when stderr is a tty)",
}

DOWNLOAD_HINT = "huggingface-cli download Qwen/Qwen3-4B --local-dir models/Qwen3-4B"
SUPPORTED_ARCHITECTURE = "Qwen3ForCausalLM"
MAX_MODEL_LEN_CAP = 40960
CPU_KV_BUDGET_BYTES = 512 << 20  # fp32 KV pool of the CPU backend when num_kv_blocks is not given


def env_flag(name: str) -> bool | None:
    """A declared boolean env var: True/False when set, None when unset."""
    assert name in ENV_VARS, name
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    return v.strip().lower() not in ("0", "false", "no", "off")


def check_model_dir(path: str | os.PathLike) -> Path:
    """The model directory, or a FileNotFoundError that says how to get one."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(
            f"model directory '{p}' does not exist; download a checkpoint, e.g. `{DOWNLOAD_HINT}`, "
            f"or write a random one with `python -m openinfer.tools.random_checkpoint --preset qwen3-4b --out {p}`")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"'{p}' has no config.json, so it is not a Hugging Face model directory; "
            f"download one with `{DOWNLOAD_HINT}`")
    return p


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, d: dict, generation_config: dict | None = None) -> "ModelConfig":
        archs = d.get("architectures") or []
        mtype = d.get("model_type")
        if SUPPORTED_ARCHITECTURE not in archs or mtype != "qwen3":
            raise ValueError(
                f"unsupported model: architectures={archs} model_type={mtype!r}; "
                f"openinfer serves only {SUPPORTED_ARCHITECTURE} (model_type 'qwen3')")
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            cfg = cls(
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads", heads)),
                head_dim=int(d.get("head_dim") or hidden // heads),
                vocab_size=int(d["vocab_size"]),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(d.get("rope_theta", 1e6)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                max_position_embeddings=int(d.get("max_position_embeddings", MAX_MODEL_LEN_CAP)),
                eos_token_ids=_eos_ids(generation_config, d),
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks the field {e.args[0]!r}") from None
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({heads}) is not a multiple of "
                             f"num_key_value_heads ({cfg.num_key_value_heads})")
        if cfg.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {cfg.head_dim}")
        return cfg

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike) -> "ModelConfig":
        files = ModelFiles.read(check_model_dir(path))
        return cls.from_dict(files.config, files.generation_config)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def _eos_ids(gen: dict | None, cfg: dict) -> tuple[int, ...]:
    # generation_config.json is what the releases use to stop; config.json's single id is a fallback.
    for src in (gen or {}, cfg):
        v = src.get("eos_token_id")
        if v is not None:
            return tuple(int(x) for x in (v if isinstance(v, list) else [v]))
    return ()


DEVICES = ("cuda", "cpu")
LOAD_FORMATS = ("safetensors", "random")


@dataclass
class EngineConfig:
    model_path: str
    device: str = "cuda"
    load_format: str = "safetensors"
    seed: int = 0
    gpu_memory_utilization: float = 0.90
    max_model_len: int | None = None  # None: min(max_position_embeddings, 40960)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_block_size: int = 16
    enable_prefix_caching: bool = True
    cuda_graph: bool = True
    pdl: bool = True  # programmatic dependent launch: a kernel streams its weights while the previous one ends
    # Time cuBLASLt's candidate algorithms for the decode shapes at start-up and keep the fastest. Timing
    # can pick differently on each start, and so change the last bits of the outputs; False keeps the
    # heuristic's first pick, so every start computes the same bits.
    gemm_autotune: bool = True
    overlap_steps: bool = True  # launch step N+1 before step N's tokens reach the host
    num_kv_blocks: int | None = None  # override the pool size (cpu default: 512 MiB of fp32 KV)
    max_waiting: int = 1024
    model_config: ModelConfig = field(init=False, repr=False)

    def __post_init__(self):
        self.model_path = str(self.model_path)
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_block_size", "max_waiting"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.kv_block_size & (self.kv_block_size - 1):
            raise ValueError(f"kv_block_size must be a power of two, got {self.kv_block_size}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # every running sequence must fit one decode row in each step's token budget
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({self.max_num_seqs})")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2):
            raise ValueError(f"num_kv_blocks must be an int >= 2 (block 0 is reserved), got {self.num_kv_blocks!r}")
        self.model_config = ModelConfig.from_model_dir(self.model_path)
        limit = self.model_config.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = min(limit, MAX_MODEL_LEN_CAP)
        elif not isinstance(self.max_model_len, int) or not 2 <= self.max_model_len <= limit:
            raise ValueError(f"max_model_len must be an int in [2, {limit}] (max_position_embeddings), "
                             f"got {self.max_model_len!r}")

    def cpu_num_kv_blocks(self) -> int:
        """Pool size of the CPU backend: the override, or what fits the fp32 KV budget."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        m = self.model_config
        per_block = m.num_hidden_layers * 2 * m.num_key_value_heads * self.kv_block_size * m.head_dim * 4
        return max(2, CPU_KV_BUDGET_BYTES // per_block)

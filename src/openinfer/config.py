"""Typed configuration: `ModelConfig` (a model directory's config.json) and `EngineConfig`.

Environment variables are read here and nowhere else (see `ENV_VARS`).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from .model_files import ModelFiles

# Every environment variable the package reads, with its meaning. Nothing else calls os.environ.
ENV_VARS = {
    "OPENINFER_PROGRESS": "1/0 forces the weight-loading progress bar on/off (default: on when stderr is a tty)",
    "OPENINFER_API_KEY": "the API key openinfer-serve requires when --api-key is not given (keeps it out of `ps`)",
    "OPENINFER_TEST_FAULT": "tests only: engine steps raise as a failed CUDA step would (step_fault())",
}

DOWNLOAD_HINT = "hf download Qwen/Qwen3-4B --local-dir models/Qwen3-4B"
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


def env_str(name: str) -> str | None:
    """A declared string env var: its value, or None when unset or empty."""
    assert name in ENV_VARS, name
    return os.environ.get(name) or None


@dataclass(frozen=True)
class StepFault:
    """Tests only (OPENINFER_TEST_FAULT=FIRST[:COUNT[:oom]]): LLMEngine.step calls FIRST, FIRST+1, ...
    (1-based, COUNT of them, default 1; COUNT 0: every call from FIRST on, as a dead CUDA context does)
    raise a RuntimeError worded as a CUDA error, or with `oom` a MemoryError."""
    first: int
    count: int = 1
    oom: bool = False

    def check(self, call: int) -> None:
        if call >= self.first and (self.count == 0 or call < self.first + self.count):
            if self.oom:
                raise MemoryError(f"CUDA out of memory (OPENINFER_TEST_FAULT, step call {call})")
            raise RuntimeError(f"CUDA error: an illegal memory access was encountered (OPENINFER_TEST_FAULT, "
                               f"step call {call})")


def step_fault() -> StepFault | None:
    """The test-only step fault OPENINFER_TEST_FAULT asks for, or None (unset: always, outside tests)."""
    v = env_str("OPENINFER_TEST_FAULT")
    if v is None:
        return None
    parts = v.split(":")
    try:
        first, count = int(parts[0]), int(parts[1]) if len(parts) > 1 else 1
    except ValueError:
        raise ConfigError(f"OPENINFER_TEST_FAULT must be FIRST[:COUNT[:oom]], got {v!r}") from None
    if first < 1 or count < 0 or len(parts) > 3 or parts[2:] not in ([], ["oom"]):
        raise ConfigError(f"OPENINFER_TEST_FAULT must be FIRST[:COUNT[:oom]], got {v!r}")
    return StepFault(first, count, parts[2:] == ["oom"])


def _model_hint(p: Path, device: str | None) -> str:
    """How to get a model directory at `p`: on the CPU backend a tiny random one, else a download."""
    write = "python -m openinfer.tools.random_checkpoint --out " + str(p) + " --preset "
    if device == "cpu":
        return f"write a tiny random-weight one for the CPU backend with `{write}tiny`"
    return f"download one, e.g. `{DOWNLOAD_HINT}`, or write a random-weight one with `{write}qwen3-4b`"


def check_model_dir(path: str | os.PathLike, device: str | None = None) -> Path:
    """The model directory, or a FileNotFoundError that says how to get one (for `device`'s backend)."""
    p = Path(path)
    if p.is_file():
        holder = f"; its directory is '{p.parent}'" if (p.parent / "config.json").is_file() else ""
        raise FileNotFoundError(f"'{p}' is a file, not a model directory{holder}")
    if not p.is_dir():
        raise FileNotFoundError(f"model directory '{p}' does not exist; {_model_hint(p, device)}")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"'{p}' has no config.json, so it is not a Hugging Face model directory; {_model_hint(p, device)}")
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
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOAD_FORMATS = ("safetensors", "random")
GIB = 1 << 30


def python_setting(name: str, value: str) -> str:
    """How the Python API writes an option set to a value: device="cpu", max_model_len=2048."""
    literal = re.fullmatch(r"-?[\d.]+|True|False|None", value)
    return f"{name}={value}" if literal else f'{name}="{value}"'


class OptionMessage(Exception):
    """An error whose message names options as {field} or {field=value} placeholders, so that the Python
    API can say `max_num_seqs` and `device="cpu"` where openinfer-serve says `--max-num-seqs` and
    `--device cpu` (render())."""

    def __init__(self, template: str):
        self.template = template
        super().__init__(self.render(lambda name: name))

    def render(self, name_of, setting=python_setting) -> str:
        """The message with {field} as name_of(field) and {field=value} as setting(name_of(field), value)."""
        names = set(_option_names())

        def one(m):
            name, value = m.group(1), m.group(2)
            if name not in names:
                return m.group(0)
            return name_of(name) if value is None else setting(name_of(name), value)
        return re.sub(r"\{(\w+)(?:=([^}]*))?\}", one, self.template)


class ConfigError(OptionMessage, ValueError):
    """A bad option."""


class EngineUnavailable(OptionMessage, RuntimeError):
    """The CUDA engine cannot run here: it is not built, or there is no GPU."""


def option(default, help: str, **cli):
    """A configuration field: its one default, its help text, and how openinfer-serve spells it (cli:
    flag=..., aliases=(...), choices=(...), hidden=True for options that are not flags)."""
    return field(default=default, metadata=dict(help=help, **cli))


@dataclass
class EngineConfig:
    """Every engine option, validated once at construction (the only place their defaults live).
    openinfer-serve's flags are generated from these fields (openinfer.cli)."""
    model_path: str = option(None, "Hugging Face model directory (config.json, safetensors, tokenizer files)")
    device: str = option("cuda", "cuda: the CUDA engine; cpu: the NumPy reference backend (small models only)",
                         choices=DEVICES)
    load_format: str = option("safetensors", "safetensors: load the checkpoint; random: seeded random weights from "
                              "config.json alone (benchmarks, trying the server without a download)",
                              choices=LOAD_FORMATS)
    seed: int = option(0, "engine seed (random weights, requests that bring no seed)")
    gpu_memory_utilization: float = option(
        0.90, "fraction of GPU memory the engine may use (weights + activations + KV cache)")
    max_model_len: int | None = option(
        None, f"longest prompt + completion in tokens (default: the model's, capped at {MAX_MODEL_LEN_CAP})")
    max_num_seqs: int = option(256, "most requests decoded in one step")
    max_num_batched_tokens: int = option(8192, "token budget of one step (decode rows plus prefill chunks)")
    # A prefill chunk's step is every decoding request's next token: 8192 prompt tokens take ~130 ms on a
    # 4B (1024 took 16.4-16.8 ms, H200), 2048 ~33 ms. Alone, a prompt takes the whole budget.
    max_prefill_tokens_while_decoding: int = option(
        2048, "prompt tokens per step while requests are decoding (bounds their time per output token; with "
        "none decoding a step takes max_num_batched_tokens)")
    max_waiting: int = option(1024, "bound of the waiting queue; beyond it requests get 503 with Retry-After",
                              flag="--max-waiting-requests")
    kv_block_size: int = option(16, "tokens per KV block", hidden=True)
    num_kv_blocks: int | None = option(
        None, "KV blocks in the GPU pool (default: what gpu_memory_utilization leaves on cuda, 512 MiB of fp32 KV "
        "on cpu); caps KV memory")
    enable_prefix_caching: bool = option(
        True, "reuse KV blocks across requests sharing a prompt prefix", aliases=("--no-prefix-cache",))
    kv_offload: bool = option(False, "keep a copy of every sealed KV block in a pinned host-memory tier and "
                              "restore prefixes from it (with the prefix cache off: every hit comes from the host)")
    kv_offload_host_gib: float | None = option(None, "size of the host KV tier in GiB (needs --kv-offload)")
    draft_model_path: str | None = option(
        None, "DFlash or DSpark drafter directory: speculative decoding, lossless at any temperature",
        flag="--dflash-draft-model-path")
    cuda_graph: bool = option(True, "replay decode steps (with a drafter: verify rounds) from captured CUDA graphs")
    pdl: bool = option(True, "programmatic dependent launch: a kernel streams its weights while the previous one "
                       "ends (sm_90+)")
    # Timing picks can differ between starts and so change the outputs' last bits; false keeps the
    # heuristic's first pick, so every start computes the same bits.
    gemm_autotune: bool = option(True, "time cuBLASLt algorithms for the decode shapes at start-up (false: the same "
                                 "algorithms, and so the same output bits, on every start)")
    persistent_decode: bool = option(True, "batch-1 decode runs every layer in one persistent kernel where the "
                                     "model fits it (Qwen3 0.6B-8B)")
    deterministic: bool = option(False, "every row's result independent of the batch it is in: greedy and seeded "
                                 "sampling give the same bits whatever the batch, chunking or prefix hits (slower)")
    overlap_steps: bool = option(True, "launch each step before the previous one's tokens reach the host, so "
                                 "scheduling and streaming run while the GPU works")
    model_files: ModelFiles = field(init=False, repr=False)
    model_config: ModelConfig = field(init=False, repr=False)
    drafter_config: object = field(init=False, repr=False)  # openinfer.drafter.DrafterConfig, or None

    def __post_init__(self):
        if self.model_path is None:
            raise ConfigError("{model_path} is required")
        self.model_path = str(self.model_path)
        if self.device not in DEVICES:
            raise ConfigError("{device} must be one of " + ", ".join(DEVICES) + f", got {self.device!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError("{load_format} must be one of " + ", ".join(LOAD_FORMATS) + f", got {self.load_format!r}")
        if not _is_int(self.seed) or self.seed < 0:
            raise ConfigError("{seed} must be a non-negative integer, got " + repr(self.seed))
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("{gpu_memory_utilization} must be in (0, 1], got " + repr(self.gpu_memory_utilization))
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_tokens_while_decoding", "kv_block_size",
                     "max_waiting"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ConfigError("{%s} must be a positive integer, got %r" % (name, v))
        if self.kv_block_size & (self.kv_block_size - 1):
            raise ConfigError("{kv_block_size} must be a power of two, got " + str(self.kv_block_size))
        if self.max_num_batched_tokens < self.max_num_seqs:
            # every running sequence must fit one decode row in each step's token budget
            raise ConfigError("{max_num_batched_tokens} (%d) must be >= {max_num_seqs} (%d)"
                              % (self.max_num_batched_tokens, self.max_num_seqs))
        if self.num_kv_blocks is not None and (not _is_int(self.num_kv_blocks) or self.num_kv_blocks < 2):
            raise ConfigError("{num_kv_blocks} must be an integer >= 2 (block 0 is reserved), got "
                              + repr(self.num_kv_blocks))
        self.model_files = ModelFiles.read(check_model_dir(self.model_path, self.device))  # each HF file read once, here
        self.model_config = ModelConfig.from_dict(self.model_files.config, self.model_files.generation_config)
        self.drafter_config = None
        if self.draft_model_path is not None:
            from .drafter import DrafterConfig
            if self.kv_offload:
                raise ConfigError("{draft_model_path} and {kv_offload} together are not supported yet")
            self.draft_model_path = str(self.draft_model_path)
            self.drafter_config = DrafterConfig.from_dir(self.draft_model_path)
            self.drafter_config.check_target(self.model_config)
            if self.device == "cuda":
                self.drafter_config.check_cuda(self.model_config)
        limit = self.model_config.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = min(limit, MAX_MODEL_LEN_CAP)
        elif not _is_int(self.max_model_len) or not 2 <= self.max_model_len <= limit:
            raise ConfigError("{max_model_len} must be an integer in [2, %d] (max_position_embeddings), got %r"
                              % (limit, self.max_model_len))
        self._check_offload()

    def _check_offload(self) -> None:
        gib = self.kv_offload_host_gib
        if gib is not None and not self.kv_offload:
            raise ConfigError("{kv_offload_host_gib} needs {kv_offload}")
        if not self.kv_offload:
            return
        if gib is None:
            raise ConfigError("{kv_offload} needs {kv_offload_host_gib}: the size of the host tier in GiB")
        if not isinstance(gib, (int, float)) or not gib > 0:
            raise ConfigError("{kv_offload_host_gib} must be a positive number of GiB, got " + repr(gib))
        total = host_memory_bytes()
        if total and gib * GIB > total:
            raise ConfigError("{kv_offload_host_gib} %g is more than this machine's memory (%.1f GiB)"
                              % (gib, total / GIB))
        need = -(-self.max_model_len // self.kv_block_size)  # one request's blocks at most
        if self.num_host_blocks < need:
            raise ConfigError("{kv_offload_host_gib} %g holds fewer blocks than one request of {max_model_len} "
                              "%d tokens needs (%d blocks, %.2f GiB)"
                              % (gib, self.max_model_len, need, need * self.kv_block_bytes / GIB))

    # ---- derived sizes (what the backends are built with) ----
    @property
    def kv_block_bytes(self) -> int:
        """One KV block of every layer: bf16 on the GPU, fp32 on the CPU backend."""
        m = self.model_config
        return m.num_hidden_layers * 2 * m.num_key_value_heads * self.kv_block_size * m.head_dim * \
            (4 if self.device == "cpu" else 2)

    @property
    def host_kv_bytes(self) -> int:
        """The host tier's size in bytes (0: no tier)."""
        return int(self.kv_offload_host_gib * GIB) if self.kv_offload else 0

    @property
    def num_host_blocks(self) -> int:
        return self.host_kv_bytes // self.kv_block_bytes

    @property
    def gpu_num_kv_blocks(self) -> int:
        return self.num_kv_blocks or 0  # 0: size the pool from free memory

    def cpu_num_kv_blocks(self) -> int:
        """Pool size of the CPU backend: the override, or what fits the fp32 KV budget."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        return max(2, CPU_KV_BUDGET_BYTES // self.kv_block_bytes)


@dataclass
class ServerConfig:
    """openinfer-serve's own options (the HTTP side); flags generated like EngineConfig's."""
    host: str = option("127.0.0.1", "address to listen on (0.0.0.0 for every interface)")
    port: int = option(8000, "TCP port to listen on (0: any free port)")
    served_model_name: str | None = option(
        None, "model name clients must send in 'model' (default: the model directory's name)")
    api_key: str | None = option(None, "require 'Authorization: Bearer <key>' on /v1/*, /tokenize and /detokenize "
                                 "(default: $OPENINFER_API_KEY; unset: no key)")
    max_body_mib: float = option(8, "largest request body accepted in MiB (413 beyond)")
    body_read_timeout: float = option(30.0, "seconds a client has to send its whole request body (408 beyond)")
    max_queue_wait: float = option(5.0, "seconds the oldest waiting request may have waited before new requests get "
                                   "503 with Retry-After (bounds the TTFT of admitted requests under overload; 0: "
                                   "only --max-waiting-requests bounds the queue)")
    shutdown_timeout: float = option(30.0, "on SIGTERM or Ctrl-C, seconds in-flight requests have to finish before "
                                     "they are ended with an error")
    log_level: str = option("info", "log level of the server and the engine", choices=LOG_LEVELS)

    def __post_init__(self):
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError("{host} must be an address or a host name, got " + repr(self.host))
        if not _is_int(self.port) or not 0 <= self.port <= 65535:
            raise ConfigError("{port} must be an integer in [0, 65535], got " + repr(self.port))
        if self.api_key is None:
            self.api_key = env_str("OPENINFER_API_KEY")
        if not isinstance(self.max_body_mib, (int, float)) or not self.max_body_mib > 0:
            raise ConfigError("{max_body_mib} must be a positive number, got " + repr(self.max_body_mib))
        for name in ("body_read_timeout", "shutdown_timeout"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ConfigError("{%s} must be a positive number of seconds, got %r" % (name, v))
        if not isinstance(self.max_queue_wait, (int, float)) or isinstance(self.max_queue_wait, bool) \
                or not self.max_queue_wait >= 0:
            raise ConfigError("{max_queue_wait} must be a number of seconds >= 0, got %r" % (self.max_queue_wait,))
        if self.log_level not in LOG_LEVELS:
            raise ConfigError("{log_level} must be one of " + ", ".join(LOG_LEVELS) + f", got {self.log_level!r}")


def _option_names() -> list[str]:
    return [f.name for cls in (EngineConfig, ServerConfig) for f in fields(cls) if f.init]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def host_memory_bytes() -> int:
    """Physical memory of this machine (0 when unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0

"""DFlash / DSpark drafter checkpoints: the config of both formats, its checks against the target, the
tensors each layout holds, and random-weight drafters in the exact layouts.

Two formats, told apart by `architectures`:
- z-lab DFlash (`DFlashDraftModel`, block 16): the block is [anchor, mask x 15]; block slot k predicts the
  token at its own position, so slots 1..15 give 15 drafts. No embedding or lm_head of its own: the
  target's are used. `target_layer_ids` and `mask_token_id` sit under `dflash_config` (or at the top level).
- DeepSpec (`Qwen3DSparkModel`, block 7; DSpark with its Markov head, or its DFlash baseline with
  `markov_rank` 0): anchor-first, slot k predicts the token after it, so all 7 slots are drafts. The
  checkpoint carries frozen copies of the target's embedding and lm_head (byte-identical to the
  target's in the releases; the target's are used).
Both: a stack of Qwen3 decoder layers over context features, `fc` [H, n_taps * H] and `hidden_norm` over
the concatenated residual streams after the target layers `target_layer_ids`, and a final `norm`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .config import ConfigError, ModelConfig

DFLASH_ARCH, DSPARK_ARCH = "DFlashDraftModel", "Qwen3DSparkModel"
MASK_TOKEN_ID = 151669  # the first id past the Qwen3 tokenizer, a row of the target's embedding table


@dataclass(frozen=True)
class DrafterConfig:
    format: str  # "dflash" (z-lab) or "dspark" (DeepSpec)
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    markov_rank: int = 0  # 0: no Markov head
    confidence_head: bool = False  # loaded, not used: its threshold is off by default in the sources

    @property
    def num_drafts(self) -> int:
        """Proposals per round: z-lab reads slots 1..B-1, DeepSpec all B slots."""
        return self.block_size - 1 if self.format == "dflash" else self.block_size

    @property
    def first_slot(self) -> int:
        """The first block slot whose output is a draft."""
        return 1 if self.format == "dflash" else 0

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        archs = d.get("architectures") or []
        if DFLASH_ARCH in archs:
            fmt = "dflash"
        elif DSPARK_ARCH in archs:
            fmt = "dspark"
        else:
            raise ConfigError(f"{{draft_model_path}} is not a DFlash or DSpark drafter (architectures {archs}; "
                              f"expected {DFLASH_ARCH} or {DSPARK_ARCH})")
        sub = d.get("dflash_config") or {}

        def get(name, default=None):
            v = sub.get(name, d.get(name, default))
            if v is None:
                raise ConfigError(f"the drafter's config.json lacks {name!r} ({{draft_model_path}})")
            return v
        heads = int(get("num_attention_heads"))
        rope = d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 1e6))
        markov = int(d.get("markov_rank", 0) or 0)
        head_type = d.get("markov_head_type", "vanilla") if markov else "vanilla"
        if head_type != "vanilla":
            raise ConfigError(f"the drafter's markov_head_type {head_type!r} is not supported (only 'vanilla') "
                              "({draft_model_path})")
        return cls(format=fmt, hidden_size=int(get("hidden_size")), intermediate_size=int(get("intermediate_size")),
                   num_hidden_layers=int(get("num_hidden_layers")), num_attention_heads=heads,
                   num_key_value_heads=int(get("num_key_value_heads", heads)),
                   head_dim=int(d.get("head_dim") or int(get("hidden_size")) // heads), vocab_size=int(get("vocab_size")),
                   rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=float(rope),
                   block_size=int(get("block_size")), num_target_layers=int(get("num_target_layers")),
                   target_layer_ids=tuple(int(x) for x in get("target_layer_ids")),
                   mask_token_id=int(get("mask_token_id", MASK_TOKEN_ID)), markov_rank=markov,
                   confidence_head=bool(d.get("enable_confidence_head", False)))

    @classmethod
    def from_dir(cls, path: str | Path) -> "DrafterConfig":
        p = Path(path)
        if p.is_file():
            raise ConfigError(f"'{p}' is a file; {{draft_model_path}} names a drafter directory (config.json, "
                              "model.safetensors)")
        if not (p / "config.json").is_file():
            raise ConfigError(f"{{draft_model_path}} '{p}' has no config.json")
        return cls.from_dict(json.loads((p / "config.json").read_text()))

    def check_target(self, m: ModelConfig) -> None:
        """One sentence naming the first way this drafter does not fit the target."""
        def bad(what):
            raise ConfigError(f"the drafter does not fit the target: {what} ({{draft_model_path}})")
        if self.hidden_size != m.hidden_size:
            bad(f"hidden size {self.hidden_size}, the target's is {m.hidden_size}")
        if self.vocab_size != m.vocab_size:
            bad(f"vocabulary of {self.vocab_size}, the target's is {m.vocab_size}")
        if self.num_target_layers != m.num_hidden_layers:
            bad(f"it was made for {self.num_target_layers} target layers, the target has {m.num_hidden_layers}")
        ids = self.target_layer_ids
        if not ids or list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= m.num_hidden_layers - 1:
            bad(f"target_layer_ids {list(ids)} must be increasing layer indices below the target's last layer "
                f"({m.num_hidden_layers - 1})")
        if self.rope_theta != m.rope_theta:
            bad(f"rope_theta {self.rope_theta:g}, the target's is {m.rope_theta:g}")
        if not 0 <= self.mask_token_id < m.vocab_size:
            bad(f"mask_token_id {self.mask_token_id} is outside the vocabulary")
        if self.block_size < 2 or self.num_attention_heads % self.num_key_value_heads or self.head_dim % 2:
            bad("block_size below 2, or a head layout Qwen3 layers cannot have")


    def check_cuda(self, m: ModelConfig) -> None:
        """What the CUDA engine's drafter needs beyond check_target: the target's layer geometry, a block
        of at most 16 and a Markov rank that is a multiple of 8."""
        mine = (self.num_attention_heads, self.num_key_value_heads, self.head_dim, self.intermediate_size)
        theirs = (m.num_attention_heads, m.num_key_value_heads, m.head_dim, m.intermediate_size)
        if mine != theirs:
            raise ConfigError(f"the CUDA engine runs drafters with the target's layer geometry (heads, KV heads, "
                              f"head_dim, intermediate size {theirs}); this one has {mine} ({{draft_model_path}})")
        if self.block_size > 16 or self.markov_rank % 8:
            raise ConfigError(f"the CUDA engine runs draft blocks of up to 16 with a Markov rank that is a multiple "
                              f"of 8; this drafter has block {self.block_size}, rank {self.markov_rank} "
                              "({draft_model_path})")


def drafter_tensors(c: DrafterConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the layout, in checkpoint order (no `model.` prefix)."""
    H, I, D = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_attention_heads * D, c.num_key_value_heads * D
    out = []
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        out += [(p + "input_layernorm.weight", (H,)), (p + "post_attention_layernorm.weight", (H,)),
                (p + "self_attn.q_proj.weight", (q, H)), (p + "self_attn.k_proj.weight", (kv, H)),
                (p + "self_attn.v_proj.weight", (kv, H)), (p + "self_attn.o_proj.weight", (H, q)),
                (p + "self_attn.q_norm.weight", (D,)), (p + "self_attn.k_norm.weight", (D,)),
                (p + "mlp.gate_proj.weight", (I, H)), (p + "mlp.up_proj.weight", (I, H)),
                (p + "mlp.down_proj.weight", (H, I))]
    out += [("fc.weight", (H, len(c.target_layer_ids) * H)), ("hidden_norm.weight", (H,)), ("norm.weight", (H,))]
    if c.format == "dspark":
        out += [("embed_tokens.weight", (c.vocab_size, H)), ("lm_head.weight", (c.vocab_size, H))]
        if c.markov_rank:
            out += [("markov_head.markov_w1.weight", (c.vocab_size, c.markov_rank)),
                    ("markov_head.markov_w2.weight", (c.vocab_size, c.markov_rank))]
        if c.confidence_head:
            out += [("confidence_head.proj.weight", (1, H + c.markov_rank)), ("confidence_head.proj.bias", (1,))]
    return out


def evenly_spaced_taps(num_target_layers: int, n: int) -> list[int]:
    """z-lab's default tap layers: n indices from 1 to L - 3 (36 layers, 5 taps: [1, 9, 17, 25, 33])."""
    if n == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return [round(lo + i * (hi - lo) / (n - 1)) for i in range(n)]


def drafter_config_dict(target: dict, fmt: str, *, layers: int = 5, taps: int = 5, markov_rank: int = 0,
                        block_size: int | None = None, target_layer_ids: list[int] | None = None) -> dict:
    """config.json of a drafter for a target config.json, in the layout of its format's releases."""
    ids = target_layer_ids or evenly_spaced_taps(target["num_hidden_layers"], taps)
    base = {k: target[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                   "head_dim", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings")}
    base.update(num_hidden_layers=layers, num_target_layers=target["num_hidden_layers"], model_type="qwen3",
                attention_bias=False, torch_dtype="bfloat16")
    if fmt == "dflash":
        return dict(base, architectures=[DFLASH_ARCH], block_size=block_size or 16, tie_word_embeddings=True,
                    dflash_config={"target_layer_ids": ids, "mask_token_id": MASK_TOKEN_ID})
    out = dict(base, architectures=[DSPARK_ARCH], block_size=block_size or 7, tie_word_embeddings=False,
               layer_types=["full_attention"] * layers, mask_token_id=MASK_TOKEN_ID, target_layer_ids=ids,
               num_anchors=512, markov_rank=markov_rank, enable_confidence_head=bool(markov_rank))
    if markov_rank:
        out.update(markov_head_type="vanilla", confidence_head_with_markov=True)
    return out


def write_random_drafter(out: str | Path, config: dict, seed: int = 0) -> Path:
    """A drafter directory for `config` (a drafter config.json dict): seeded random BF16 weights under the
    format's tensor names (the target checkpoint's weight rule, openinfer.tools.random_checkpoint)."""
    from .safetensors_io import SafetensorsWriter
    from .tools.random_checkpoint import tensor_chunks

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = DrafterConfig.from_dict(config)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = drafter_tensors(cfg)
    with SafetensorsWriter(out / "model.safetensors", [(n, "BF16", s) for n, s in tensors], {"format": "pt"}) as w:
        for name, shape in tensors:
            for piece in tensor_chunks(name, shape, seed):
                w.write(name, piece)
    return out


def iter_drafter_tensors(path: str | Path, cfg: DrafterConfig):
    """(name, BF16 bits as uint16, memory-mapped) of every tensor of the layout; a missing or misshapen
    tensor is named."""
    from .safetensors_io import SafetensorsFile

    p = Path(path)
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{{draft_model_path}} '{p}' holds no .safetensors file")
    opened = [SafetensorsFile(f) for f in files]
    where = {k: f for f in opened for k in f.keys()}
    for name, shape in drafter_tensors(cfg):
        f = where.get(name)
        if f is None:
            raise ConfigError(f"the drafter lacks the tensor {name!r} ({{draft_model_path}})")
        a = f.get(name)
        if tuple(a.shape) != shape:
            raise ConfigError(f"the drafter's {name} is {list(a.shape)}, expected {list(shape)} ({{draft_model_path}})")
        yield name, a


def load_drafter_fp32(path: str | Path, cfg: DrafterConfig) -> dict:
    """The drafter's tensors as fp32 (the CPU backend)."""
    from .safetensors_io import bf16_to_f32

    return {name: bf16_to_f32(a).reshape(a.shape) for name, a in iter_drafter_tensors(path, cfg)}

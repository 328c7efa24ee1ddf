"""Checkpoint validation and the weight iterator.

A model directory holds config.json and either `model.safetensors` or the shards named by
`model.safetensors.index.json`. Every tensor the model needs (names and shapes from QWEN3.md,
derived from ModelConfig) must be present as BF16; extra tensors are ignored. Refusals name the
tensor and the files looked at.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from .config import ModelConfig, check_model_dir, env_flag
from .safetensors_io import SafetensorsFile, bf16_to_f32

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def expected_tensors(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor the forward pass reads, with its shape, in forward order."""
    H, I, D, V = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size
    out = [("model.embed_tokens.weight", (V, H))]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (H,)),
            (p + "self_attn.q_proj.weight", (cfg.q_size, H)),
            (p + "self_attn.k_proj.weight", (cfg.kv_size, H)),
            (p + "self_attn.v_proj.weight", (cfg.kv_size, H)),
            (p + "self_attn.o_proj.weight", (H, cfg.q_size)),
            (p + "self_attn.q_norm.weight", (D,)),
            (p + "self_attn.k_norm.weight", (D,)),
            (p + "post_attention_layernorm.weight", (H,)),
            (p + "mlp.gate_proj.weight", (I, H)),
            (p + "mlp.up_proj.weight", (I, H)),
            (p + "mlp.down_proj.weight", (H, I)),
        ]
    out.append(("model.norm.weight", (H,)))
    if not cfg.tie_word_embeddings:
        out.append(("lm_head.weight", (V, H)))
    return out


class Checkpoint:
    """A validated checkpoint directory (construction raises on anything wrong)."""

    def __init__(self, model_dir: str | Path, cfg: ModelConfig | None = None):
        self.dir = check_model_dir(model_dir)
        self.cfg = cfg or ModelConfig.from_model_dir(self.dir)
        self.files, weight_map = self._find_files()
        opened = {f: SafetensorsFile(self.dir / f) for f in self.files}
        if weight_map is None:  # single file: its header is the map
            weight_map = {k: self.files[0] for k in opened[self.files[0]].keys()}
        file_list = ", ".join(self.files)
        self.tensors: list[tuple[str, SafetensorsFile]] = []
        for name, shape in expected_tensors(self.cfg):
            f = weight_map.get(name)
            if f is None or name not in opened[f].header:
                raise ValueError(f"checkpoint {self.dir} is missing tensor '{name}' (looked in: {file_list})")
            st = opened[f]
            if st.shape(name) != shape:
                raise ValueError(f"tensor '{name}' in {f} has shape {list(st.shape(name))}, "
                                 f"expected {list(shape)} from config.json")
            if st.dtype(name) != "BF16":
                raise ValueError(f"tensor '{name}' in {f} has dtype {st.dtype(name)}; "
                                 f"openinfer loads BF16 checkpoints only")
            self.tensors.append((name, st))
        # file order, then byte order within the file: sequential reads, page-cache friendly
        rank = {f: i for i, f in enumerate(self.files)}
        self.tensors.sort(key=lambda t: (rank[t[1].path.name], t[1].offset(t[0])))
        self.total_bytes = sum(int(np.prod(st.shape(n))) * 2 for n, st in self.tensors)

    def _find_files(self) -> tuple[list[str], dict[str, str] | None]:
        index = self.dir / INDEX_FILE
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map") or {}
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.dir / f).is_file()]
            if missing:
                raise FileNotFoundError(f"{INDEX_FILE} in {self.dir} names shard(s) that are not there: "
                                        f"{', '.join(missing)}")
            return files, weight_map
        if (self.dir / SINGLE_FILE).is_file():
            return [SINGLE_FILE], None
        present = sorted(p.name for p in self.dir.iterdir())
        raise FileNotFoundError(f"{self.dir} has neither {SINGLE_FILE} nor {INDEX_FILE} "
                                f"(found: {', '.join(present) or 'nothing'})")

    def iter_tensors(self, progress: bool | None = None) -> Iterator[tuple[str, np.ndarray]]:
        """Yields (name, bf16 bits as uint16 [memory-mapped]) in on-disk order."""
        bar = _Progress(self.total_bytes, "loading weights", progress)
        for name, st in self.tensors:
            a = st.get(name)
            yield name, a
            bar.advance(a.nbytes)
        bar.close()


def iter_tensors(model_dir: str | Path, progress: bool | None = None) -> Iterator[tuple[str, np.ndarray]]:
    return Checkpoint(model_dir).iter_tensors(progress)


def load_weights_fp32(model_dir: str | Path, cfg: ModelConfig | None = None,
                      progress: bool | None = None) -> dict[str, np.ndarray]:
    """Every tensor as fp32 (for the reference backend)."""
    return {n: bf16_to_f32(a) for n, a in Checkpoint(model_dir, cfg).iter_tensors(progress)}


class _Progress:
    """A one-line progress bar on stderr, redrawn at most 10 times a second."""

    def __init__(self, total: int, label: str, enabled: bool | None):
        if enabled is None:
            enabled = env_flag("OPENINFER_PROGRESS")
        if enabled is None:
            enabled = sys.stderr.isatty()
        self.on, self.total, self.label = enabled and total > 0, total, label
        self.done, self.t0, self.last = 0, time.monotonic(), 0.0

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.on and (now - self.last >= 0.1 or self.done >= self.total):
            self.last = now
            frac = self.done / self.total
            bar = "#" * int(frac * 30)
            rate = self.done / max(now - self.t0, 1e-9) / 1e9
            sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac:4.0%} "
                             f"{self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB {rate:.2f} GB/s")
            sys.stderr.flush()

    def close(self) -> None:
        if self.on:
            sys.stderr.write("\n")
            sys.stderr.flush()

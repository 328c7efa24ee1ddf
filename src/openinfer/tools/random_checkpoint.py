"""Random-weight Qwen3 checkpoints that look like the Hugging Face releases.

    python -m openinfer.tools.random_checkpoint --preset qwen3-4b --out models/qwen3-4b-random [--seed 0]

Writes config.json, generation_config.json, the bundled Qwen3 tokenizer files and BF16 safetensors
(one `model.safetensors` for tiny/0.6b; shards plus `model.safetensors.index.json` for 4b/8b/32b,
with the releases' shard counts).

Weight scale (`init_rule`; the GPU random-load path mirrors it), chosen so activations keep a sane
scale through depth and logits are peaked rather than flat:
- linear weights [out, in]: N(0, 1/in), so each projection keeps the RMS of its input;
- embedding and lm_head rows: N(0, (2/sqrt(hidden))^2), so after the final RMSNorm the logits have
  std ~2 (the tied case adds the residual stream's growth: ~2..4);
- norm weights (1-D): 1 + U(-0.1, 0.1).

Values are drawn per tensor and per chunk of CHUNK elements from
Generator(PCG64(SeedSequence([seed, crc32(name), chunk]))), in float32, rounded to bf16: the result
depends only on (seed, name, shape), not on the thread count or shard layout. Generation runs on a
thread pool (NumPy releases the GIL) and is written shard by shard, so memory stays bounded.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np

from ..config import ModelConfig
from ..loader import INDEX_FILE, SINGLE_FILE, expected_tensors
from ..safetensors_io import SafetensorsWriter, bf16_to_f32, f32_to_bf16

CHUNK = 1 << 22  # elements per independently seeded chunk
TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "data" / "qwen3-tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

_COMMON = dict(vocab_size=151936, head_dim=128, num_key_value_heads=8)
PRESETS: dict[str, dict] = {
    # tiny: real vocabulary and head_dim, everything else small (CPU tests)
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=151936, head_dim=128, tie_word_embeddings=True, shards=1),
    "qwen3-0.6b": dict(_COMMON, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, tie_word_embeddings=True, shards=1),
    "qwen3-4b": dict(_COMMON, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, tie_word_embeddings=True, shards=3),
    "qwen3-8b": dict(_COMMON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, tie_word_embeddings=False, shards=5),
    "qwen3-32b": dict(_COMMON, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, tie_word_embeddings=False, shards=17),
}

GENERATION_CONFIG = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                     "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                     "transformers_version": "4.51.0"}


def hf_config(preset: str) -> dict:
    """config.json of a preset, with the fields of the official Qwen3 releases."""
    p = PRESETS[preset]
    return {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": p["head_dim"], "hidden_act": "silu",
        "hidden_size": p["hidden_size"], "initializer_range": 0.02, "intermediate_size": p["intermediate_size"],
        "max_position_embeddings": 40960, "max_window_layers": p["num_hidden_layers"], "model_type": "qwen3",
        "num_attention_heads": p["num_attention_heads"], "num_hidden_layers": p["num_hidden_layers"],
        "num_key_value_heads": p["num_key_value_heads"], "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": p["tie_word_embeddings"],
        "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
        "use_sliding_window": False, "vocab_size": p["vocab_size"],
    }


def init_rule(name: str, shape: tuple[int, ...]) -> tuple[str, float]:
    """How a tensor is drawn: ("normal", std) or ("one_plus_uniform", half_width)."""
    if len(shape) == 1:
        return "one_plus_uniform", 0.1
    if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
        return "normal", 2.0 / float(np.sqrt(shape[1]))
    return "normal", 1.0 / float(np.sqrt(shape[1]))  # [out, in]: N(0, 1/in)


def _chunk_bf16(name: str, shape: tuple[int, ...], seed: int, c: int) -> np.ndarray:
    n = int(np.prod(shape))
    size = min(CHUNK, n - c * CHUNK)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(name.encode()), c])))
    kind, s = init_rule(name, shape)
    if kind == "normal":
        x = rng.standard_normal(size, dtype=np.float32)
        x *= np.float32(s)
    else:
        x = rng.random(size, dtype=np.float32)
        x *= np.float32(2 * s)
        x += np.float32(1 - s)
    return f32_to_bf16(x)


def tensor_chunks(name: str, shape: tuple[int, ...], seed: int, pool: ThreadPoolExecutor | None = None,
                  lookahead: int = 32) -> Iterator[np.ndarray]:
    """The tensor's bf16 bits, flat, chunk by chunk (parallel over chunks when given a pool)."""
    nchunks = -(-int(np.prod(shape)) // CHUNK)
    if pool is None:
        for c in range(nchunks):
            yield _chunk_bf16(name, shape, seed, c)
        return
    futs = []  # bounded look-ahead (lookahead x 8 MiB) keeps memory flat
    for c in range(nchunks):
        futs.append(pool.submit(_chunk_bf16, name, shape, seed, c))
        if len(futs) >= lookahead:
            yield futs.pop(0).result()
    for f in futs:
        yield f.result()


def random_weights_fp32(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """The same weights a checkpoint written with `seed` holds, as fp32 (for the CPU backend)."""
    out = {}
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for name, shape in expected_tensors(cfg):
            bits = np.concatenate(list(tensor_chunks(name, shape, seed, pool)))
            out[name] = bf16_to_f32(bits).reshape(shape)
    return out


def _shard_plan(tensors: list[tuple[str, tuple[int, ...]]], num_shards: int) -> list[list[tuple[str, tuple]]]:
    """Splits tensors (in order) into num_shards runs of about equal bytes, like the releases."""
    sizes = [int(np.prod(s)) * 2 for _, s in tensors]
    target = sum(sizes) / num_shards
    shards: list[list] = [[] for _ in range(num_shards)]
    acc = 0
    for t, n in zip(tensors, sizes):
        shards[min(num_shards - 1, int((acc + n / 2) // target))].append(t)
        acc += n
    return [s for s in shards if s]


def write_checkpoint(out: str | Path, config: dict, seed: int = 0, num_shards: int = 1,
                     workers: int | None = None, quiet: bool = True) -> Path:
    """Writes a full model directory for `config` (an HF config.json dict)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_dict(config, GENERATION_CONFIG)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    for f in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER_DIR / f, out / f)
    shutil.copyfile(TOKENIZER_DIR / "README.md", out / "TOKENIZER_README.md")

    tensors = expected_tensors(cfg)
    plan = _shard_plan(tensors, num_shards)
    names = ([SINGLE_FILE] if len(plan) == 1 else
             [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))])
    meta = {"format": "pt"}
    weight_map, total = {}, 0
    with ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        for fname, shard in zip(names, plan):
            t0 = time.perf_counter()
            with SafetensorsWriter(out / fname, [(n, "BF16", s) for n, s in shard], meta) as w:
                for name, shape in shard:
                    for piece in tensor_chunks(name, shape, seed, pool):
                        w.write(name, piece)
                    weight_map[name] = fname
            total += w.data_size
            if not quiet:
                print(f"wrote {fname}: {w.data_size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s",
                      file=sys.stderr)
    if len(plan) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return out


PROG = "random_checkpoint"


# Drafters for speculative decoding, in the exact layouts of their releases (openinfer.drafter): the
# z-lab DFlash (block 16), DeepSpec's DSpark (block 7, Markov rank 256) and its DFlash block-7 baseline;
# tiny-*: small drafters of the tiny target that the CPU backend runs in seconds.
DRAFTER_PRESETS: dict[str, tuple[str, str, dict]] = {  # name: (target preset, format, shape)
    **{f"{fmt}-{t}": (t, kind, dict(markov_rank=rank))
       for t in ("qwen3-4b", "qwen3-8b")
       for fmt, kind, rank in (("dflash", "dflash", 0), ("dspark", "dspark", 256), ("dflash7", "dspark", 0))},
    "tiny-dflash": ("tiny", "dflash", dict(layers=2, target_layer_ids=[0, 2])),
    "tiny-dspark": ("tiny", "dspark", dict(layers=2, markov_rank=32, target_layer_ids=[0, 2])),
}


def drafter_config(preset: str) -> dict:
    from ..drafter import drafter_config_dict
    target, fmt, shape = DRAFTER_PRESETS[preset]
    return drafter_config_dict(hf_config(target), fmt, **shape)


def disk_bytes(preset: str) -> int:
    """What a preset's directory takes on disk: its BF16 weights and the tokenizer files (a drafter: its
    weights alone)."""
    if preset in DRAFTER_PRESETS:
        from ..drafter import DrafterConfig, drafter_tensors
        return sum(int(np.prod(shape)) * 2 for _, shape in drafter_tensors(DrafterConfig.from_dict(drafter_config(preset))))
    weights = sum(int(np.prod(shape)) * 2 for _, shape in expected_tensors(ModelConfig.from_dict(hf_config(preset))))
    return weights + sum((TOKENIZER_DIR / f).stat().st_size for f in TOKENIZER_FILES)


def _size(n: int) -> str:
    return f"{n / 1e6:.0f} MB" if n < 1e9 else f"{n / 1e9:.1f} GB"


def _count(minimum: int):
    def parse(v: str) -> int:
        try:
            n = int(v)
        except ValueError:
            n = None
        if n is None or n < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {v!r}")
        return n
    return parse


def _config_in(d: Path) -> dict | None:
    try:
        return json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        return None


def out_problem(out: Path, preset: str) -> str | None:
    """Why `out` cannot take this preset, or None. A directory already holding the same preset is
    rewritten in place (the same files); one holding anything else is left alone."""
    if out.is_file():
        return f"--out '{out}' is a file; it names the directory to write"
    want = drafter_config(preset) if preset in DRAFTER_PRESETS else hf_config(preset)
    if out.is_dir() and any(out.iterdir()) and _config_in(out) != want:
        return f"--out '{out}' is a directory that holds other files (a model?); remove it or choose another"
    parent = next(p for p in [out, *out.parents] if p.exists())
    need, free = disk_bytes(preset), shutil.disk_usage(parent).free
    if need > free:
        return f"{preset} needs {_size(need)} on disk and '{parent}' has {_size(free)} free"
    return None


def main(argv: list[str] | None = None) -> int:
    sizes = ", ".join(f"{p} ({_size(disk_bytes(p))})" for p in PRESETS)
    drafters = ", ".join(f"{p} ({_size(disk_bytes(p))}, for {DRAFTER_PRESETS[p][0]})" for p in DRAFTER_PRESETS)
    ap = argparse.ArgumentParser(prog=f"python -m openinfer.tools.{PROG}", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", required=True, choices=[*PRESETS, *DRAFTER_PRESETS], metavar="PRESET",
                    help=f"the model's shape, with its size on disk: {sizes}; or a drafter for speculative "
                         f"decoding (--dflash-draft-model-path): {drafters}")
    ap.add_argument("--out", required=True, help="the model directory to write (made if missing)")
    ap.add_argument("--seed", type=_count(0), default=0,
                    help="seed of the weights: a preset and a seed always write the same bytes (default: 0)")
    ap.add_argument("--workers", type=_count(1), default=None, help="generator threads (default: all cores)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    try:
        problem = out_problem(out, a.preset)
        if problem:
            print(f"{PROG}: {problem}", file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        if a.preset in DRAFTER_PRESETS:
            from ..drafter import write_random_drafter
            write_random_drafter(out, drafter_config(a.preset), a.seed)
        else:
            write_checkpoint(out, hf_config(a.preset), a.seed, PRESETS[a.preset]["shards"], a.workers, quiet=False)
    except OSError as e:  # unwritable, read-only, out of space
        print(f"{PROG}: cannot write '{e.filename or out}': {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"{a.preset}: wrote {out} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

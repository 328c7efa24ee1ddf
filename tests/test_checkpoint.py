import json
import re
import shutil
import time

import numpy as np
import safetensors

from cli_util import one_line, run

from openinfer.config import ModelConfig
from openinfer.loader import Checkpoint, expected_tensors
from openinfer.safetensors_io import SafetensorsFile, bf16_to_f32, f32_to_bf16, save_file
from openinfer.tools.random_checkpoint import (GENERATION_CONFIG, PRESETS, disk_bytes, hf_config, init_rule,
                                               tensor_chunks, write_checkpoint)


def test_bf16_round_to_nearest_even():
    x = np.array([1.0, -2.5, 0.0, np.inf, -np.inf], np.float32)
    assert np.array_equal(bf16_to_f32(f32_to_bf16(x)), x)  # exactly representable
    u = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF], np.uint32).view(np.float32)
    # halfway rounds to even (down, then up), above halfway up, below down
    assert list(f32_to_bf16(u)) == [0x3F80, 0x3F82, 0x3F81, 0x3F80]
    assert f32_to_bf16(np.array([np.nan], np.float32))[0] == 0x7FC0
    r = np.random.default_rng(0).standard_normal(10000).astype(np.float32)
    assert np.max(np.abs(bf16_to_f32(f32_to_bf16(r)) - r) / np.abs(r)) <= 2.0 ** -8


def test_writer_matches_safetensors_library(tmp_path):
    f32 = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    bf = f32_to_bf16(np.linspace(-3, 3, 10, dtype=np.float32)).reshape(2, 5)
    save_file(tmp_path / "x.safetensors", {"a.f32": f32, "b.bf16": bf}, {"format": "pt"})
    with safetensors.safe_open(str(tmp_path / "x.safetensors"), framework="numpy") as f:
        assert set(f.keys()) == {"a.f32", "b.bf16"}
        assert f.metadata() == {"format": "pt"}
        np.testing.assert_array_equal(f.get_tensor("a.f32"), f32)
        assert f.get_slice("b.bf16").get_dtype() == "BF16"
        assert f.get_slice("b.bf16").get_shape() == [2, 5]
    # and our reader reads what the library writes
    from safetensors.numpy import save_file as lib_save
    lib_save({"w": f32, "h": f32.astype(np.float16)}, str(tmp_path / "lib.safetensors"))
    st = SafetensorsFile(tmp_path / "lib.safetensors")
    np.testing.assert_array_equal(st.get("w"), f32)
    assert st.get("h").dtype == np.float16 and st.dtype("h") == "F16"
    assert SafetensorsFile(tmp_path / "x.safetensors").get("b.bf16").tolist() == bf.tolist()


def test_tiny_checkpoint_round_trip(tiny_dir, tiny_cfg):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg == hf_config("tiny")
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    assert json.loads((tiny_dir / "generation_config.json").read_text()) == GENERATION_CONFIG
    assert (tiny_dir / "tokenizer.json").is_file() and (tiny_dir / "tokenizer_config.json").is_file()
    assert tiny_cfg.eos_token_ids == (151645, 151643) and tiny_cfg.tie_word_embeddings
    exp = expected_tensors(tiny_cfg)
    assert "lm_head.weight" not in dict(exp)
    st = SafetensorsFile(tiny_dir / "model.safetensors")
    assert sorted(st.keys()) == sorted(n for n, _ in exp)
    for name, shape in exp:
        assert st.dtype(name) == "BF16" and st.shape(name) == shape, name
    with safetensors.safe_open(str(tiny_dir / "model.safetensors"), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(n for n, _ in exp)
    for name in ["model.embed_tokens.weight", "model.layers.3.mlp.down_proj.weight", "model.norm.weight"]:
        shape = dict(exp)[name]
        want = np.concatenate(list(tensor_chunks(name, shape, seed=0))).reshape(shape)
        assert np.array_equal(st.get(name), want), name


def test_weight_scale_rule(tiny_dir, tiny_cfg):
    st = SafetensorsFile(tiny_dir / "model.safetensors")
    H = tiny_cfg.hidden_size
    emb = bf16_to_f32(st.get("model.embed_tokens.weight"))
    assert abs(emb.std() - 2 / np.sqrt(H)) < 0.01 * (2 / np.sqrt(H))
    down = bf16_to_f32(st.get("model.layers.0.mlp.down_proj.weight"))
    assert abs(down.std() * np.sqrt(tiny_cfg.intermediate_size) - 1) < 0.02
    norm = bf16_to_f32(st.get("model.layers.0.input_layernorm.weight"))
    assert norm.min() >= 0.9 - 2**-7 and norm.max() <= 1.1 + 2**-7  # bf16 ulp near 1
    assert init_rule("lm_head.weight", (10, 64)) == ("normal", 0.25)


def test_sharded_checkpoint_index(tmp_path):
    cfg = dict(hf_config("tiny"), vocab_size=1000, tie_word_embeddings=False)
    out = write_checkpoint(tmp_path / "m", cfg, seed=3, num_shards=3)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    mc = ModelConfig.from_model_dir(out)
    assert set(index["weight_map"]) == {n for n, _ in expected_tensors(mc)} and "lm_head.weight" in index["weight_map"]
    total = 0
    for f in files:
        st = SafetensorsFile(out / f)
        total += sum(int(np.prod(st.shape(n))) * 2 for n in st.keys())
        assert all(index["weight_map"][n] == f for n in st.keys())
    assert index["metadata"]["total_size"] == total
    ck = Checkpoint(out)
    assert len(ck.tensors) == len(expected_tensors(mc)) and ck.total_bytes == total


def test_presets_shard_counts():
    assert {k: v["shards"] for k, v in PRESETS.items()} == \
        {"tiny": 1, "qwen3-0.6b": 1, "qwen3-4b": 3, "qwen3-8b": 5, "qwen3-32b": 17}
    assert hf_config("qwen3-4b")["head_dim"] * 32 == 4096 and hf_config("qwen3-8b")["tie_word_embeddings"] is False


def test_tiny_write_time(tmp_path):
    t0 = time.perf_counter()
    write_checkpoint(tmp_path / "t", hf_config("tiny"))
    dt = time.perf_counter() - t0
    print(f"tiny checkpoint: {dt:.2f} s")
    assert dt < 20


def test_cli_help_gives_every_preset_its_size_on_disk(cli_env, tiny_dir):
    r, _ = run(cli_env, "python", "-m", "openinfer.tools.random_checkpoint", "--help")
    assert r.returncode == 0
    for p in PRESETS:
        assert re.search(rf"{re.escape(p)} \(\d+(\.\d)? [MG]B\)", " ".join(r.stdout.split())), p
    assert all(h in r.stdout for h in ("--seed SEED", "seed of the weights", "--workers", "--out OUT"))
    written = sum(f.stat().st_size for f in tiny_dir.iterdir())
    assert abs(written - disk_bytes("tiny")) < 0.01 * written


def test_cli_refusals_are_one_line(cli_env, tiny_dir, tmp_path):
    tool = ("python", "-m", "openinfer.tools.random_checkpoint", "--preset", "tiny", "--out")
    config, other = tiny_dir / "config.json", tmp_path / "other"
    other.mkdir()
    (other / "weights.bin").write_bytes(b"x")
    for out, code, line in [
            (config, 2, f"--out '{config}' is a file; it names the directory to write"),
            (other, 2, f"--out '{other}' is a directory that holds other files (a model?); remove it or choose "
                       "another"),
            (config / "m", 1, f"cannot write '{config / 'm'}': Not a directory")]:
        r, dt = run(cli_env, *tool, str(out))
        assert r.returncode == code and one_line(r.stderr) == "random_checkpoint: " + line and dt < 1.0, (r.stderr, dt)
    r, _ = run(cli_env, *tool, str(tmp_path / "m"), "--seed", "-1")
    assert r.returncode == 2 and "argument --seed: expected an integer >= 0, got '-1'" in r.stderr
    # a directory that holds the same preset is written again: the README's quickstart can run twice
    shutil.copytree(tiny_dir, tmp_path / "again")
    r, _ = run(cli_env, *tool, str(tmp_path / "again"))
    assert r.returncode == 0, r.stderr

"""Broken checkpoints and bad options are refused with messages that name the problem."""
import json

import numpy as np
import pytest

from openinfer import EngineConfig, SamplingParams
from openinfer.config import ModelConfig
from openinfer.loader import Checkpoint, expected_tensors
from openinfer.safetensors_io import save_file
from openinfer.tools.random_checkpoint import hf_config

SMALL = dict(hf_config("tiny"), vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             head_dim=16, tie_word_embeddings=False)


def write(d, cfg=SMALL, drop=(), reshape=None, dtype=np.uint16):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    tensors = {}
    for name, shape in expected_tensors(ModelConfig.from_dict(SMALL)):
        if name in drop:
            continue
        if reshape and name == reshape[0]:
            shape = reshape[1]
        tensors[name] = np.zeros(shape, dtype)
    tensors["model.rotary_emb.inv_freq"] = np.zeros(4, np.float32)  # unknown extras are ignored
    save_file(d / "model.safetensors", tensors)
    return d


def test_good_small_checkpoint(tmp_path):
    ck = Checkpoint(write(tmp_path / "ok"))
    assert len(list(ck.iter_tensors(progress=False))) == len(expected_tensors(ck.cfg))


def test_missing_tensor(tmp_path):
    d = write(tmp_path / "m", drop=["model.layers.1.mlp.up_proj.weight"])
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'.*model\.safetensors"):
        Checkpoint(d)


def test_missing_lm_head_when_untied(tmp_path):
    with pytest.raises(ValueError, match="lm_head.weight"):
        Checkpoint(write(tmp_path / "m", drop=["lm_head.weight"]))


def test_wrong_shape(tmp_path):
    d = write(tmp_path / "s", reshape=("model.layers.0.self_attn.k_proj.weight", (16, 32)))
    with pytest.raises(ValueError) as e:
        Checkpoint(d)
    msg = str(e.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "[16, 32]" in msg and "[32, 32]" in msg


def test_wrong_dtype(tmp_path):
    with pytest.raises(ValueError, match="F32"):
        Checkpoint(write(tmp_path / "f", dtype=np.float32))


def test_unknown_architecture(tmp_path):
    d = write(tmp_path / "a", cfg=dict(SMALL, architectures=["LlamaForCausalLM"], model_type="llama"))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        Checkpoint(d)


def test_missing_dir_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="`hf download Qwen/Qwen3-4B --local-dir models/Qwen3-4B`"):
        Checkpoint(tmp_path / "nope")
    # the CPU backend gets the tiny preset, which it can run, not a 4B download
    with pytest.raises(FileNotFoundError, match=r"--preset tiny`$") as e:
        EngineConfig(str(tmp_path / "nope"), device="cpu")
    assert "hf download" not in str(e.value)
    ok = write(tmp_path / "ok")
    with pytest.raises(FileNotFoundError, match=f"'{ok / 'config.json'}' is a file, not a model directory; "
                                                f"its directory is '{ok}'"):
        EngineConfig(str(ok / "config.json"), device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_model_dir(tmp_path / "empty")
    d = write(tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        Checkpoint(d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        Checkpoint(d)


def test_engine_config_validation(tmp_path):
    d = write(tmp_path / "ok")
    assert EngineConfig(str(d), device="cpu").max_model_len == 40960
    for kw, field in [({"device": "tpu"}, "device"), ({"load_format": "gguf"}, "load_format"),
                      ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"), ({"max_num_seqs": 0}, "max_num_seqs"),
                      ({"kv_block_size": 12}, "kv_block_size"), ({"max_model_len": 10**6}, "max_model_len"),
                      ({"max_num_batched_tokens": 8}, "max_num_batched_tokens"), ({"num_kv_blocks": 1}, "num_kv_blocks")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(str(d), **kw)


def test_sampling_params_validation():
    # the whole table of verdicts, the same as the server's: tests/test_validation.py
    for kw, field in [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                      ({"top_p": 1.5}, "top_p"), ({"top_k": 1.5}, "top_k"), ({"seed": -2**63 - 1}, "seed"),
                      ({"logprobs": 21}, "logprobs"), ({"stop": [5]}, "stop"), ({"stop_token_ids": [-2]}, "stop_token_ids")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    assert SamplingParams(stop="x").stop == ["x"] and SamplingParams(temperature=0).greedy

"""DFlash / DSpark drafters on the NumPy backend: both checkpoint formats and their refusals, the paged
drafter against a dense one written separately, and speculative decoding with it through the engine:
lossless, with the prefix cache on."""
from __future__ import annotations

import json

import numpy as np
import pytest
from engine_util import run_requests as _run

from openinfer import EngineConfig, LLMEngine, SamplingParams
from openinfer.config import ConfigError, ModelConfig
from openinfer.drafter import DrafterConfig, drafter_config_dict, drafter_tensors, write_random_drafter
from openinfer.loader import load_weights_fp32
from openinfer.reference.model import dense_forward
from openinfer.step import StepInput
from openinfer.tools.random_checkpoint import hf_config

TAPS = [0, 2]  # the tiny target has 4 layers; a tap may not be the last


def tiny_drafter_config(tiny_dir, fmt, markov_rank=0):
    t = json.loads((tiny_dir / "config.json").read_text())
    cfg = drafter_config_dict(t, fmt, layers=2, taps=len(TAPS), markov_rank=markov_rank)
    if fmt == "dflash":
        cfg["dflash_config"]["target_layer_ids"] = TAPS
    else:
        cfg["target_layer_ids"] = TAPS
    return cfg


@pytest.fixture(scope="module", params=[("dspark", 32), ("dspark", 0), ("dflash", 0)], ids=["dspark", "dflash7", "dflash16"])
def drafter_dir(request, tiny_dir, tmp_path_factory):
    fmt, rank = request.param
    return write_random_drafter(tmp_path_factory.mktemp("drafter") / f"{fmt}{rank}",
                                tiny_drafter_config(tiny_dir, fmt, rank), seed=5)


def test_release_layouts():
    """The 4B drafters' tensors as the releases name and shape them."""
    t = hf_config("qwen3-4b")
    z = DrafterConfig.from_dict(drafter_config_dict(t, "dflash"))
    d = DrafterConfig.from_dict(drafter_config_dict(t, "dspark", markov_rank=256))
    assert (z.format, z.block_size, z.num_drafts, z.target_layer_ids) == ("dflash", 16, 15, (1, 9, 17, 25, 33))
    assert (d.format, d.block_size, d.num_drafts, d.markov_rank) == ("dspark", 7, 7, 256)
    zt, dt = dict(drafter_tensors(z)), dict(drafter_tensors(d))
    assert zt["fc.weight"] == (2560, 12800) and zt["layers.4.self_attn.k_proj.weight"] == (1024, 2560)
    assert "embed_tokens.weight" not in zt and len(zt) == 5 * 11 + 3
    assert dt["markov_head.markov_w1.weight"] == dt["markov_head.markov_w2.weight"] == (151936, 256)
    assert dt["confidence_head.proj.weight"] == (1, 2816) and dt["lm_head.weight"] == (151936, 2560)


def test_config_fields_in_either_place(tiny_dir):
    cfg = tiny_drafter_config(tiny_dir, "dflash")
    top = dict(cfg, target_layer_ids=TAPS, mask_token_id=151669)
    del top["dflash_config"]
    assert DrafterConfig.from_dict(top) == DrafterConfig.from_dict(cfg)
    moved = dict(cfg, rope_parameters={"rope_theta": cfg.pop("rope_theta")})
    assert DrafterConfig.from_dict(moved).rope_theta == 1e6


@pytest.mark.parametrize("change,needle", [
    (dict(architectures=["Qwen3ForCausalLM"]), "is not a DFlash or DSpark drafter"),
    (dict(hidden_size=512), "hidden size 512, the target's is 256"),
    (dict(vocab_size=1000), "vocabulary of 1000"),
    (dict(num_target_layers=36), "made for 36 target layers, the target has 4"),
    (dict(target_layer_ids=[0, 3]), "below the target's last layer"),
    (dict(target_layer_ids=[2, 0]), "must be increasing"),
    (dict(markov_rank=8, markov_head_type="gated"), "'gated' is not supported"),
    (dict(rope_theta=10000.0), "rope_theta 10000"),
])
def test_drafters_that_do_not_fit_are_refused(tiny_dir, tmp_path, change, needle):
    cfg = dict(tiny_drafter_config(tiny_dir, "dspark"), **change)
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        EngineConfig(str(tiny_dir), device="cpu", draft_model_path=str(d))
    msg = e.value.render(lambda n: "--dflash-draft-model-path" if n == "draft_model_path" else n)
    assert needle in str(e.value) and "\n" not in msg and "--dflash-draft-model-path" in msg


@pytest.mark.parametrize("change, needle", [
    (dict(intermediate_size=64), "the CUDA engine runs drafters with the target's layer geometry"),
    (dict(block_size=17), "draft blocks of up to 16"),
])
def test_the_cuda_engine_refuses_drafters_it_cannot_run(tiny_dir, tmp_path, change, needle):
    d = write_random_drafter(tmp_path / "d", dict(tiny_drafter_config(tiny_dir, "dflash"), **change))
    with pytest.raises(ConfigError) as e:
        EngineConfig(str(tiny_dir), device="cuda", draft_model_path=str(d))
    assert needle in str(e.value)
    EngineConfig(str(tiny_dir), device="cpu", draft_model_path=str(d))  # the NumPy drafter runs any geometry


def test_missing_or_misshapen_tensors_are_named(tiny_dir, tmp_path):
    from openinfer.safetensors_io import SafetensorsWriter
    cfg = tiny_drafter_config(tiny_dir, "dspark")
    d = write_random_drafter(tmp_path / "d", cfg)
    with SafetensorsWriter(d / "model.safetensors", [("fc.weight", "BF16", (256, 256))], {}) as w:
        w.write("fc.weight", np.zeros(256 * 256, np.uint16))
    with pytest.raises(ConfigError, match="lacks the tensor 'layers.0.input_layernorm.weight'"):
        LLMEngine(EngineConfig(str(tiny_dir), device="cpu", draft_model_path=str(d)))
    with pytest.raises(ConfigError, match="is a file"):
        EngineConfig(str(tiny_dir), device="cpu", draft_model_path=str(d / "config.json"))


def test_speculation_with_the_host_tier_is_refused(tiny_dir, drafter_dir):
    with pytest.raises(ConfigError, match="not supported yet"):
        EngineConfig(str(tiny_dir), device="cpu", draft_model_path=str(drafter_dir), kv_offload=True,
                     kv_offload_host_gib=0.1)


def _dense_drafts(m: ModelConfig, tw, dc: DrafterConfig, dw, tokens: list[int], anchor: int) -> list[int]:
    """Greedy drafts after `tokens` + anchor, written out again without pages or caches: the target's
    residual streams by a dense forward, the context and block K/V of every drafter layer at once."""
    W = {k: np.asarray(v, np.float32) for k, v in dw.items()}
    H, D, nH, nKV, eps = dc.hidden_size, dc.head_dim, dc.num_attention_heads, dc.num_key_value_heads, dc.rms_norm_eps
    norm = lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps)) * w  # noqa: E731
    _, states = dense_forward(m, tw, tokens, hidden_states=True)
    c = norm(np.concatenate([states[l] for l in dc.target_layer_ids], -1) @ W["fc.weight"].T, W["hidden_norm.weight"])
    p, B = len(tokens), dc.block_size
    pos = np.arange(p + B)
    inv = 1.0 / dc.rope_theta ** (np.arange(0, D, 2) / D)
    emb = np.concatenate([np.outer(pos, inv)] * 2, -1)
    cos, sin = np.cos(emb).astype(np.float32)[:, None], np.sin(emb).astype(np.float32)[:, None]
    rope = lambda x, sl: x * cos[sl] + np.concatenate([-x[..., D // 2:], x[..., :D // 2]], -1) * sin[sl]  # noqa: E731
    embed = np.asarray(tw["model.embed_tokens.weight"], np.float32)
    x = embed[[anchor] + [dc.mask_token_id] * (B - 1)]
    for i in range(dc.num_hidden_layers):
        pre = f"layers.{i}."
        n = norm(x, W[pre + "input_layernorm.weight"])
        q = rope(norm((n @ W[pre + "self_attn.q_proj.weight"].T).reshape(B, nH, D), W[pre + "self_attn.q_norm.weight"]),
                 slice(p, None))
        kin = np.concatenate([c, n])  # context rows from c (no input norm), block rows from n
        k = rope(norm((kin @ W[pre + "self_attn.k_proj.weight"].T).reshape(p + B, nKV, D),
                      W[pre + "self_attn.k_norm.weight"]), slice(None))
        v = (kin @ W[pre + "self_attn.v_proj.weight"].T).reshape(p + B, nKV, D)
        k, v = np.repeat(k, nH // nKV, 1), np.repeat(v, nH // nKV, 1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.float32(np.sqrt(D))  # no mask at all
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", s, v).reshape(B, nH * D) @ W[pre + "self_attn.o_proj.weight"].T
        mm = norm(x, W[pre + "post_attention_layernorm.weight"])
        g = mm @ W[pre + "mlp.gate_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * (mm @ W[pre + "mlp.up_proj.weight"].T)) @ W[pre + "mlp.down_proj.weight"].T
    logits = norm(x, W["norm.weight"])[dc.first_slot:] @ embed.T  # the tiny target ties its lm_head
    out, prev = [], anchor
    for j in range(len(logits)):
        lj = logits[j] + (W["markov_head.markov_w2.weight"] @ W["markov_head.markov_w1.weight"][prev]
                          if dc.markov_rank else 0)
        prev = int(np.argmax(lj))
        out.append(prev)
    return out


def test_paged_drafter_equals_a_dense_one(tiny_dir, drafter_dir):
    """A prompt prefilled in two chunks (the drafter's context K/V written by both), then drafts after
    the first token: the same greedy drafts as the dense drafter."""
    eng = LLMEngine(EngineConfig(str(tiny_dir), device="cpu", num_kv_blocks=32, draft_model_path=str(drafter_dir)))
    be, dc = eng.backend, eng.config.drafter_config
    prompt = list(np.random.default_rng(1).integers(1000, 50000, 37))
    table = np.array([[3, 7, 1, 9]], np.int32)

    def step(toks, start, draft):
        n = len(toks)
        pos = np.arange(start, start + n, dtype=np.int32)
        return be.step(StepInput(
            input_ids=np.array(toks, np.int32), positions=pos, query_start_loc=np.array([0, n], np.int32),
            context_lens=np.array([start + n], np.int32), block_tables=table,
            slot_mapping=(table[0, pos // 16] * 16 + pos % 16).astype(np.int32), sample_idx=np.array([n - 1], np.int32),
            temperature=np.zeros(1, np.float32), top_p=np.ones(1, np.float32), top_k=np.zeros(1, np.int32),
            seeds=np.zeros(1, np.uint64), draft=np.array([int(draft)], np.int32)))
    step(prompt[:20], 0, False)
    out = step(prompt[20:], 20, True)
    first = int(out.tokens[0])
    want = _dense_drafts(eng.model_config, load_weights_fp32(tiny_dir, eng.model_config, progress=False), dc,
                         be.drafter.w, prompt, first)
    assert out.drafts.shape == (1, dc.num_drafts) and out.drafts[0].tolist() == want


def test_a_draft_block_past_the_table_is_refused(tiny_dir, drafter_dir):
    """The CUDA drafter writes its block's K/V at the block_size positions after a drafting step's context,
    so its block table must cover them (plan.cu); the NumPy backend refuses a shorter table alike."""
    eng = LLMEngine(EngineConfig(str(tiny_dir), device="cpu", num_kv_blocks=32, draft_model_path=str(drafter_dir)))
    n = 33 - eng.config.drafter_config.block_size  # the draft block ends one position into a third block

    def step(table, draft=True):
        table, pos = np.array(table, np.int32), np.arange(n, dtype=np.int32)
        return eng.backend.step(StepInput(
            input_ids=np.arange(1000, 1000 + n, dtype=np.int32), positions=pos,
            query_start_loc=np.array([0, n], np.int32), context_lens=np.array([n], np.int32), block_tables=table,
            slot_mapping=(table[0, pos // 16] * 16 + pos % 16).astype(np.int32), sample_idx=np.array([n - 1], np.int32),
            temperature=np.zeros(1, np.float32), top_p=np.ones(1, np.float32), top_k=np.zeros(1, np.int32),
            seeds=np.zeros(1, np.uint64), draft=np.array([int(draft)], np.int32)))
    for short in ([[3, 7]], [[3, 7, 0]]):  # too narrow; the padding block
        with pytest.raises(ValueError, match="does not cover its draft block"):
            step(short)
    assert (step([[3, 7, 1]]).drafts >= 0).all()
    step([[3, 7]], draft=False)  # a step that does not draft needs blocks for its own tokens only


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_speculation_with_the_drafter_is_lossless(tiny_dir, drafter_dir, temperature):
    rng = np.random.default_rng(2)
    prompts = {f"r{i}": rng.integers(1000, 50000, int(n)).tolist() for i, n in enumerate(rng.integers(5, 40, 2))}
    sp = SamplingParams(max_tokens=8, temperature=temperature, seed=4, ignore_eos=True)
    plain = _run(LLMEngine(EngineConfig(str(tiny_dir), device="cpu", num_kv_blocks=48)),
                 {r: (p, sp) for r, p in prompts.items()})
    eng = LLMEngine(EngineConfig(str(tiny_dir), device="cpu", num_kv_blocks=48, draft_model_path=str(drafter_dir)))
    assert _run(eng, {r: (p, sp) for r, p in prompts.items()}) == plain
    st = eng.stats()
    assert st["spec_rounds"] > 0 and st["spec_draft_tokens"] > 0 and st["kv_blocks_used"] == 0


def test_prefix_hit_serves_the_drafter_too(tiny_dir, drafter_dir):
    """The drafter's context K/V live in the target's blocks: after a prefix-cache hit its proposals are
    the ones a cold run proposes (its cache came with the blocks), token for token."""
    p = list(np.random.default_rng(3).integers(1000, 50000, 70))
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eng = LLMEngine(EngineConfig(str(tiny_dir), device="cpu", num_kv_blocks=48, draft_model_path=str(drafter_dir)))
    seen = []
    orig = eng.scheduler._draft

    def spy(seq, out, b):
        orig(seq, out, b)
        seen.append((seq.request_id, list(seq.drafts)))
    eng.scheduler._draft = spy
    cold = _run(eng, {"a": (p, sp)})["a"]
    hit = _run(eng, {"b": (p, sp)})["b"]
    assert eng.stats()["prefix_cache_hit_tokens"] == 69 and hit == cold  # the partial tail too (copied)
    assert [d for r, d in seen if r == "a"] == [d for r, d in seen if r == "b"]


def test_server_speculates_and_reports_it(tiny_dir, drafter_dir):
    """The OpenAI server on the CPU backend with a drafter: completions, plain and streamed, equal the
    server's answers without it, and /metrics counts the rounds."""
    import httpx
    from test_server_harness import RunningServer, metric

    body = {"model": "m", "prompt": "The capital of France is", "max_tokens": 9, "temperature": 0, "ignore_eos": True}
    texts = {}
    for name, kw in (("plain", {}), ("spec", {"draft_model_path": str(drafter_dir)})):
        srv = RunningServer(LLMEngine(EngineConfig(str(tiny_dir), device="cpu", num_kv_blocks=48, max_model_len=256,
                                                   **kw)), served_model_name="m")
        try:
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            texts[name] = r.json()["choices"][0]["text"]
            s = httpx.post(srv.url + "/v1/completions", json=dict(body, stream=True), timeout=60).text
            assert s.rstrip().endswith("data: [DONE]")
            streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in s.splitlines()
                               if line.startswith("data: {") and json.loads(line[6:])["choices"])
            assert streamed == texts[name]
            if name == "spec":
                assert metric(srv.url, "openinfer_spec_rounds_total") > 0
                assert metric(srv.url, "openinfer_spec_mean_acceptance_length") >= 1
        finally:
            srv.stop()
    assert texts["spec"] == texts["plain"]

"""End to end on the reference backend with the tiny checkpoint."""
import json
import shutil
from collections import deque

import numpy as np
import pytest

from openinfer import Engine, EngineConfig, LLMEngine, RequestRejected, SamplingParams
from openinfer.reference import dense_forward
from openinfer.sampling_params import sampling_defaults
from openinfer.server.protocol import parse_completion

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PROMPTS = ["The capital of France is", "Hello world, here is a longer prompt that spans more than one block of tokens"]


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return Engine(str(tiny_dir), device="cpu", num_kv_blocks=64)


def dense_greedy(cfg, weights, ids, n):
    ids = list(ids)
    for _ in range(n):
        ids.append(int(np.argmax(dense_forward(cfg, weights, ids)[-1])))
    return ids[-n:]


def test_generate_greedy_matches_dense_loop(engine, tiny_cfg, tiny_weights):
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.prompt for o in outs] == PROMPTS
    for o in outs:
        assert o.prompt_token_ids == engine.tokenizer.encode(o.prompt)
        assert o.token_ids == dense_greedy(tiny_cfg, tiny_weights, o.prompt_token_ids, 6)
        assert o.finish_reason == "length" and o.text == engine.tokenizer.decode(o.token_ids)


def test_prompt_forms_and_order(engine):
    ids = engine.tokenizer.encode(PROMPTS[0])
    a = engine.generate(PROMPTS[0], GREEDY)
    b = engine.generate(ids, GREEDY)
    c = engine.generate([ids, PROMPTS[1], ids[:3]], GREEDY)
    assert len(a) == len(b) == 1 and a[0].token_ids == b[0].token_ids == c[0].token_ids
    assert b[0].prompt is None and c[1].prompt == PROMPTS[1]


def test_batch_equals_alone_with_sampling(engine):
    sp = [SamplingParams(temperature=1.0, top_p=0.9, seed=s, max_tokens=5) for s in (1, 2, 3)]
    prompts = [PROMPTS[0], PROMPTS[1], "x"]
    together = engine.generate(prompts, sp)
    alone = [engine.generate(p, s)[0] for p, s in zip(prompts, sp)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    again = engine.generate(prompts, sp)
    assert [o.token_ids for o in again] == [o.token_ids for o in together]


def test_stop_string_excluded(engine):
    full = engine.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8))[0]
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
    cut = full.text.index(stop)
    o = engine.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, stop=[stop]))[0]
    assert o.finish_reason == "stop" and o.text == full.text[:cut]


def test_logprobs(engine):
    o = engine.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3, logprobs=4))[0]
    assert len(o.logprobs) == 3
    for tok, lp in zip(o.token_ids, o.logprobs):
        assert lp.token_id == tok and len(lp.top) == 4 and lp.top[0][0] == tok
        assert lp.top[0][1] == pytest.approx(lp.logprob) and lp.logprob < 0


def test_prefix_cache_hit(tiny_dir):
    eng = Engine(str(tiny_dir), device="cpu", num_kv_blocks=64)
    ids = list(range(1000, 1040))  # 40 tokens: two full blocks and the 7 tokens before the last can be reused
    first = eng.generate(ids, GREEDY)[0]
    s0 = eng.llm_engine.stats()
    second = eng.generate(ids, GREEDY)[0]
    s1 = eng.llm_engine.stats()
    assert second.token_ids == first.token_ids
    assert s1["prefix_cache_hit_tokens"] - s0["prefix_cache_hit_tokens"] == 39
    assert s1["prefill_tokens_computed"] - s0["prefill_tokens_computed"] == 1  # the last token
    # a 32-token prompt: its 15 tokens before the last were never a prompt's partial tail: one block is a hit
    eng.generate(ids[:32], GREEDY)
    assert eng.llm_engine.stats()["prefix_cache_hit_tokens"] - s1["prefix_cache_hit_tokens"] == 16
    # generated tokens are sealed too: prompt + output reuses the blocks written while decoding
    ext = ids + first.token_ids + [7, 8, 9]
    s2 = eng.llm_engine.stats()
    eng.generate(ext, GREEDY)
    assert eng.llm_engine.stats()["prefix_cache_hit_tokens"] - s2["prefix_cache_hit_tokens"] == 32
    off = Engine(str(tiny_dir), device="cpu", num_kv_blocks=64, enable_prefix_caching=False)
    assert off.generate(ids, GREEDY)[0].token_ids == first.token_ids


def test_chunked_prefill_same_output(tiny_dir, engine):
    small = Engine(str(tiny_dir), device="cpu", num_kv_blocks=64, max_num_batched_tokens=8, max_num_seqs=4)
    a = small.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in a] == [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]


def test_eos_stops_and_ignore_eos(tiny_dir, tmp_path, engine):
    first = engine.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4))[0]
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d, ignore=shutil.ignore_patterns("model.safetensors"))
    (d / "model.safetensors").symlink_to(tiny_dir / "model.safetensors")
    eos = first.token_ids[2]
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps(dict(gen, eos_token_id=[eos])))
    e = Engine(str(d), device="cpu", num_kv_blocks=32)
    o = e.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert o.finish_reason == "stop" and o.token_ids == first.token_ids[:first.token_ids.index(eos) + 1]
    assert o.text == engine.tokenizer.decode(o.token_ids[:-1])  # the EOS token adds no text
    o = e.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert o.finish_reason == "length" and o.token_ids == first.token_ids


def test_generate_without_params_gets_what_the_server_gives(tiny_dir, tmp_path, engine):
    """No SamplingParams: what a /v1/completions request that sets nothing gets, from the same function:
    the model's generation_config.json sampling and 16 tokens."""
    gen = engine.llm_engine.config.model_files.generation_config
    served = parse_completion({"prompt": "x"}, sampling_defaults(gen)).gen.sampling
    assert engine.default_params == served == SamplingParams(max_tokens=16, temperature=0.6, top_p=0.95, top_k=20)
    d = tmp_path / "greedy"  # a model whose generation config says greedy: generate() is greedy
    shutil.copytree(tiny_dir, d, ignore=shutil.ignore_patterns("model.safetensors"))
    (d / "model.safetensors").symlink_to(tiny_dir / "model.safetensors")
    (d / "generation_config.json").write_text(json.dumps(dict(gen, do_sample=False)))
    e = Engine(str(d), device="cpu", num_kv_blocks=32)
    o = e.generate(PROMPTS[0])[0]
    assert o.token_ids == e.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=16))[0].token_ids
    assert len(o.token_ids) == 16 or o.finish_reason == "stop"


def test_llm_engine_requests(tiny_dir):
    # 7 usable blocks; 3 + 50 tokens need 4: the second request waits for the first
    eng = LLMEngine(EngineConfig(str(tiny_dir), device="cpu", num_kv_blocks=8, max_model_len=64))
    from openinfer import RequestRejected
    with pytest.raises(RequestRejected, match="max_model_len"):
        eng.add_request("big", list(range(60)), SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejected, match="vocabulary"):
        eng.add_request("bad", [10**7], SamplingParams(max_tokens=1))
    eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50))
    eng.add_request("b", [4, 5, 6], SamplingParams(max_tokens=50))
    eng.step()
    s = eng.stats()
    assert s["num_running"] == 1 and s["num_waiting"] == 1 and s["kv_blocks_promised"] == 3
    assert eng.abort_request("a")  # frees its blocks: b is admitted into the next step
    eng.step()  # (overlapped: b's prefill goes out behind a's step still in flight, which is then dropped)
    assert eng.stats()["num_running"] == 1 and eng.stats()["num_waiting"] == 0
    while eng.has_unfinished():
        ups = eng.step()
    assert ups[-1].request_id == "b" and ups[-1].finish_reason == "length"
    s = eng.stats()
    assert s["kv_blocks_used"] == 0 and s["num_running"] == 0


def test_random_load_format_matches_checkpoint(tiny_dir, engine):
    rnd = Engine(str(tiny_dir), device="cpu", load_format="random", seed=0, num_kv_blocks=32)
    assert rnd.generate(PROMPTS[0], GREEDY)[0].token_ids == engine.generate(PROMPTS[0], GREEDY)[0].token_ids


def test_cuda_without_gpu_fails_clearly(tiny_dir):
    if shutil.which("nvidia-smi"):
        pytest.skip("a GPU may be present")
    with pytest.raises(Exception) as e:
        Engine(str(tiny_dir), device="cuda")
    msg = str(e.value)
    assert ("cuda" in msg.lower() or "gpu" in msg.lower()) and "\n" not in msg.strip()


def test_step_timing_reported(engine):
    """stats() carries wall and device time per step (the reference backend reports no GPU time)."""
    before = engine.llm_engine.stats()
    engine.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    s = engine.llm_engine.stats()
    assert s["steps"] >= before["steps"] + 3
    assert s["step_wall_seconds"] > before["step_wall_seconds"]
    assert s["last_step_wall_ms"] > 0 and s["last_step_gpu_ms"] == 0.0
    assert s["last_step_host_ms"] == s["last_step_wall_ms"]


def test_close_releases_and_refuses(tiny_dir):
    """close() drops running requests (an overlapped step in flight included), frees the backend's
    memory and makes later work fail clearly; the context manager closes on exit."""
    with Engine(str(tiny_dir), device="cpu", num_kv_blocks=32) as eng:
        le = eng.llm_engine
        le.add_request("a", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
        for _ in range(4):  # prefill, then decode steps: one is left in flight (overlapped)
            le.step()
        assert le.has_unfinished() and le._inflight is not None
    assert not le.has_unfinished() and le._inflight is None
    assert le.block_manager.num_free == le.block_manager.num_usable  # no block leaked
    assert le.backend.kv_cache is None and not le.backend.w  # memory released
    assert le.backend._pending == deque()  # the in-flight step was collected
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate("hello")
    eng.close()  # idempotent


def test_request_seeds_are_the_engine_seeds_draws(tiny_dir):
    """Seeds for requests that bring none come from the engine's seeded generator, one draw per request
    in order (drawn in blocks), and a request's own seed takes none."""
    eng = LLMEngine(EngineConfig(str(tiny_dir), device="cpu", num_kv_blocks=16, seed=7))
    rng = np.random.default_rng(7)
    want = [int(rng.integers(0, 2**63)) for _ in range(150)]
    got = []
    for i in range(150):
        got.append(eng.add_request(f"r{i}", [1, 2], SamplingParams(max_tokens=1)).seed)
        assert eng.add_request(f"own{i}", [1, 2], SamplingParams(max_tokens=1, seed=i)).seed == i
        eng.abort_request(f"r{i}")
        eng.abort_request(f"own{i}")
    assert got == want


@pytest.mark.parametrize("n", [3, 300])  # short prompts: int() of each; long ones: NumPy
def test_prompt_ids_forms(tiny_dir, n):
    eng = LLMEngine(EngineConfig(str(tiny_dir), device="cpu", num_kv_blocks=64, max_model_len=512))
    ids = list(range(1, n + 1))
    for form in (ids, tuple(ids), np.array(ids, np.int32), np.array(ids, np.uint64), np.array(ids, float)):
        seq = eng.add_request("x", form, SamplingParams(max_tokens=1))
        assert seq.token_ids == ids and all(type(t) is int for t in seq.token_ids)
        eng.abort_request("x")
    for bad in (ids[:-1] + [-1], ids[:-1] + [eng.model_config.vocab_size]):
        with pytest.raises(RequestRejected, match="vocabulary"):
            eng.add_request("x", bad, SamplingParams(max_tokens=1))
    # ids _prompt_ids checked (the server's route) pass through add_request as they are; a larger vocabulary's
    # do not, and a plain list is checked again
    from openinfer.engine import _prompt_ids
    checked = _prompt_ids(ids, eng.model_config.vocab_size)
    assert _prompt_ids(checked, eng.model_config.vocab_size) is checked
    wider = _prompt_ids(ids[:-1] + [eng.model_config.vocab_size], eng.model_config.vocab_size + 1)
    with pytest.raises(RequestRejected, match="vocabulary"):
        eng.add_request("x", wider, SamplingParams(max_tokens=1))

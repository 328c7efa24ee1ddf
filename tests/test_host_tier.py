"""The host KV tier on the CPU backend: its bookkeeping, the write and read paths through the scheduler,
restored bytes equal to what was saved, and the races the anchors hit (a block reused while its copy is in
flight, leaks on abort), with every invariant checked after every step."""
from __future__ import annotations

import numpy as np
import pytest

from openinfer import EngineConfig, LLMEngine, SamplingParams
from openinfer.block_manager import block_hash
from openinfer.config import ConfigError
from openinfer.host_tier import HostTier
from openinfer.tools.random_checkpoint import hf_config, write_checkpoint

BS = 16


def toks(n, base=1000):
    return list(range(base, base + n))


# ---- HostTier alone ----

def _saved(tier, h, prev, t):
    slot = tier.reserve(h, prev, t)
    tier.landed(slot)
    return slot


def test_tier_matches_landed_chains_only():
    tier = HostTier(4, BS)
    a, b = toks(BS), toks(BS, 2000)
    ha = block_hash(None, a)
    hb = block_hash(ha, b)
    sa = tier.reserve(ha, None, a)
    assert tier.match(a + b + [1], 0, 2) == []  # saving: not matchable yet
    tier.landed(sa)
    sb = _saved(tier, hb, ha, b)
    assert tier.match(a + b + [1], 0, 2) == [sa, sb]
    assert tier.match(a + b + [1], 0, 1) == [sa]  # bounded by max_blocks
    assert tier.match(a + b, 1, 2) == [sb]  # continuing a chain that the GPU matched first
    assert tier.match(toks(BS, 3000) + b, 0, 2) == []
    assert tier.reserve(ha, None, a) is None  # already here
    tier.check_integrity()


def test_tier_full_evicts_least_recently_used_unpinned():
    tier = HostTier(2, BS)
    blocks = [toks(BS, 1000 * (i + 1)) for i in range(3)]
    hashes = [block_hash(None, t) for t in blocks]
    s0 = _saved(tier, hashes[0], None, blocks[0])
    s1 = _saved(tier, hashes[1], None, blocks[1])
    tier.pin(s0)  # a restore reads block 0: it may not go
    s2 = tier.reserve(hashes[2], None, blocks[2])
    assert s2 == s1 and hashes[1] not in tier and tier.evictions == 1
    assert tier.reserve(block_hash(None, toks(BS, 9000)), None, toks(BS, 9000)) is None  # all busy
    tier.unpin(s0)
    tier.landed(s2)
    tier.check_integrity()
    assert tier.match(blocks[0], 0, 1) == [s0]


# ---- through the engine (NumPy backend) ----

@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    """A small model (2 layers, 16k vocabulary, 8 KiB KV blocks): these tests run hundreds of steps."""
    d = tmp_path_factory.mktemp("tier") / "small"
    write_checkpoint(d, dict(hf_config("tiny"), vocab_size=16384, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32), seed=2)
    return d


@pytest.fixture
def engine_of(small_dir):
    made = []

    def make(**kw):
        opts = dict(device="cpu", num_kv_blocks=24, max_model_len=160, kv_offload=True, kv_offload_host_gib=0.01)
        opts.update(kw)
        eng = LLMEngine(EngineConfig(str(small_dir), **opts))
        made.append(eng)
        return eng
    yield make
    for e in made:
        e.close()


def run(eng, reqs, check=True, on_step=None):
    """reqs: {rid: (prompt ids, SamplingParams)} added at once; returns {rid: output ids}."""
    out = {rid: [] for rid in reqs}
    for rid, (p, sp) in reqs.items():
        eng.add_request(rid, p, sp)
    for _ in range(2000):
        if not eng.has_unfinished():
            break
        for u in eng.step():
            out[u.request_id] += u.new_token_ids
        if check:
            eng.scheduler.check_integrity()
        if on_step:
            on_step(eng)
    else:
        raise AssertionError("did not finish")
    return out


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_every_sealed_block_is_saved_and_bytes_match(engine_of):
    eng = engine_of()
    p = toks(70)  # 4 full blocks of the prompt, its partial tail (5 tokens before the last), then the outputs
    run(eng, {"a": (p, GREEDY)})
    eng.backend.wait_copies()
    eng.scheduler.copies_landed(*eng.backend.copy_progress())
    tier, be = eng.host_tier, eng.backend
    st = eng.stats()
    assert st["offloaded_blocks"] == 5 and st["host_tier_blocks_used"] == 5
    slots = tier.match(p, 0, 4)
    assert len(slots) == 4
    # the device blocks still hold the prompt (cached, not reused): the host copies are bit-identical
    gpu = eng.block_manager.match_prefix(p, 4)
    for bid, slot in zip(gpu, slots):
        np.testing.assert_array_equal(be.host_kv[slot], be.kv_cache[bid])
    # the partial tail: saved once its 5 tokens were computed (the device block went on with the outputs)
    seq_prev, tail = tier.entry(slots[-1])[0], tuple(p[64:69])
    slot, bid = tier.match_partial(seq_prev, tail), eng.block_manager.match_partial(seq_prev, tail)
    assert slot is not None and bid is not None
    np.testing.assert_array_equal(be.host_kv[slot][..., :5, :], be.kv_cache[bid][..., :5, :])
    eng.scheduler.check_integrity()


@pytest.mark.parametrize("overlap", [False, True])
def test_host_restore_equals_gpu_hit_equals_cold(engine_of, overlap):
    """Pure host-restore mode (the GPU prefix cache off): the second request restores its prefix from the
    host; its greedy output equals a GPU prefix hit's and a cold run's."""
    p = toks(70)
    cold = run(engine_of(enable_prefix_caching=False, kv_offload=False, kv_offload_host_gib=None,
                         overlap_steps=overlap), {"c": (p, GREEDY)})["c"]
    gpu = engine_of(kv_offload=False, kv_offload_host_gib=None, overlap_steps=overlap)
    run(gpu, {"warm": (p, GREEDY)})
    hit = run(gpu, {"hit": (p, GREEDY)})["hit"]
    assert gpu.stats()["prefix_cache_hit_tokens"] == 69  # 4 blocks and the partial tail: the last token computed
    host = engine_of(enable_prefix_caching=False, overlap_steps=overlap)
    run(host, {"first": (p, GREEDY)})
    restored = run(host, {"again": (p, GREEDY)})["again"]
    st = host.stats()
    assert st["host_hit_tokens"] == 69 and st["prefix_cache_hit_tokens"] == 0 and st["restored_blocks"] == 5
    assert restored == hit == cold
    assert st["kv_blocks_used"] == 0


def _record_launches(eng) -> list:
    """(kv_load_wait, loads, tokens, sequences) of every launch from now on."""
    seen, launch = [], eng.backend.launch

    def record(step):
        seen.append((step.kv_load_wait, len(step.kv_load), step.num_tokens, step.num_seqs))
        launch(step)
    eng.backend.launch = record
    return seen


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("partial", [True, False])
def test_idle_restore_runs_its_chunk_in_the_launch_of_its_copies(engine_of, overlap, partial, monkeypatch):
    """With nothing else to run, the restore's copies and the prompt's remaining chunk share one launch that
    waits for the copies on the device (kv_load_wait). Copies land three launches late here unless a step
    waits for them: a chunk that read its prefix before it landed would read zeros. The prompt's last token
    stays out of it: with its partial tail restored too, the launch carries the copies alone, and the last
    token runs after they land as the one-token step a cold run ends with (a decode graph on the GPU, which
    cannot wait layer by layer), so a restore gives the cold run's bits."""
    from openinfer.scheduler import Scheduler
    p = toks(70)
    cold = run(engine_of(enable_prefix_caching=False, kv_offload=False, kv_offload_host_gib=None),
               {"c": (p, GREEDY)})["c"]
    eng = engine_of(enable_prefix_caching=False, overlap_steps=overlap)
    if not partial:  # the tier gets the 4 whole blocks only
        monkeypatch.setattr(Scheduler, "_seal_partial", lambda self, seq: None)
    run(eng, {"first": (p, GREEDY)})
    monkeypatch.undo()
    eng.backend.wait_copies()
    eng.scheduler.copies_landed(*eng.backend.copy_progress())
    eng.backend.copy_latency = 3
    eng.backend.kv_cache[:] = 0  # the restored prefix must come from the host
    seen = _record_launches(eng)
    assert run(eng, {"again": (p, GREEDY)})["again"] == cold
    if partial:  # 4 blocks and the partial tail restored; then the last token alone, not waiting on copies
        assert seen[:2] == [(False, 5, 0, 0), (False, 0, 1, 1)], seen
    else:  # 4 blocks restored and the next 5 tokens computed behind them; then the last token alone
        assert seen[:2] == [(True, 4, 5, 1), (False, 0, 1, 1)], seen
    assert not any(w for w, *_ in seen[1:])
    assert eng.stats()["host_hit_tokens"] == (69 if partial else 64)


@pytest.mark.parametrize("overlap", [False, True])
def test_restore_beside_running_requests_waits_on_the_host(engine_of, overlap):
    """A restore admitted while others decode rides with their step without holding it up (no
    kv_load_wait); its chunk runs in a later step, after the copy has landed."""
    p, other = toks(70), toks(20, 9000)
    eng = engine_of(enable_prefix_caching=False, overlap_steps=overlap)
    run(eng, {"first": (p, GREEDY)})
    eng.backend.wait_copies()
    eng.scheduler.copies_landed(*eng.backend.copy_progress())
    eng.backend.copy_latency = 2
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    eng.add_request("other", other, long)
    for _ in range(3):
        eng.step()  # other is decoding now
    seen = _record_launches(eng)
    eng.add_request("again", p, GREEDY)
    out = {"again": [], "other": []}
    while eng.has_unfinished():
        for u in eng.step():
            out[u.request_id] += u.new_token_ids
        eng.scheduler.check_integrity()
    with_loads = [x for x in seen if x[1]]
    assert with_loads == [(False, 5, 1, 1)], seen  # other's decode row alone: the restored chunk waits
    assert not any(w for w, *_ in seen)
    cold = run(engine_of(enable_prefix_caching=False, kv_offload=False, kv_offload_host_gib=None),
               {"c": (p, GREEDY)})["c"]
    assert out["again"] == cold


def test_restore_lands_the_saved_bytes(engine_of):
    eng = engine_of(enable_prefix_caching=False)
    p = toks(40)
    run(eng, {"a": (p, GREEDY)})
    eng.backend.wait_copies()
    eng.scheduler.copies_landed(*eng.backend.copy_progress())
    slots = eng.host_tier.match(p, 0, 2)
    saved = [eng.backend.host_kv[s].copy() for s in slots]
    eng.backend.kv_cache[:] = 0  # whatever b reads of its prefix must come from the host
    eng.add_request("b", p, GREEDY)
    eng.step()  # admitted: the restore goes out with this step
    seq = eng.scheduler.requests["b"]
    eng.backend.wait_copies()
    for bid, data in zip(seq.block_table[:2], saved):
        np.testing.assert_array_equal(eng.backend.kv_cache[bid], data)


def test_block_in_flight_is_never_reused(engine_of):
    """The race the anchors hit: a device block reused while its save is still in flight. Copies land
    three launches late here (their bytes move only then), and the GPU pool is so small that the next
    request must take the finished one's blocks: it has to wait for the saves, and what lands in the host
    tier is the first request's K/V, not the second's."""
    eng = engine_of(num_kv_blocks=7, enable_prefix_caching=False)  # 6 usable blocks
    eng.backend.copy_latency = 3
    a, b = toks(80), toks(80, 5000)  # 5 blocks each + the outputs: one at a time
    run(eng, {"a": (a, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))})
    run(eng, {"b": (b, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))})
    eng.backend.wait_copies()
    eng.scheduler.copies_landed(*eng.backend.copy_progress())
    ref = engine_of(num_kv_blocks=16, enable_prefix_caching=True, kv_offload=False, kv_offload_host_gib=None)
    run(ref, {"a": (a, GREEDY)})
    want = [ref.backend.kv_cache[bid] for bid in ref.block_manager.match_prefix(a, 5)]
    got = [eng.backend.host_kv[s] for s in eng.host_tier.match(a, 0, 5)]
    assert len(got) == 5
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_abort_during_restore_leaks_nothing(engine_of):
    eng = engine_of(enable_prefix_caching=False)
    eng.backend.copy_latency = 5
    p = toks(70)
    run(eng, {"a": (p, GREEDY)})
    eng.backend.wait_copies()
    eng.scheduler.copies_landed(*eng.backend.copy_progress())
    eng.add_request("b", p, GREEDY)
    eng.step()  # b admitted, its restore in flight
    assert eng.scheduler.requests["b"].restoring
    assert eng.abort_request("b")
    eng.scheduler.check_integrity()  # the restore's blocks stay held by the copy, not by b
    for _ in range(8):
        eng.step()
        eng.scheduler.check_integrity()
    eng.backend.wait_copies()
    eng.scheduler.copies_landed(*eng.backend.copy_progress())
    eng.scheduler.check_integrity()
    st = eng.stats()
    assert st["kv_blocks_used"] == 0 and eng.host_tier.num_used == 5  # 4 blocks and the prompt's partial tail
    assert all(eng.host_tier.pins(s) == 0 for s in range(eng.host_tier.num_slots))


def test_host_tier_full_evicts_lru(engine_of):
    eng = engine_of(enable_prefix_caching=False, kv_offload_host_gib=0.00015)  # 19 slots
    n = eng.host_tier.num_slots
    prompts = [toks(16 * 3 + 1, 100 * (i + 1)) for i in range(n)]  # 3 blocks each: n / 3 fit
    for i, p in enumerate(prompts):
        run(eng, {f"r{i}": (p, SamplingParams(max_tokens=1, temperature=0.0))})
    eng.backend.wait_copies()
    eng.scheduler.copies_landed(*eng.backend.copy_progress())
    st = eng.stats()
    assert st["host_tier_blocks_used"] == n and st["host_tier_evictions"] == 3 * n - n
    assert eng.host_tier.match(prompts[-1], 0, 3) != [] and eng.host_tier.match(prompts[0], 0, 3) == []
    eng.scheduler.check_integrity()


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_with_offload(engine_of, seed):
    """Shared prefixes, aborts, late copies and a pool too small for them all: every invariant holds after
    every step (references = holders, host pins = copies in flight), greedy outputs equal a run without the
    tier, and nothing is held at the end."""
    rng = np.random.default_rng(seed)
    prefixes = [toks(int(n), 3000 + 200 * i) for i, n in enumerate(rng.integers(16, 70, 3))]
    reqs = {}
    for i in range(14):
        p = prefixes[rng.integers(3)] + toks(int(rng.integers(1, 30)), 7000 + 50 * i)
        reqs[f"q{i}"] = (p, SamplingParams(max_tokens=int(rng.integers(1, 12)), temperature=0.0, ignore_eos=True))
    plain = engine_of(num_kv_blocks=64, kv_offload=False, kv_offload_host_gib=None)
    want = {rid: run(plain, {rid: r})[rid] for rid, r in reqs.items()}
    eng = engine_of(num_kv_blocks=20, enable_prefix_caching=bool(seed % 2), overlap_steps=seed < 2)
    eng.backend.copy_latency = int(rng.integers(0, 4))
    got, aborted = {}, set()
    for rid, r in reqs.items():  # one after another (each may hit the ones before), a random abort now and then
        got.update(run(eng, {rid: r}))
        if rng.random() < 0.2:
            eng.add_request(rid + "x", *r)
            eng.step()
            eng.abort_request(rid + "x")
            aborted.add(rid)
            eng.scheduler.check_integrity()
    assert got == want
    eng.backend.wait_copies()
    eng.scheduler.copies_landed(*eng.backend.copy_progress())
    eng.scheduler.check_integrity()
    assert eng.stats()["kv_blocks_used"] == 0


# ---- configuration ----

@pytest.mark.parametrize("kw,needle", [
    (dict(kv_offload_host_gib=4), "kv_offload_host_gib needs kv_offload"),
    (dict(kv_offload=True), "kv_offload needs kv_offload_host_gib"),
    (dict(kv_offload=True, kv_offload_host_gib=0), "must be a positive number"),
    (dict(kv_offload=True, kv_offload_host_gib=1e6), "more than this machine's memory"),
    (dict(kv_offload=True, kv_offload_host_gib=1e-4, max_model_len=2048), "fewer blocks than one request"),
])
def test_bad_offload_configuration_one_sentence(tiny_dir, kw, needle):
    with pytest.raises(ConfigError) as e:
        EngineConfig(str(tiny_dir), device="cpu", **kw)
    assert needle in str(e.value) and "\n" not in str(e.value)
    flags = e.value.render(lambda name: "--" + name.replace("_", "-"))
    assert "--kv-offload" in flags

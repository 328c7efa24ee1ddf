"""Speculative decoding, measured: round costs from the backend contract, TPOT at a controlled acceptance,
and the speed-up projected from the measured round costs at DSpark-4B's published acceptance lengths.

  rounds   one target step per round shape, timed through the backend (Backend.step, no scheduler): a plain
           decode step, a verify step over [anchor, d1..dk] for every sequence (StepInput.verify, every row
           sampled) for each span k+1, and with a drafter loaded (--draft-model-path) a verify+draft step
           (StepInput.draft set). Each sequence is prefilled to --context tokens first (its blocks cover the
           context, the largest span and the drafter's block, which a draft writes past the step's tokens);
           the N timed rounds then reuse the same positions (a rolled-back round). Device time
           (StepOutput.gpu_ms; the drafter's StepOutput.draft_ms where the backend reports it) and wall time,
           median of N. On the CUDA engine a verify+draft round of the drafter's span replays its bucket's
           CUDA graph (graphed: true) up to the largest verify bucket; a "verify+draft eager" row times the
           same step with force_eager (the bucket's kernels launched one by one, the same results), so the
           two rows give what the graph saves.
  serve    TPOT and output tok/s in-process (LLMEngine.step, as the server drives it) at concurrency 1/4/8:
           the plain engine (the baseline, and the recordings of its greedy outputs), then the same config
           with a ReplayDrafter at fixed acceptance tau = 1..8 (a controlled acceptance, not a drafter's).
           Its recording (row: recording) is the plain output, or for tau >= 2 with --rerecord N (default 1)
           the speculating engine's own output from up to N untimed runs (the plain output parts from it at
           near-ties, and past a parting it would predict nothing). tokens_off_recording: output past where
           the timed run left its recording (rounds there keep fewer than tau; rounds == rounds_expected
           when it is 0). TPOT per request = (last token time - first token time) / (tokens - 1), p50 over
           requests.
           Lossless check, every speculative output against the plain output of the same prompt: where it
           first parts, the plain run's logprob of its token minus that of the speculative one (an untimed
           rerun of the plain engine with logprobs=5; plain rows: logprobs_run_differs, the requests whose tokens
           that rerun changed). --deterministic runs both engines so (batch-invariant kernels): the
           speculative output must then equal the plain one bit for bit, and the recordings hold at every
           concurrency (without it, a step's batch composition moves bf16 bits and near-ties part the runs).
           Replay rows: mismatched_requests (outputs that part), near_tie_partings (both tokens among the
           plain run's five best, within NEAR_TIE = 0.25: bf16 rounding of the multi-row verify GEMM and the
           1-row decode kernel decides them), real_partings (every other parting, each with why and its
           margin). lossless: no real parting in any row.
  project  from a rounds JSON: TPOT_spec(B) = round_cost(B) / tau vs the plain step(B), at the published
           DSpark-4B tau (GSM8K 6.11, MATH 5.70, MBPP 5.13, MT-Bench 3.64). A projection, not a measurement.

  python -m openinfer.tools.random_checkpoint --preset dspark-qwen3-4b --out DSPARK_DIR   # a random drafter
  python bench/spec_bench.py rounds --preset qwen3-4b --device cuda --context 1024 \\
      --draft-model-path DSPARK_DIR --out bench/results/spec_rounds_4b.json
  python bench/spec_bench.py serve --preset qwen3-4b --device cuda --out bench/results/spec_serve_4b.json
  python bench/spec_bench.py project --rounds-json bench/results/spec_rounds_4b.json \\
      --out bench/results/spec_project_4b.json

Each writes its JSON to --out (the command, date, commit, machine, rows) and prints a short table last.
CPU (the NumPy backend, seconds): --model-path DIR --device cpu with the `tiny` model (tests/test_spec_bench.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_engine import provenance

sys.path.insert(0, str(Path(__file__).resolve().parent))

# DSpark block 7, Qwen3-4B, temperature 1, tau counting the bonus token (../shared/design/SPECULATIVE.md)
PUBLISHED_TAU = {"GSM8K": 6.11, "MATH": 5.70, "MBPP": 5.13, "MT-Bench": 3.64}
CONTROLLED = "controlled acceptance (ReplayDrafter: the first tau-1 proposals of a round are the target's own " \
             "recorded greedy output, the rest wrong; the recording: the plain run's output, or the speculating " \
             "engine's own from untimed runs, see each row's recording)"
PROJECTION = "projection from measured round costs: TPOT_spec = round_cost(B) / tau, not a measurement"
# a greedy parting that bf16 rounding explains: top-1 minus top-2 logit within 4 bf16 ulps of a logit near 10,
# the bound tests/test_gpu_model.py puts on argmax flips between GEMMs of other row counts (batched vs alone)
NEAR_TIE = 0.25
TOP_N = 5  # the plain run's best tokens listed where an output parts


def ints(s: str) -> list[int]:
    out = []
    for part in str(s).split(","):
        if "-" in part:  # 1-8
            a, b = part.split("-")
            out += list(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    return out


# ---------------------------------------------------------------- engines
def engine_config(a, *, draft_model_path=None, **over):
    """An EngineConfig from the common flags (--preset: a config-only directory, random weights)."""
    from openinfer import EngineConfig
    if a.model_path:
        path, fmt = a.model_path, a.load_format or "safetensors"
    else:
        from bench_engine import model_dir
        path, fmt = str(model_dir(a.preset)), a.load_format or "random"
    kw = dict(device=a.device, load_format=fmt, seed=a.seed)
    for name in ("num_kv_blocks", "gpu_memory_utilization"):
        if getattr(a, name, None) is not None:
            kw[name] = getattr(a, name)
    kw.update(over)
    if draft_model_path:
        kw["draft_model_path"] = draft_model_path
    return EngineConfig(path, **kw)


def draft_paths(a, tmp: str) -> list[str]:
    """--draft-model-path DIR[,DIR] and --draft-preset NAME[,NAME] (a random drafter written under tmp)."""
    out = [p for p in (a.draft_model_path or "").split(",") if p]
    for preset in [p for p in (getattr(a, "draft_preset", "") or "").split(",") if p]:
        from openinfer.drafter import write_random_drafter
        from openinfer.tools.random_checkpoint import drafter_config
        out.append(str(write_random_drafter(Path(tmp) / preset, drafter_config(preset), a.seed)))
    return out


# ---------------------------------------------------------------- rounds
class StepMaker:
    """StepInputs built by hand for a backend: sequences with their own blocks, random token ids."""

    def __init__(self, backend, vocab: int, block_size: int, seed: int = 0):
        self.b, self.bs = backend, block_size
        self.vocab = min(vocab, 151643)  # below the special ids
        self.rng = np.random.default_rng(seed)
        self.next_block = 1  # block 0 is the padding block

    def alloc(self, tokens: int) -> list[int]:
        n = -(-tokens // self.bs)
        if self.next_block + n > self.b.num_kv_blocks:
            raise RuntimeError(f"the KV pool ({self.b.num_kv_blocks} blocks) is too small for this benchmark")
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    def step(self, items, verify: bool = False, draft: bool = False, force_eager: bool = False):
        """items: (blocks, first position, tokens) per sequence. Plain: the last token of each samples;
        verify: every token samples (the sequence's [anchor, d1..dk])."""
        from openinfer.step import StepInput
        ids, pos, slots, qsl, ctx, sample = [], [], [], [0], [], []
        bt = np.zeros((len(items), max(len(b) for b, _, _ in items)), np.int32)
        for i, (blocks, p0, n) in enumerate(items):
            ids.append(self.rng.integers(0, self.vocab, n, dtype=np.int32))
            p = np.arange(p0, p0 + n, dtype=np.int32)
            pos.append(p)
            slots.append(np.asarray(blocks, np.int32)[p // self.bs] * self.bs + p % self.bs)
            bt[i, :len(blocks)] = blocks
            sample += list(range(qsl[-1], qsl[-1] + n)) if verify else [qsl[-1] + n - 1]
            qsl.append(qsl[-1] + n)
            ctx.append(p0 + n)
        S = len(sample)
        return StepInput(input_ids=np.concatenate(ids), positions=np.concatenate(pos),
                         query_start_loc=np.array(qsl, np.int32), context_lens=np.array(ctx, np.int32),
                         block_tables=bt, slot_mapping=np.concatenate(slots).astype(np.int32),
                         sample_idx=np.array(sample, np.int32), temperature=np.zeros(S, np.float32),
                         top_p=np.ones(S, np.float32), top_k=np.zeros(S, np.int32),
                         seeds=np.arange(S, dtype=np.uint64), verify=verify,
                         draft=np.ones(len(items), np.int32) if draft else None, force_eager=force_eager)

    def prefill(self, seqs, ctx: int, budget: int, max_seqs: int) -> None:
        """Positions 0..ctx-1 of every sequence, in steps of at most `budget` tokens and `max_seqs` sequences."""
        pieces = [(s, p, min(budget, ctx - p)) for s in seqs for p in range(0, ctx, budget)]
        step, used = [], 0
        for piece in pieces:
            if step and (used + piece[2] > budget or len(step) == max_seqs or any(s is piece[0] for s, _, _ in step)):
                self.b.step(self.step(step))
                step, used = [], 0
            step.append(piece)
            used += piece[2]
        if step:
            self.b.step(self.step(step))


def time_steps(backend, step, n: int, warmup: int, stats=None) -> dict:
    """The same StepInput n + warmup times (it writes the same positions: a rolled-back round each time):
    medians of wall ms, device ms (StepOutput.gpu_ms) and drafter device ms (StepOutput.draft_ms)."""
    walls, gpus, drafts, host_draft, accepted = [], [], [], [], []
    graphs = lambda: getattr(getattr(backend, "eng", None), "graph_steps", 0)  # CUDA graph replays (0 on the CPU)
    g0 = graphs()
    for i in range(warmup + n):
        d0 = stats()["spec_draft_seconds"] if stats else 0.0
        t0 = time.perf_counter()
        out = backend.step(step)
        wall = (time.perf_counter() - t0) * 1e3
        if i < warmup:
            continue
        walls.append(wall)
        gpus.append(float(getattr(out, "gpu_ms", 0.0) or 0.0))
        drafts.append(float(getattr(out, "draft_ms", 0.0) or 0.0))
        if stats:
            host_draft.append((stats()["spec_draft_seconds"] - d0) * 1e3)
        if out.accepted is not None:
            accepted.append(float(np.mean(out.accepted)))
        if step.draft is not None and (out.drafts is None or (np.asarray(out.drafts) < 0).all()):
            raise RuntimeError("a verify+draft step came back without drafts")
    row = dict(steps=n, wall_ms_median=statistics.median(walls), wall_ms_p90=float(np.percentile(walls, 90)),
               gpu_ms_median=statistics.median(gpus), draft_ms_median=statistics.median(drafts),
               graphed=graphs() - g0 == warmup + n)
    if host_draft:  # the engine's own drafter clock (LLMEngine.stats spec_draft_seconds), per step
        row["engine_draft_ms_median"] = statistics.median(host_draft)
    if accepted:
        row["accepted_mean"] = float(np.mean(accepted))
    return row


def bench_rounds_engine(a, label: str, draft_path: str | None) -> list[dict]:
    from openinfer import LLMEngine
    from openinfer.drafter import DrafterConfig
    batches, spans = ints(a.batches), ints(a.spans)
    dcfg = DrafterConfig.from_dir(draft_path) if draft_path else None
    dspan = dcfg.num_drafts + 1 if dcfg else None
    # a drafting step writes the drafter's block at positions up to its context length + block_size - 1,
    # and the engine refuses a block table that does not cover them (plan.cu; Drafter.lookahead)
    lookahead = dcfg.block_size if dcfg else 0
    spans = sorted(set(spans) | ({dspan} if dspan else set()))
    # the CUDA engine holds at most max_num_seqs sampled rows per step, and a verify step samples every row
    cfg = engine_config(a, draft_model_path=draft_path, max_num_seqs=a.max_num_seqs or max(batches) * max(spans),
                        max_model_len=a.context + max(spans) + 16)
    t0 = time.perf_counter()
    eng = LLMEngine(cfg)
    init_s = time.perf_counter() - t0
    backend = eng.backend
    stats = eng.stats if cfg.drafter_config is not None else None
    m = StepMaker(backend, cfg.model_config.vocab_size, cfg.kv_block_size, a.seed)
    rows = []
    base = dict(engine=label, preset=a.preset if not a.model_path else Path(a.model_path).name, device=a.device,
                ctx=a.context, engine_init_s=round(init_s, 2))
    if draft_path:
        d = cfg.drafter_config
        base.update(drafter=dict(path=draft_path, format=d.format, block_size=d.block_size, num_drafts=d.num_drafts,
                                 layers=d.num_hidden_layers, markov_rank=d.markov_rank))
    try:
        for B in batches:
            m.next_block = 1  # every batch size reuses the pool from the start
            seqs = [m.alloc(a.context + max(spans) + lookahead) for _ in range(B)]
            m.prefill(seqs, a.context, cfg.max_num_batched_tokens, max(batches))
            shapes = [("decode", 1, False, False)]
            shapes += [("verify", s, True, False) for s in spans]
            shapes += [("verify+draft", dspan, True, True)] if dspan else []
            if dspan and a.device == "cuda":  # the same round without its graph
                shapes += [("verify+draft eager", dspan, True, True)]
            for what, span, verify, draft in shapes:
                step = m.step([(s, a.context, span) for s in seqs], verify=verify, draft=draft,
                              force_eager=what.endswith("eager"))
                row = dict(base, what=what, batch=B, span=span, tokens=B * span,
                           **time_steps(backend, step, a.rounds, a.warmup, stats))
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "drafter"}), flush=True)
    finally:
        eng.close()
    # the marginal costs, per batch: a verify step over a plain step, the draft over the verify alone
    plain = {r["batch"]: r for r in rows if r["what"] == "decode"}
    ver = {(r["batch"], r["span"]): r for r in rows if r["what"] == "verify"}
    for r in rows:
        p = plain[r["batch"]]
        for basis in ("wall", "gpu"):
            if p[f"{basis}_ms_median"] > 0:
                r[f"{basis}_x_plain"] = r[f"{basis}_ms_median"] / p[f"{basis}_ms_median"]
        if r["what"] == "verify+draft":
            v = ver[(r["batch"], r["span"])]
            r["draft_wall_ms_over_verify"] = r["wall_ms_median"] - v["wall_ms_median"]
            r["draft_gpu_ms_over_verify"] = r["gpu_ms_median"] - v["gpu_ms_median"]
            e = next((x for x in rows if x["what"] == "verify+draft eager" and x["batch"] == r["batch"]), None)
            if e is not None and r["graphed"]:  # what the graph saves on this round
                r["eager_gpu_ms"], r["eager_wall_ms"] = e["gpu_ms_median"], e["wall_ms_median"]
    return rows


def cmd_rounds(a) -> dict:
    from openinfer.config import ConfigError, EngineUnavailable
    rows, errors = [], []
    if not a.no_plain_engine:
        rows += bench_rounds_engine(a, "target", None)
    with tempfile.TemporaryDirectory(prefix="spec-bench-") as tmp:
        for path in draft_paths(a, tmp):
            label = "target+" + Path(path).name
            try:
                rows += bench_rounds_engine(a, label, path)
            except (ConfigError, EngineUnavailable, NotImplementedError) as e:
                # e.g. a backend without the drafter yet: the plain and verify rows above still stand
                errors.append(dict(engine=label, error=f"{type(e).__name__}: {e}"))
                print(f"{label}: {e}", file=sys.stderr)
    # issue 24's measure: a round over the plain engine's decode step (a graph on CUDA; a drafter engine's own
    # decode steps are eager, as they write the drafter's context)
    plain = {r["batch"]: r for r in rows if r["engine"] == "target" and r["what"] == "decode"}
    for r in rows:
        p = plain.get(r["batch"])
        if p is not None and r["engine"] != "target" and p["gpu_ms_median"] > 0:
            r["gpu_x_target_decode"] = r["gpu_ms_median"] / p["gpu_ms_median"]
    return dict(what="rounds", rows=rows, errors=errors)


def table_rounds(res: dict) -> None:
    print("round costs (medians); draft ms: StepOutput.draft_ms (device); host draft: the engine's drafter clock; "
          "x plain: over the same engine's plain step (device time, else wall); x target: over the plain "
          "engine's decode step (device time); graph: the step replayed a CUDA graph")
    print(f"{'engine':28} {'what':18} {'B':>3} {'span':>4} {'wall ms':>9} {'gpu ms':>8} {'draft ms':>8} "
          f"{'host draft':>10} {'x plain':>7} {'x target':>8} graph")
    for r in res["rows"]:
        x = r.get("gpu_x_plain", r.get("wall_x_plain", float("nan")))
        print(f"{r['engine'][:28]:28} {r['what']:18} {r['batch']:3} {r['span']:4} {r['wall_ms_median']:9.3f} "
              f"{r['gpu_ms_median']:8.3f} {r['draft_ms_median']:8.3f} {r.get('engine_draft_ms_median', 0.0):10.3f} "
              f"{x:7.2f} {r.get('gpu_x_target_decode', float('nan')):8.2f} {'yes' if r.get('graphed') else 'no'}")
    for e in res.get("errors", []):
        print(f"{e['engine']}: not measured: {e['error']}")


# ---------------------------------------------------------------- serve
def prompts_of(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, min(vocab, 151643), length).tolist() for _ in range(n)]


def expected_rounds(output_len: int, tau: int, k: int) -> tuple[int, int]:
    """(verify rounds, drafts accepted) of one request when every recording holds: the first token comes
    from the prefill; then each round with r >= 2 tokens left proposes min(k, r - 1) drafts (the scheduler
    never drafts past max_tokens) and keeps min(tau, r) tokens; a last single token is a plain decode step."""
    r, rounds, accepted = output_len - 1, 0, 0
    while r > 0:
        if r == 1:
            break
        kept = min(tau, r, k + 1)
        rounds, accepted, r = rounds + 1, accepted + kept - 1, r - kept
    return rounds, accepted


def closed_loop(eng, tag: str, prompts: list[list[int]], conc: int, params) -> dict:
    """Keeps `conc` requests in flight until every prompt has run; per request the time of each token's
    arrival (the step that returns it). Returns outputs, per-request times and the run's duration."""
    pending = list(enumerate(prompts))
    live, reqs = 0, {}
    t_start = time.perf_counter()
    while pending or eng.has_unfinished():
        while pending and live < conc:
            i, p = pending.pop(0)
            rid = f"{tag}-{i}"
            eng.add_request(rid, p, params)
            reqs[rid] = dict(i=i, added=time.perf_counter(), first=None, last=None, tokens=[], top=[])
            live += 1
        for u in eng.step():
            now = time.perf_counter()
            r = reqs[u.request_id]
            if u.new_token_ids:
                r["first"] = now if r["first"] is None else r["first"]
                r["last"] = now
                r["tokens"] += list(u.new_token_ids)
            if u.logprobs is not None:
                r["top"] += [lp.top for lp in u.logprobs]
            if u.finished:
                live -= 1
    duration = time.perf_counter() - t_start
    return dict(reqs=reqs, duration=duration)


def summarize(run: dict) -> dict:
    reqs = run["reqs"].values()
    tpot = [(r["last"] - r["first"]) * 1e3 / (len(r["tokens"]) - 1) for r in reqs if len(r["tokens"]) > 1]
    ttft = [(r["first"] - r["added"]) * 1e3 for r in reqs if r["first"] is not None]
    ntok = sum(len(r["tokens"]) for r in reqs)
    pct = (lambda xs, q: float(np.percentile(xs, q)) if xs else 0.0)
    return dict(requests=len(run["reqs"]), output_tokens=ntok, duration_s=run["duration"],
                output_tok_s=ntok / run["duration"] if run["duration"] else 0.0,
                tpot_ms_p50=pct(tpot, 50), tpot_ms_mean=float(np.mean(tpot)) if tpot else 0.0,
                tpot_ms_p90=pct(tpot, 90), ttft_ms_p50=pct(ttft, 50))


def outputs(run: dict) -> dict[int, list[int]]:
    return {r["i"]: r["tokens"] for r in run["reqs"].values()}


def first_diff(a, b) -> int:
    """The first index where two token lists differ (the shorter's length when one is the other's prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def parting(plain, spec, check, top, bound: float = NEAR_TIE) -> dict | None:
    """Where a speculative output first leaves the plain greedy one (None: it never does) and why. `check`,
    `top`: the tokens and per-token top-TOP_N [(id, logprob), ...] of an untimed run of the plain engine asking
    logprobs. A near-tie: both tokens are among the plain run's best there and their logprobs (= logits,
    log-softmax only shifts a row) lie within `bound` (random weights make ties of three or more common, so the
    speculative token may be the third best); any other parting is real, with why."""
    n, j = min(len(plain), len(spec)), first_diff(plain, spec)
    if j == n and len(plain) == len(spec):
        return None
    out = dict(first_diff=j, tokens=len(spec), plain_tokens=len(plain), margin=None)
    if j == n:
        return dict(out, kind="real", why="the lengths differ")
    out.update(plain_token=plain[j], spec_token=spec[j])
    if list(check[:j + 1]) != list(plain[:j + 1]) or j >= len(top) or len(top[j]) < 2:
        return dict(out, kind="real", why="no margin: the logprobs run left the plain run by here")
    lp = dict(top[j])
    if spec[j] not in lp or plain[j] not in lp:  # the gap is at least the listed range
        out["margin"] = top[j][0][1] - top[j][-1][1]
        return dict(out, kind="real", why=f"the speculative token is not among the plain run's {len(top[j])} best")
    out["margin"] = abs(lp[plain[j]] - lp[spec[j]])
    if out["margin"] > bound:
        return dict(out, kind="real", why="margin above the near-tie bound")
    return dict(out, kind="near-tie")


def cmd_serve(a) -> dict:
    from openinfer import LLMEngine, SamplingParams
    from openinfer.speculative import ReplayDrafter
    concs, taus, k = ints(a.concurrency), ints(a.taus), a.num_drafts
    if max(taus) > k + 1 or min(taus) < 1:
        raise SystemExit(f"--taus must lie in [1, --num-drafts + 1] = [1, {k + 1}]")
    n_max = max(concs) * a.requests_per_client
    # max_num_seqs: the CUDA engine holds at most max_num_seqs sampled rows per step, and a verify step samples
    # c x (k + 1); the closed loop keeps at most c requests in flight whatever the engine would admit
    over = dict(max_num_seqs=a.max_num_seqs or max(concs) * (k + 1), max_model_len=a.input_len + a.output_len + k + 16,
                enable_prefix_caching=a.prefix_cache, deterministic=a.deterministic)
    if a.overlap_steps is not None:
        over["overlap_steps"] = a.overlap_steps
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True, seed=0)
    warm = SamplingParams(max_tokens=min(a.output_len, 2 * (k + 1) + 1), temperature=0.0, ignore_eos=True, seed=0)
    check = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True, seed=0, logprobs=TOP_N)
    rows, plain_out, plain_top, warm_out, meta = [], {}, {}, {}, {}

    # 1. the plain engine: the baseline, and the recordings of its greedy outputs (per concurrency: a batch
    #    size may change the numerics, so each concurrency's speculative run replays its own plain run)
    cfg = engine_config(a, **over)
    V = cfg.model_config.vocab_size
    prompts = prompts_of(n_max, a.input_len, V, a.seed)
    warm_prompts = prompts_of(max(concs), a.input_len, V, a.seed + 1)
    eng = LLMEngine(cfg)
    meta["overlap_steps_plain"] = cfg.overlap_steps  # the speculating engine never overlaps steps
    try:
        for c in concs:  # a short untimed run first (graphs, allocations), its outputs the warm-up's recordings
            warm_out[c] = outputs(closed_loop(eng, f"warm-plain-c{c}", warm_prompts[:c], c, warm))
            run = closed_loop(eng, f"plain-c{c}", prompts[:c * a.requests_per_client], c, params)
            plain_out[c] = outputs(run)
            # untimed, the same requests again with the top-TOP_N logprobs: the margins where speculation parts
            chk = closed_loop(eng, f"logprobs-plain-c{c}", prompts[:c * a.requests_per_client], c, check)
            plain_top[c] = {r["i"]: (r["tokens"], r["top"]) for r in chk["reqs"].values()}
            rows.append(dict(engine="plain", concurrency=c, tau=None, **summarize(run),
                             logprobs_run_differs=sum(plain_top[c][i][0] != t for i, t in plain_out[c].items())))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        eng.close()

    # 2. the same config with a ReplayDrafter of k proposals; its recordings and acceptance set per run
    drafter = ReplayDrafter({}, k, V, accept=1)
    eng = LLMEngine(engine_config(a, **over), drafter=drafter)
    try:
        for c in concs:
            ps = prompts[:c * a.requests_per_client]
            book = {tuple(p): plain_out[c][i] for i, p in enumerate(ps)}
            warm_book = {tuple(p): warm_out[c][i] for i, p in enumerate(warm_prompts[:c])}
            vars(drafter).update(vars(ReplayDrafter(warm_book, k, V, accept=k + 1)))
            closed_loop(eng, f"warm-spec-c{c}", warm_prompts[:c], c, warm)  # verify steps of c x (k + 1)
            for tau in taus:
                # past a near-tie parting the plain output no longer predicts this engine and rounds keep fewer
                # than tau: so (tau >= 2) record this engine's own output in untimed runs, until one follows
                # its recording (at most --rerecord runs)
                rec, reruns = book, 0
                while tau > 1 and reruns < a.rerecord:
                    vars(drafter).update(vars(ReplayDrafter(rec, k, V, accept=tau)))
                    out = outputs(closed_loop(eng, f"record-c{c}-t{tau}-{reruns}", ps, c, params))
                    reruns += 1
                    rec, old = {tuple(p): out[i] for i, p in enumerate(ps)}, rec
                    if rec == old:
                        break
                vars(drafter).update(vars(ReplayDrafter(rec, k, V, accept=tau)))
                s0 = eng.stats()
                run = closed_loop(eng, f"spec-c{c}-t{tau}", ps, c, params)
                s1 = eng.stats()
                d = {key: s1[key] - s0[key] for key in ("spec_rounds", "spec_draft_tokens", "spec_accepted_tokens")}
                got = outputs(run)
                parts = [dict(request=i, **x) for i in sorted(got)
                         if (x := parting(plain_out[c][i], got[i], *plain_top[c][i])) is not None]
                base = next(r for r in rows if r["engine"] == "plain" and r["concurrency"] == c)
                er = expected_rounds(a.output_len, tau, k)
                row = dict(engine="replay", acceptance=CONTROLLED, concurrency=c, tau=tau, num_drafts=k,
                           **summarize(run), rounds=d["spec_rounds"], draft_tokens=d["spec_draft_tokens"],
                           accepted_tokens=d["spec_accepted_tokens"],
                           # what the rounds must be when the run follows its recording throughout
                           rounds_expected=len(ps) * er[0], accepted_expected=len(ps) * er[1],
                           tokens_per_round=1 + d["spec_accepted_tokens"] / max(1, d["spec_rounds"]),
                           tokens_per_round_expected=1 + er[1] / er[0] if er[0] else 0.0,
                           mismatched_requests=len(parts),
                           near_tie_partings=[x for x in parts if x["kind"] == "near-tie"],
                           real_partings=[x for x in parts if x["kind"] == "real"],
                           recording="plain output" if not reruns else f"own output (untimed runs: {reruns})",
                           tokens_off_recording=sum(len(got[i]) - first_diff(got[i], rec[tuple(p)])
                                                    for i, p in enumerate(ps)))
                row["tpot_speedup_vs_plain"] = base["tpot_ms_p50"] / row["tpot_ms_p50"] if row["tpot_ms_p50"] else 0.0
                row["tok_s_speedup_vs_plain"] = row["output_tok_s"] / max(base["output_tok_s"], 1e-9)
                rows.append(row)
                print(json.dumps({x: y for x, y in row.items() if x not in ("acceptance", "near_tie_partings")}),
                      flush=True)
    finally:
        eng.close()
    meta.update(acceptance=CONTROLLED, input_len=a.input_len, output_len=a.output_len,
                requests_per_client=a.requests_per_client, prefix_cache=a.prefix_cache, rerecord=a.rerecord,
                tpot="per request (last token time - first token time) / (tokens - 1), in-process (LLMEngine.step)",
                deterministic=a.deterministic, near_tie_bound=NEAR_TIE, lossless=all(not r.get("real_partings") for r in rows))
    return dict(what="serve", **meta, rows=rows)


def table_serve(res: dict) -> None:
    print(f"TPOT and output tok/s, in-process; tau = {res['acceptance']}; rounds: counted/expected; off rec: "
          f"tokens past where a run left its recording")
    print(f"{'engine':7} {'conc':>4} {'tau':>3} {'TPOT p50':>9} {'tok/s':>9} {'xTPOT':>6} {'tok/rnd':>7} "
          f"{'rounds':>11} {'off rec':>7} {'mismatch':>8} {'tie':>4} {'real':>4} margins (near-tie)")
    for r in res["rows"]:
        if r["engine"] == "plain":
            print(f"{'plain':7} {r['concurrency']:4} {'-':>3} {r['tpot_ms_p50']:9.3f} {r['output_tok_s']:9.1f}")
        else:
            print(f"{'replay':7} {r['concurrency']:4} {r['tau']:3} {r['tpot_ms_p50']:9.3f} {r['output_tok_s']:9.1f} "
                  f"{r['tpot_speedup_vs_plain']:6.2f} {r['tokens_per_round']:7.2f} "
                  f"{str(r['rounds']) + '/' + str(r['rounds_expected']):>11} {r['tokens_off_recording']:7} "
                  f"{r['mismatched_requests']:8} "
                  f"{len(r['near_tie_partings']):4} {len(r['real_partings']):4} "
                  + " ".join(f"{x['margin']:.3f}" for x in r["near_tie_partings"][:6])
                  + (" ..." if len(r["near_tie_partings"]) > 6 else ""))
    for r in res["rows"]:
        for x in r.get("real_partings", []):
            m = "none" if x["margin"] is None else f"{x['margin']:.3f}"
            print(f"real parting: conc {r['concurrency']} tau {r['tau']} request {x['request']} at token "
                  f"{x['first_diff']}: {x['why']} (margin {m})")
    print(f"lossless (speculative == plain greedy, every request, except partings at a near-tie of the plain "
          f"run: its token's logprob - the speculative one's <= {res['near_tie_bound']}):", res["lossless"])


# ---------------------------------------------------------------- project
def cmd_project(a) -> dict:
    if not Path(a.rounds_json).is_file():
        raise SystemExit(f"project: {a.rounds_json} does not exist (its rounds run failed or did not run)")
    src = json.loads(Path(a.rounds_json).read_text())
    rows = src["rows"]
    taus = {k: v for k, v in PUBLISHED_TAU.items()}
    for t in [x for x in (a.extra_taus or "").split(",") if x]:
        taus[f"tau={t}"] = float(t)
    plain = {r["batch"]: r for r in rows if r["what"] == "decode" and r["engine"] == "target"}
    if not plain:  # only a drafter engine was measured: its plain step
        plain = {r["batch"]: r for r in rows if r["what"] == "decode"}
    rounds = [r for r in rows if r["what"] == "verify+draft" and r["span"] == a.span]
    kind = "verify+draft"
    if not rounds:  # no drafter measured: the verify step alone (the drafter's cost is missing from it)
        rounds = [r for r in rows if r["what"] == "verify" and r["span"] == a.span and r["engine"] == "target"]
        kind = "verify only (no drafter measured: the drafter's cost is not in these rounds)"
    if not rounds:
        raise SystemExit(f"{a.rounds_json} has no verify rows of span {a.span}")
    out = []
    for r in rounds:
        p = plain.get(r["batch"])
        if p is None:
            continue
        for basis in ("gpu", "wall"):
            step, cost = p[f"{basis}_ms_median"], r[f"{basis}_ms_median"]
            if step <= 0 or cost <= 0:  # the CPU backend reports no device time
                continue
            for name, tau in taus.items():
                tpot = cost / tau
                out.append(dict(engine=r["engine"], basis=basis, batch=r["batch"], span=r["span"], benchmark=name,
                                tau=tau, round_ms=cost, plain_step_ms=step, round_x_plain=cost / step,
                                tpot_spec_ms=tpot, tpot_plain_ms=step, speedup=step / tpot))
    goal = [o for o in out if o["batch"] == 1 and o["basis"] == "gpu" and o["tau"] == 5.0]
    return dict(what="project", label=PROJECTION, round_kind=kind, source=a.rounds_json,
                source_commit=src.get("commit"), source_machine=src.get("machine"), span=a.span,
                published_tau="DSpark block 7, Qwen3-4B, temperature 1, tau including the bonus token",
                goal="issue 24: tau 5, concurrency 1, 4B: TPOT <= 0.7 ms (a round <= 1.5x a plain step)",
                goal_check=goal[0] if goal else None, rows=out)


def table_project(res: dict) -> None:
    print(f"PROJECTION (not measured): {res['label']}; round = {res['round_kind']}, span {res['span']}")
    names = list(dict.fromkeys(o["benchmark"] for o in res["rows"]))
    taus = {o["benchmark"]: o["tau"] for o in res["rows"]}
    print(f"{'engine':24} {'basis':5} {'B':>3} {'round ms':>9} {'plain ms':>9} {'x plain':>7}  "
          + " ".join(f"{n[:8] + f' {taus[n]:.2f}':>16}" for n in names) + "   (TPOT ms / speed-up)")
    groups = {}
    for o in res["rows"]:
        groups.setdefault((o["engine"], o["basis"], o["batch"]), {})[o["benchmark"]] = o
    for (engine, basis, B), g in groups.items():
        o = next(iter(g.values()))
        cells = " ".join(f"{g[n]['tpot_spec_ms']:8.3f} {g[n]['speedup']:6.2f}x" if n in g else f"{'':>16}"
                         for n in names)
        print(f"{engine[:24]:24} {basis:5} {B:3} {o['round_ms']:9.3f} {o['plain_step_ms']:9.3f} "
              f"{o['round_x_plain']:7.2f}  {cells}")
    if res.get("goal_check"):
        g = res["goal_check"]
        print(f"goal ({res['goal']}): projected TPOT {g['tpot_spec_ms']:.3f} ms, round {g['round_x_plain']:.2f}x plain")


# ---------------------------------------------------------------- main
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def model_flags(p):
        p.add_argument("--preset", default="qwen3-4b", help="a random_checkpoint preset: config only, random weights")
        p.add_argument("--model-path", default=None, help="a model directory instead of --preset")
        p.add_argument("--load-format", default=None,
                       help="default: random with --preset, safetensors with --model-path")
        p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--num-kv-blocks", type=int, default=None)
        p.add_argument("--gpu-memory-utilization", type=float, default=None)
        p.add_argument("--max-num-seqs", type=int, default=None,
                       help="default: enough sampled rows for the largest verify step (batch x span)")
        p.add_argument("--out", default=None, help="JSON result file")

    r = sub.add_parser("rounds", help="round costs through the backend contract")
    model_flags(r)
    r.add_argument("--batches", default="1,4,8,32")
    r.add_argument("--spans", default="8,16", help="verify spans k+1 (a drafter adds its own)")
    r.add_argument("--context", type=int, default=1024, help="tokens prefilled per sequence before the rounds")
    r.add_argument("--rounds", type=int, default=20, help="timed rounds per shape (median)")
    r.add_argument("--warmup", type=int, default=3)
    r.add_argument("--draft-model-path", default=None,
                   help="drafter directories, comma-separated: an engine each, with verify+draft rows")
    r.add_argument("--draft-preset", default=None,
                   help="random drafter presets written to a temp dir (e.g. tiny-dspark, dspark-qwen3-4b)")
    r.add_argument("--no-plain-engine", action="store_true", help="only the drafter engine(s)")

    s = sub.add_parser("serve", help="TPOT at a controlled acceptance, in-process")
    model_flags(s)
    s.add_argument("--concurrency", default="1,4,8")
    s.add_argument("--taus", default="1-8", help="fixed acceptance lengths (tokens kept per round), <= num-drafts + 1")
    s.add_argument("--num-drafts", type=int, default=7, help="k: proposals per round (DSpark block 7: 7)")
    s.add_argument("--input-len", type=int, default=256)
    s.add_argument("--output-len", type=int, default=128)
    s.add_argument("--requests-per-client", type=int, default=4, help="requests per concurrency slot")
    s.add_argument("--deterministic", action="store_true",
                   help="both engines with deterministic=True: speculative == plain bit for bit, exact acceptance")
    s.add_argument("--prefix-cache", action="store_true",
                   help="keep the prefix cache on (off by default: the speculative runs repeat the prompts)")
    s.add_argument("--rerecord", type=int, default=1,
                   help="untimed runs per tau >= 2 that record the speculating engine's own output for its replay "
                        "(0: replay the plain output)")
    s.add_argument("--overlap-steps", type=lambda v: v.lower() == "true", default=None,
                   help="true/false for the plain engine (default: the engine's default)")

    p = sub.add_parser("project", help="projected TPOT at the published DSpark-4B tau, from a rounds JSON")
    p.add_argument("--rounds-json", required=True)
    p.add_argument("--span", type=int, default=8, help="the verify span of the drafter projected (DSpark block 7: 8)")
    p.add_argument("--extra-taus", default="5", help="more tau values, comma-separated (5: the issue's goal)")
    p.add_argument("--out", default=None)
    return ap


def main(argv=None) -> dict:
    a = parser().parse_args(argv)
    res = {"rounds": cmd_rounds, "serve": cmd_serve, "project": cmd_project}[a.cmd](a)
    res = dict(provenance(), **res)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    {"rounds": table_rounds, "serve": table_serve, "project": table_project}[a.cmd](res)
    return res


if __name__ == "__main__":
    main()

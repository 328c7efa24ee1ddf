"""`LLMEngine` (the synchronous step loop) and the public `Engine.generate`."""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence as Seq

import numpy as np

from .block_manager import BlockManager
from .host_tier import HostTier
from .config import EngineConfig, step_fault
from .runner import Runner
from .sampling_params import SamplingParams, default_params
from .scheduler import Logprob, QueueFull, RequestRejected, RequestUpdate, ScheduledBatch, Scheduler, Sequence
from .tokenizer import Tokenizer

log = logging.getLogger("openinfer")


class LLMEngine:
    """step() = scheduler.schedule() -> runner.launch() -> runner.collect() -> scheduler.postprocess().
    Not thread-safe: drive it from one thread."""

    LOG_PERIOD_S = 10.0

    def __init__(self, config: EngineConfig, drafter=None):
        """drafter: an openinfer.speculative.Drafter (tests and benchmarks pass one in); by default the
        backend's, when config.draft_model_path names one."""
        self.config = config
        if drafter is None and config.drafter_config is not None:
            from .speculative import BackendDrafter
            drafter = BackendDrafter(config.drafter_config.num_drafts, config.drafter_config.block_size)
        self.model_config = config.model_config
        self.tokenizer = Tokenizer.from_files(config.model_files)
        # the detokenizer's byte tables (~0.2 s) build while the weights load (that part drops the GIL)
        threading.Thread(target=self.tokenizer.byte_table, args=(True,), daemon=True).start()
        self.backend = self._make_backend(drafter.num_tokens if drafter is not None else 0)
        self._timing = dict(steps=0, overlapped=0, wall_s=0.0, gpu_s=0.0, last_wall_ms=0.0, last_gpu_ms=0.0, verify_s=0.0,
                            draft_s=0.0)
        self.block_manager = BlockManager(self.backend.num_kv_blocks, config.kv_block_size,
                                          config.enable_prefix_caching)
        nh = self.backend.num_host_blocks
        self.host_tier = HostTier(nh, config.kv_block_size) if nh else None
        self.scheduler = Scheduler(
            self.block_manager, self.tokenizer, max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_prefill_tokens_while_decoding=config.max_prefill_tokens_while_decoding, max_waiting=config.max_waiting,
            eos_token_ids=self.model_config.eos_token_ids or self.tokenizer.eos_token_ids, host_tier=self.host_tier,
            drafter=drafter)
        self.runner = Runner(self.backend, config.kv_block_size)
        # A verify step's inputs are the drafts proposed after the step before it: no overlap while speculating.
        self._overlap = config.overlap_steps and drafter is None
        self._inflight = None  # the step launched and not yet collected (overlapped steps)
        self.collected: ScheduledBatch | None = None  # the step whose updates the last step() returned (its times)
        self._launches = 0  # the backend numbers launches 1, 2, ... (copy_progress() speaks of them)
        self._tier_logged, self._tier_key = 0.0, None
        self._closed = False
        self._seed_rng = np.random.default_rng(config.seed)  # seeds for requests that bring none
        self._seeds: list[int] = []  # drawn from it, not used yet, the next last
        self._fault, self._step_calls = step_fault(), 0  # tests only (OPENINFER_TEST_FAULT)
        log.info("engine ready: device=%s, %d KV blocks of %d tokens, max_model_len %d%s", config.device,
                 self.backend.num_kv_blocks, config.kv_block_size, config.max_model_len,
                 f", host KV tier of {nh} blocks ({nh * config.kv_block_bytes / (1 << 30):.2f} GiB)" if nh else "")

    def _make_backend(self, spec_tokens: int):
        c, m = self.config, self.model_config
        if c.device == "cuda":
            from .cuda_backend import CudaBackend
            return CudaBackend(m, c, spec_tokens)  # EngineUnavailable without an engine or a GPU
        from .reference import ReferenceBackend
        if c.load_format == "random":
            from .tools.random_checkpoint import random_weights_fp32
            weights = random_weights_fp32(m, c.seed)
        else:
            from .loader import load_weights_fp32
            weights = load_weights_fp32(c.model_path, m)
        drafter = None
        if c.drafter_config is not None:
            from .drafter import load_drafter_fp32
            drafter = (c.drafter_config, load_drafter_fp32(c.draft_model_path, c.drafter_config))
        return ReferenceBackend(m, weights, c.cpu_num_kv_blocks(), c.kv_block_size, c.num_host_blocks,
                                drafter=drafter)

    def close(self) -> None:
        """Drops every request and releases the backend's memory (the GPU's at once). Idempotent; the
        engine refuses work afterwards."""
        if self._closed:
            return
        self._closed = True
        self._abandon_inflight()
        for rid in list(self.scheduler.requests):
            self.scheduler.abort(rid)
        self.backend.close()

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams | None = None) -> Sequence:
        """Queues a request; raises RequestRejected (can never run) or QueueFull (try later). Returns the
        scheduler's state of it (read-only: the server's path trace reads its admission time)."""
        if self._closed:
            raise RuntimeError("this openinfer engine is closed")
        params = params or SamplingParams()
        ids = _prompt_ids(prompt_token_ids, self.model_config.vocab_size)
        seed = params.seed if params.seed is not None else self._next_seed()
        return self.scheduler.add_request(request_id, ids, params, seed)

    def _next_seed(self) -> int:
        """The seed of a request that brings none. Drawn 64 at a time: the same values as one draw per
        request (NumPy fills an array draw by draw), and a request's add does not pay for the
        generator's call (~50 us on the 2-vCPU VM, right after a step)."""
        if not self._seeds:
            self._seeds = self._seed_rng.integers(0, 2**63, size=64).tolist()[::-1]
        return self._seeds.pop()

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        """Requests to run, a step in flight, or host-tier copies not landed (their blocks are held)."""
        return self._inflight is not None or self.scheduler.has_unfinished() or self.scheduler.copies_pending()

    def step(self, before_launch: Callable[[], None] | None = None) -> list[RequestUpdate]:
        """One step. `before_launch` runs after scheduling, right before the backend call (which
        drops the GIL): the server posts the previous step's updates there.

        Overlapped steps: a step is launched and left running; the next call launches the step after it
        (decode rows fed on the device, prompt chunks, admissions) before collecting it, so the host's
        scheduling and postprocessing hide under the GPU. The updates of a step come from the call after
        its launch."""
        t0 = time.perf_counter()
        self._step_calls += 1
        try:
            if self._fault is not None:
                self._fault.check(self._step_calls)
            updates, finished_step = self._step(before_launch)
        except BaseException:
            self._abandon_inflight()
            raise
        # Host time per step next to device time per step: the share of a step the GPU waits on Python.
        # (Overlapped: a call's wall time is one step period, waiting included.)
        wall = time.perf_counter() - t0
        self._timing["wall_s"] += wall
        if finished_step:
            gpu = getattr(self.backend, "last_gpu_ms", 0.0) / 1e3
            self._timing["steps"] += 1
            self._timing["gpu_s"] += gpu
            self._timing["last_wall_ms"], self._timing["last_gpu_ms"] = wall * 1e3, gpu * 1e3
        if self.host_tier is not None:
            self._log_host_tier()
        return updates

    def _step(self, before_launch) -> tuple[list[RequestUpdate], bool]:
        """(updates, whether a step's results came back)."""
        sched = self.scheduler
        if sched.copies_in_flight():
            sched.copies_landed(*self.backend.copy_progress())
        prev = self._inflight
        batch = sched.schedule(prev)
        if prev is None:
            if batch.empty:
                if sched.copies_in_flight():  # nothing to run until a copy lands (a restore, held blocks)
                    self.backend.wait_copies()
                    sched.copies_landed(*self.backend.copy_progress())
                return [], False
            if not self._overlap:
                t0 = time.perf_counter()
                self._launch(batch, before_launch)
                out = self._collect(batch)
                if any(it.drafts for it in batch.items):  # a verify step (its drafting included, when in the backend)
                    self._timing["verify_s"] += time.perf_counter() - t0
                return self._postprocess(batch, out), True
            self._launch(batch, before_launch)
            self._inflight = batch
            return [], False
        if not batch.empty:
            self._launch(batch, before_launch)
            self._timing["overlapped"] += 1
            self._inflight = batch
        else:
            self._inflight = None
            if before_launch is not None:
                before_launch()  # nothing launched: hand over the held updates before waiting on the GPU
        return self._postprocess(prev, self._collect(prev)), True

    def _collect(self, batch: ScheduledBatch):
        out = self.runner.collect()
        batch.t_collected = time.perf_counter_ns()  # its tokens are on the host: the device's part is over
        self._timing["draft_s"] += out.draft_ms / 1e3
        return out

    def _postprocess(self, batch: ScheduledBatch, out) -> list[RequestUpdate]:
        updates = self.scheduler.postprocess(batch, out)
        batch.t_processed = time.perf_counter_ns()  # every update of the step made, text detokenized
        self.collected = batch
        return updates

    def _launch(self, batch, before_launch) -> None:
        try:
            self.runner.launch(batch, before_launch)
        except BaseException:  # refused (a ValueError) before anything was queued
            self.scheduler.not_launched(batch)
            raise
        self._launches += 1
        batch.launch = self._launches
        self.scheduler.launched(batch)

    def _abandon_inflight(self) -> None:
        """After a failed step (or on close): collect whatever is still queued so the backend starts clean."""
        self._inflight = None
        for _ in range(2):  # at most two queued; a failed collect has still dequeued its step
            try:
                self.runner.collect()
            except Exception:
                pass

    def stats(self) -> dict:
        t = self._timing
        copies = self.backend.copy_stats() if self.host_tier else {}
        return dict(vars(self.scheduler.stats()), block_size=self.config.kv_block_size,
                    steps=t["steps"], overlapped_steps=t["overlapped"], step_wall_seconds=t["wall_s"],
                    step_gpu_seconds=t["gpu_s"],
                    last_step_wall_ms=t["last_wall_ms"], last_step_gpu_ms=t["last_gpu_ms"],
                    # overlapped steps start on the GPU before the call that collects them: wall < GPU
                    # there means the host time was hidden entirely
                    last_step_host_ms=max(0.0, t["last_wall_ms"] - t["last_gpu_ms"]),
                    offloaded_bytes=copies.get("saved_bytes", 0), restored_bytes=copies.get("restored_bytes", 0),
                    restore_seconds=copies.get("restore_seconds", 0.0), spec_verify_seconds=t["verify_s"],
                    spec_draft_seconds=t["draft_s"])

    def _log_host_tier(self) -> None:
        """Every LOG_PERIOD_S while the tier is in use: its occupancy and traffic, in the engine log."""
        now = time.perf_counter()
        if now - self._tier_logged < self.LOG_PERIOD_S:
            return
        self._tier_logged = now
        s = self.stats()
        key = (s["offloaded_blocks"], s["restored_blocks"], s["prefix_cache_hit_tokens"])
        if key == self._tier_key:
            return
        self._tier_key = key
        gib, rs = 1 << 30, s["restore_seconds"]
        log.info("host KV tier: %d/%d blocks used; prompt tokens from the GPU prefix cache %d, restored from the host "
                 "%d; offloaded %.2f GiB, restored %.2f GiB at %.1f GB/s", s["host_tier_blocks_used"],
                 s["host_tier_blocks_total"], s["prefix_cache_hit_tokens"], s["host_hit_tokens"],
                 s["offloaded_bytes"] / gib, s["restored_bytes"] / gib, s["restored_bytes"] / rs / 1e9 if rs else 0.0)


# Up to this many ids, a prompt is converted and bounded with int(), min() and max(): NumPy's calls cost
# more than they save on a short prompt, on the path of its first token (75 us against 23 on the
# 2-vCPU VM, right after a step has filled the CPU's caches).
_SHORT_PROMPT = 256


class TokenIds(list):
    """Token ids that _prompt_ids has checked against a vocabulary of `vocab_size` (the server checks a
    request's ids once, on its event loop, instead of there and again in add_request)."""
    vocab_size = 0


def _prompt_ids(tokens: Seq[int], vocab_size: int) -> list[int]:
    """The prompt as Python ints, each in [0, vocab_size), else RequestRejected. NumPy converts and
    bounds long ones: 16k ids in 0.4 ms, against 0.8 for int() of each and min() and max()."""
    if type(tokens) is TokenIds and 0 < tokens.vocab_size <= vocab_size:
        return tokens
    a = None
    if len(tokens) > _SHORT_PROMPT:
        try:
            a = np.asarray(tokens)
        except ValueError:  # ragged nesting: int() below says what is wrong
            pass
    if a is not None and a.ndim == 1 and a.size and a.dtype.kind in "ib":
        ids, lo, hi = a.astype(np.int64, copy=False).tolist(), int(a.min()), int(a.max())
    else:  # floats, unsigned or past 64 bits, anything else: int() of each, as for any sequence
        ids = list(map(int, tokens))
        lo, hi = (min(ids), max(ids)) if ids else (0, 0)
    if lo < 0 or hi >= vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise RequestRejected(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
    ids = TokenIds(ids)
    ids.vocab_size = vocab_size
    return ids


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[Logprob] | None


class Engine:
    """Offline generation: `Engine(model_path, device="cpu").generate(["Hello"], SamplingParams(...))`.

    Options are the fields of EngineConfig."""

    _ids = itertools.count()

    def __init__(self, model_path: str, **options):
        self.llm_engine = LLMEngine(EngineConfig(model_path=model_path, **options))
        self.tokenizer = self.llm_engine.tokenizer
        self.default_params = default_params(self.llm_engine.config.model_files.generation_config)

    def close(self) -> None:
        """Releases the model's memory now (GPU weights, KV cache, graphs); `with Engine(...) as e:`
        does it on exit. The engine refuses work afterwards."""
        self.llm_engine.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Prompts: a string, a list of strings, a list of token ids, or a list of such lists.
        Returns one RequestOutput per prompt, in input order; all prompts batch together.
        Without sampling_params a prompt runs with `default_params`: what a /v1/completions request that
        sets nothing gets (the model's generation_config.json sampling, max_tokens 16)."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.default_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        outs: dict[str, RequestOutput] = {}
        order, pending = [], deque()
        for p, sp in zip(prompts, params):
            rid = f"generate-{next(self._ids)}"
            text, ids = (p, self.tokenizer.encode(p)) if isinstance(p, str) else (None, [int(t) for t in p])
            outs[rid] = RequestOutput(rid, text, ids, "", [], None, [] if sp.logprobs is not None else None)
            order.append(rid)
            pending.append((rid, ids, sp))
        eng = self.llm_engine
        try:
            while pending or eng.has_unfinished():
                while pending:  # a bounded waiting queue: feed it as room frees up
                    try:
                        eng.add_request(*pending[0])
                    except QueueFull:
                        break
                    pending.popleft()
                for u in eng.step():
                    o = outs[u.request_id]
                    o.token_ids += u.new_token_ids
                    o.text += u.new_text
                    if u.logprobs is not None:
                        o.logprobs += u.logprobs
                    if u.finished:
                        o.finish_reason = u.finish_reason
        except BaseException:
            for rid in order:  # leave the engine clean for the next call
                eng.abort_request(rid)
            raise
        return [outs[r] for r in order]


__all__ = ["LLMEngine", "Engine", "RequestOutput", "RequestUpdate", "RequestRejected", "QueueFull"]

"""Whole-model checks of the CUDA engine against Hugging Face transformers on the same random weights.

Needs a GPU, torch and transformers (the GPU machine has them). Checkpoints are written once with the
project's tool into $OPENINFER_TEST_CACHE (default: the temp dir). Figures go to
$OPENINFER_TEST_REPORT/model_report.json when that is set.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from gpu_util import rel_err, requires_gpu

from openinfer.step import StepInput

pytestmark = requires_gpu
torch = pytest.importorskip("torch", reason="GPU model tests compare against HF transformers (torch)")
transformers = pytest.importorskip("transformers")

CACHE = Path(os.environ.get("OPENINFER_TEST_CACHE", tempfile.gettempdir())) / "openinfer-ckpt"
REPORT: dict = {}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "你好，世界。今天的天气怎么样？",
    "List three prime numbers: 2, 3,",
]


def checkpoint(preset: str) -> Path:
    out = CACHE / preset
    if not (out / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "openinfer.tools.random_checkpoint", "--preset", preset, "--out",
                        str(out), "--seed", "0"], check=True)
    return out


def teardown_module(module):
    out = os.environ.get("OPENINFER_TEST_REPORT")
    if out and REPORT:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "model_report.json").write_text(json.dumps(REPORT, indent=1))


class Pair:
    """Our engine and HF (fp32 and bf16) on one checkpoint."""

    def __init__(self, preset: str):
        import openinfer
        from transformers import AutoModelForCausalLM

        self.dir = checkpoint(preset)
        self.hf32 = AutoModelForCausalLM.from_pretrained(self.dir, dtype=torch.float32).cuda().eval()
        self.hf16 = AutoModelForCausalLM.from_pretrained(self.dir, dtype=torch.bfloat16).cuda().eval()
        # the control: HF bf16 again with its other attention kernel (same weights, same math)
        self.hf16_eager = AutoModelForCausalLM.from_pretrained(self.dir, dtype=torch.bfloat16,
                                                               attn_implementation="eager").cuda().eval()
        self.engine = openinfer.Engine(str(self.dir), device="cuda", gpu_memory_utilization=0.6,
                                       max_model_len=4096, max_num_seqs=256)
        self.backend = self.engine.llm_engine.backend
        self.tok = self.engine.tokenizer
        self.prompts = [self.tok.encode(p) for p in PROMPTS]
        self.next_block = 1

    def close(self) -> None:
        """Frees the GPU now: a failed test's traceback can keep the pair referenced, and the next
        model's engine would then find the previous one's KV cache still allocated."""
        self.engine.close()
        self.hf32 = self.hf16 = self.hf16_eager = None

    def blocks(self, n_tokens: int) -> list[int]:
        n = -(-n_tokens // 16)
        assert self.next_block + n < self.backend.num_kv_blocks
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    @torch.inference_mode()
    def hf_logits(self, model, ids: list[int]) -> np.ndarray:
        x = torch.tensor([ids], device="cuda")
        return model(x).logits[0].float().cpu().numpy()

    def run(self, seqs: list[tuple[list[int], list[int], int]], sample_all: bool = True) -> list[np.ndarray]:
        """One step over several sequences: (all token ids, block ids, tokens already cached).
        Returns each sequence's logits for its new tokens."""
        ids, pos, qsl, ctx, slots, sample = [], [], [0], [], [], []
        M = max(len(b) for _, b, _ in seqs)
        bt = np.zeros((len(seqs), M), np.int32)
        for i, (toks, blocks, cached) in enumerate(seqs):
            new = range(cached, len(toks))
            start = len(ids)
            ids += [toks[p] for p in new]
            pos += list(new)
            slots += [blocks[p // 16] * 16 + p % 16 for p in new]
            bt[i, :len(blocks)] = blocks
            qsl.append(len(ids))
            ctx.append(len(toks))
            sample += list(range(start, len(ids))) if sample_all else [len(ids) - 1]
        S = len(sample)
        out = self.backend.step(StepInput(
            input_ids=np.array(ids, np.int32), positions=np.array(pos, np.int32),
            query_start_loc=np.array(qsl, np.int32), context_lens=np.array(ctx, np.int32), block_tables=bt,
            slot_mapping=np.array(slots, np.int32), sample_idx=np.array(sample, np.int32),
            temperature=np.zeros(S, np.float32), top_p=np.ones(S, np.float32), top_k=np.zeros(S, np.int32),
            seeds=np.zeros(S, np.uint64), return_logits=True))
        res, r = [], 0
        for i, (toks, _, cached) in enumerate(seqs):
            n = len(toks) - cached if sample_all else 1
            res.append(out.logits[r:r + n])
            r += n
        return res


PAIRS: dict[str, Pair] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_pairs():
    """The last pair is still resident when the module ends: close it (conftest then empties torch's cache
    and checks what the module left on the GPU)."""
    yield
    for p in list(PAIRS):
        PAIRS.pop(p).close()


@pytest.fixture(scope="module", params=["qwen3-0.6b", "qwen3-4b"])
def pair(request):
    if request.param not in PAIRS:
        for p in list(PAIRS):  # one model pair resident at a time
            PAIRS.pop(p).close()
        gc.collect()
        torch.cuda.empty_cache()
        PAIRS[request.param] = Pair(request.param)
    yield PAIRS[request.param]


def test_logits_match_hf(pair):
    ours, h16, h32 = [], [], []
    for ids in pair.prompts:
        ours.append(pair.run([(ids, pair.blocks(len(ids)), 0)])[0])
        h16.append(pair.hf_logits(pair.hf16, ids))
        h32.append(pair.hf_logits(pair.hf32, ids))
    ours, h16, h32 = (np.concatenate(a) for a in (ours, h16, h32))
    e_ours, e_hf = rel_err(ours, h32), rel_err(h16, h32)
    REPORT.setdefault(pair.dir.name, {})["logits_rel_err"] = {"openinfer_bf16": e_ours, "hf_bf16": e_hf,
                                                              "ratio": e_ours / e_hf, "positions": len(h32)}
    print(f"\n{pair.dir.name}: logits rel err vs HF fp32: ours {e_ours:.3e}, HF bf16 {e_hf:.3e}")
    assert e_ours <= 1.5 * e_hf, (e_ours, e_hf)


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """HF bf16 greedy continuation (no EOS stop) and its top-1/top-2 margin at each step."""
    out = model(torch.tensor([ids], device="cuda"), use_cache=True)
    toks, margins = [], []
    for _ in range(n):
        logits = out.logits[0, -1].float()
        top = torch.topk(logits, 2)
        toks.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        out = model(torch.tensor([[toks[-1]]], device="cuda"), past_key_values=out.past_key_values, use_cache=True)
    return toks, margins


def _agreement(got: list[list[int]], want: list[tuple[list[int], list[float]]]) -> tuple[int, list[dict]]:
    same, details = 0, []
    for toks, (ref, margins) in zip(got, want):
        if toks == ref:
            same += 1
            details.append({"identical": True, "min_hf_margin": min(margins)})
        else:
            k = next(i for i, (a, b) in enumerate(zip(toks, ref)) if a != b)
            details.append({"identical": False, "diverged_at_step": k, "hf_top1_top2_margin": margins[k],
                            "got": toks[k], "hf": ref[k]})
    return same, details


GREEDY: dict = {}


def _greedy(pair) -> dict:
    """64-token greedy continuations: ours, HF bf16 (sdpa, the reference) and HF bf16 with eager attention."""
    if pair.dir.name not in GREEDY:
        from openinfer import SamplingParams

        n = 64
        outs = pair.engine.generate(pair.prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        assert all(len(o.token_ids) == n and o.finish_reason == "length" for o in outs)
        ref = [hf_greedy(pair.hf16, ids, n) for ids in pair.prompts]
        ctl = [hf_greedy(pair.hf16_eager, ids, n)[0] for ids in pair.prompts]
        ours_same, ours_d = _agreement([o.token_ids for o in outs], ref)
        ctl_same, ctl_d = _agreement(ctl, ref)
        GREEDY[pair.dir.name] = r = {"openinfer_identical": ours_same, "hf_eager_identical": ctl_same,
                                     "of": len(outs), "openinfer": ours_d, "hf_eager": ctl_d}
        REPORT.setdefault(pair.dir.name, {})["greedy_64"] = r
        print(f"\n{pair.dir.name}: greedy 64 identical to HF bf16: openinfer {ours_same}/{len(outs)}, "
              f"HF bf16 eager-attention {ctl_same}/{len(outs)}; {ours_d}")
    return GREEDY[pair.dir.name]


def test_greedy_diverges_from_hf_only_at_near_ties(pair):
    """Random weights give top-2 margins at bf16 resolution, so rounding decides some argmaxes: HF bf16
    disagrees with itself across attention kernels too (reported as the control). A real bug shows as a
    divergence where HF's top-1 leads clearly; every divergence must sit on a near-tie of HF's own logits
    (<= 4 bf16 ulps of a logit near 10)."""
    r = _greedy(pair)
    for d in r["openinfer"]:
        assert d["identical"] or d["hf_top1_top2_margin"] <= 0.25, d


@pytest.mark.xfail(reason="random-weight logits have top-2 margins at bf16 resolution, so 64-token identity "
                          "fails for HF bf16 against itself too (the control: 1-2 of 5)", strict=False)
def test_greedy_identical_to_hf_bf16_for_4_of_5(pair):
    assert _greedy(pair)["openinfer_identical"] >= 4


@torch.inference_mode()
def test_tap_layers_match_hf_hidden_states(pair):
    """StepInput.tap_layers: the residual stream after layer l (HF's hidden_states[l + 1]; the last one
    HF returns is after the final norm, so layers up to L - 2), at every token of a prompt, within 1.5x
    HF bf16's own error against HF fp32."""
    ids = pair.prompts[2]
    L = pair.engine.llm_engine.model_config.num_hidden_layers
    taps = [1, L // 2, L - 2]
    blocks = pair.blocks(len(ids))
    n = len(ids)
    pos = np.arange(n, dtype=np.int32)
    out = pair.backend.step(StepInput(
        input_ids=np.array(ids, np.int32), positions=pos, query_start_loc=np.array([0, n], np.int32),
        context_lens=np.array([n], np.int32), block_tables=np.array([blocks], np.int32),
        slot_mapping=(np.array(blocks)[pos // 16] * 16 + pos % 16).astype(np.int32),
        sample_idx=np.array([n - 1], np.int32), temperature=np.zeros(1, np.float32), top_p=np.ones(1, np.float32),
        top_k=np.zeros(1, np.int32), seeds=np.zeros(1, np.uint64), tap_layers=np.array(taps, np.int32),
        tap_rows=np.arange(n, dtype=np.int32)))
    x = torch.tensor([ids], device="cuda")
    h32 = pair.hf32(x, output_hidden_states=True).hidden_states
    h16 = pair.hf16(x, output_hidden_states=True).hidden_states
    errs = {}
    for k, l in enumerate(taps):
        want, hf = h32[l + 1][0].float().cpu().numpy(), h16[l + 1][0].float().cpu().numpy()
        errs[l] = (rel_err(out.hidden[:, k], want), rel_err(hf, want))
    REPORT.setdefault(pair.dir.name, {})["tap_layers_rel_err"] = {str(l): e for l, e in errs.items()}
    for l, (ours, hf) in errs.items():
        assert ours <= 1.5 * hf, (l, ours, hf)


def test_chunked_prefill_equals_one_shot(pair):
    ids = pair.prompts[2] * 4  # ~80 tokens, crosses several block edges
    h32 = pair.hf_logits(pair.hf32, ids)[-1]
    h16 = pair.hf_logits(pair.hf16, ids)[-1]
    one = pair.run([(ids, pair.blocks(len(ids)), 0)], sample_all=False)[0][0]
    blocks, done, last = pair.blocks(len(ids)), 0, None
    for size in (1, 7, 16, 17, 5, 1000):
        end = min(len(ids), done + size)
        last = pair.run([(ids[:end], blocks, done)], sample_all=False)[0][0]
        done = end
        if done == len(ids):
            break
    e_hf, e_one, e_chunk = rel_err(h16, h32), rel_err(one, h32), rel_err(last, h32)
    REPORT.setdefault(pair.dir.name, {})["chunked_prefill"] = {"one_shot": e_one, "chunked": e_chunk, "hf_bf16": e_hf}
    assert e_one <= 1.5 * e_hf and e_chunk <= 1.5 * e_hf, (e_one, e_chunk, e_hf)
    assert rel_err(last, one) <= 1.5 * e_hf


def test_batch_equals_each_alone(pair):
    """A step with one prefill and two decodes gives each sequence what it gets alone."""
    a, b, c = pair.prompts[0], pair.prompts[1], pair.prompts[2]
    alone = []
    for ids in (a, b, c):
        alone.append(pair.run([(ids, pair.blocks(len(ids)), 0)], sample_all=False)[0][0])
    # b and c: prefill all but the last token first, then decode it inside the batch
    bb, cb = pair.blocks(len(b)), pair.blocks(len(c))
    pair.run([(b[:-1], bb, 0), (c[:-1], cb, 0)], sample_all=False)
    batched = pair.run([(a, pair.blocks(len(a)), 0), (b, bb, len(b) - 1), (c, cb, len(c) - 1)], sample_all=False)
    errs = [rel_err(x[0], y) for x, y in zip(batched, alone)]
    scale = rel_err(pair.hf_logits(pair.hf16, a)[-1], pair.hf_logits(pair.hf32, a)[-1])
    margins = [float(np.diff(np.sort(y)[-2:])[0]) for y in alone]  # top-1 minus top-2 of each alone run
    REPORT.setdefault(pair.dir.name, {})["batch_vs_alone"] = {"rel_err": errs, "hf_bf16_scale": scale,
                                                               "alone_top1_top2_margin": margins}
    assert max(errs) <= 1.5 * scale, (errs, scale)
    # The GEMMs see other row counts in the batch (cuBLASLt may pick another algorithm), so the logits
    # differ at bf16 noise (bounded above); the argmax may then flip only on a near-tie, with the same
    # bound as the greedy test (<= 4 bf16 ulps of a logit near 10).
    for x, y, m in zip(batched, alone, margins):
        assert int(x[0].argmax()) == int(y.argmax()) or m <= 0.25, (int(x[0].argmax()), int(y.argmax()), m)

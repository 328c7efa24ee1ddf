"""Shared CPU fixtures: one tiny random checkpoint per session (real vocab, 4 layers)."""
from __future__ import annotations

import gc
import os
import sys
import time

import numpy as np
import pytest

from openinfer.config import ModelConfig
from openinfer.loader import load_weights_fp32
from openinfer.reference import ReferenceBackend
from openinfer.step import StepInput
from openinfer.tokenizer import Tokenizer
from openinfer.tools.random_checkpoint import hf_config, write_checkpoint

from cli_util import command_env


# A CUDA context (torch's, once the HF comparisons have run) stays for the process; a model does not.
GPU_MODULE_SLACK_BYTES = 1 << 30


def pytest_runtest_logreport(report):
    """OPENINFER_TEST_TIMES=FILE: each phase of each test appended as it ends (seconds, phase, outcome, id), so
    a run that a time limit kills still says where its time went (--durations prints only at the end)."""
    path = os.environ.get("OPENINFER_TEST_TIMES")
    if path:
        with open(path, "a") as f:
            f.write(f"{report.duration:.2f}\t{report.when}\t{report.outcome}\t{report.nodeid}\n")


@pytest.fixture(scope="module", autouse=True)
def _gpu_module_frees_what_it_took(request):
    """The GPU suite runs in one process: a module that leaves an engine (or torch's cache) resident fails
    here, at its own end, instead of starving every module after it of memory."""
    from gpu_util import NO_GPU, device_used_bytes
    if NO_GPU is not None or request.node.get_closest_marker("gpu") is None:
        yield
        return
    before = device_used_bytes()
    yield
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    left = device_used_bytes() - before
    assert left < GPU_MODULE_SLACK_BYTES, f"{request.node.name} left {left / (1 << 30):.2f} GiB in use on the GPU"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    t0 = time.perf_counter()
    write_checkpoint(out, hf_config("tiny"), seed=0)
    print(f"\ntiny checkpoint written in {time.perf_counter() - t0:.2f} s")
    return out


@pytest.fixture(scope="session")
def cli_env(tmp_path_factory) -> dict:
    """The environment the package's commands run in (tests/cli_util.py)."""
    return command_env(tmp_path_factory.mktemp("bin"))


@pytest.fixture(scope="session")
def tiny_cfg(tiny_dir) -> ModelConfig:
    return ModelConfig.from_model_dir(tiny_dir)


@pytest.fixture(scope="session")
def tiny_weights(tiny_dir, tiny_cfg) -> dict[str, np.ndarray]:
    return load_weights_fp32(tiny_dir, tiny_cfg, progress=False)


@pytest.fixture(scope="session")
def tokenizer(tiny_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_dir)


@pytest.fixture
def make_backend(tiny_cfg, tiny_weights):
    def make(num_blocks: int = 64, **kw) -> ReferenceBackend:
        return ReferenceBackend(tiny_cfg, tiny_weights, num_blocks=num_blocks, block_size=16, **kw)
    return make


def step_input(seqs, block_size=16, temperature=0.0, top_p=1.0, top_k=0, seed=0, sample=None, **fields) -> StepInput:
    """A StepInput for sequences given as (token_ids_of_this_step, start_pos, block_table); `fields` set
    the rest (num_logprobs, return_logits, ...). Every sequence samples at its last token unless
    `sample` (a list of bools) says otherwise."""
    ids, pos, qsl, slots, ctx = [], [], [0], [], []
    width = max(len(t) for _, _, t in seqs)
    tables = np.zeros((len(seqs), width), dtype=np.int32)
    for b, (toks, start, table) in enumerate(seqs):
        p = np.arange(start, start + len(toks))
        ids += list(toks)
        pos += list(p)
        slots += [table[q // block_size] * block_size + q % block_size for q in p]
        qsl.append(qsl[-1] + len(toks))
        ctx.append(start + len(toks))
        tables[b, :len(table)] = table
    sample = [True] * len(seqs) if sample is None else sample
    sidx = np.array([qsl[b + 1] - 1 for b in range(len(seqs)) if sample[b]], dtype=np.int32)
    S = len(sidx)
    return StepInput(input_ids=np.array(ids, np.int32), positions=np.array(pos, np.int32),
                     query_start_loc=np.array(qsl, np.int32), context_lens=np.array(ctx, np.int32),
                     block_tables=tables, slot_mapping=np.array(slots, np.int32), sample_idx=sidx,
                     temperature=np.full(S, temperature, np.float32), top_p=np.full(S, top_p, np.float32),
                     top_k=np.full(S, top_k, np.int32), seeds=np.full(S, seed, np.uint64), **fields)

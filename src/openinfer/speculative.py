"""Speculative decoding's policy side: what a drafter is to the scheduler, and a drafter for tests and
benchmarks. Each round, a speculating sequence's verify step runs the target over [anchor, d1..dk] with
every row sampled (`StepInput.verify`); the backend counts, on the device, how many rows' tokens the
drafts predicted (`StepOutput.accepted`), and the scheduler keeps those tokens and rolls the rest back.

Lossless by construction: a row's sample depends only on the request's seed, the row's position and the
target's logits there (docs/architecture.md, "Sampling"), so every token kept is the one plain decoding
would have sampled at that position, greedy or not, whatever the drafter proposed.
"""
from __future__ import annotations

from typing import Protocol, Sequence as Seq

from .sampling_params import SamplingParams


class Drafter(Protocol):
    num_tokens: int  # k: proposals per round at most
    in_backend: bool  # True: the backend drafts during the step (StepInput.draft -> StepOutput.drafts)
    lookahead: int  # positions past a drafting step's tokens whose blocks the backend's drafting writes (0: none)

    def serves(self, params: SamplingParams) -> bool:
        """Whether a request with these parameters speculates (the others run plainly beside it)."""
        ...

    def propose(self, seq) -> Seq[int]:
        """Up to num_tokens proposals for the tokens after seq.token_ids (a scheduler Sequence); only
        when not in_backend."""
        ...


class BackendDrafter:
    """The backend's DFlash / DSpark drafter (openinfer.drafter): it drafts inside each step, from the
    target's tap layers, and the scheduler reads the proposals from the step's output."""

    in_backend = True

    def __init__(self, num_tokens: int, block_size: int):
        self.num_tokens = num_tokens
        # the CUDA engine writes the block's K/V at positions p .. p + block_size - 1 (p <= the step's
        # context length) into the drafter's pool: those blocks must exist
        self.lookahead = block_size

    def serves(self, params: SamplingParams) -> bool:
        return params.logprobs is None

    def propose(self, seq):
        raise AssertionError("a backend drafter's proposals come with the step's output")


class ReplayDrafter:
    """Proposes a recorded continuation of each prompt (the target's own plain output, recorded first): a
    test drafter whose proposals the target accepts except where its own numerics differ between the
    plain and the verify step (near-ties). With `accept` = tau, only the first tau - 1 proposals of a round
    are the recording and the rest are wrong, so each round keeps tau tokens: a controlled acceptance."""

    in_backend = False
    lookahead = 0

    def __init__(self, recordings: dict[tuple[int, ...], Seq[int]], num_tokens: int, vocab_size: int,
                 accept: int | None = None):
        if num_tokens < 1 or (accept is not None and not 1 <= accept <= num_tokens + 1):
            raise ValueError("num_tokens must be >= 1 and accept in [1, num_tokens + 1]")
        self.book = {tuple(k): list(v) for k, v in recordings.items()}
        self.num_tokens, self.vocab_size, self.accept = num_tokens, vocab_size, accept

    def serves(self, params: SamplingParams) -> bool:
        return params.logprobs is None

    def propose(self, seq) -> list[int]:
        rec = self.book.get(tuple(seq.prompt_token_ids), [])
        i = len(seq.token_ids) - seq.num_prompt
        out = rec[i:i + self.num_tokens]
        if self.accept is not None:  # right up to tau - 1, then wrong
            out = out[:self.accept - 1] + [(t + 1) % self.vocab_size for t in out[self.accept - 1:]]
        return out

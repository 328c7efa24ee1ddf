"""Per-request sampling options, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_TEMPERATURE = 1e4
GREEDY_BELOW = 1e-5
MIN_TOP_P = 1e-6
MAX_STOP_TOKEN_IDS = 1024


@dataclass
class SamplingParams:
    max_tokens: int | None = None  # None: generate up to max_model_len
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # <= 0: off
    seed: int | None = None  # None: the engine draws one from its own seeded generator
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; N: plus the top N
    skip_special_tokens: bool = True

    def __post_init__(self):
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive int or None, got {self.max_tokens!r}")
        if not _is_num(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if self.temperature < GREEDY_BELOW:  # 1/temperature would overflow float32: it is greedy anyway
            self.temperature = 0.0
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        # Below 1/vocabulary a nucleus holds only the top token; far below it the value would round to
        # 0 in float32 on its way to the device, which refuses it (failing the whole step).
        self.top_p = max(self.top_p, MIN_TOP_P)
        if not _is_int(self.top_k):
            raise ValueError(f"top_k must be an int (<= 0 disables it), got {self.top_k!r}")
        if self.top_k <= 0 or self.top_k >= 2**31:  # off; a k beyond any vocabulary keeps everything too
            self.top_k = 0
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an int in [0, 2**64) or None, got {self.seed!r}")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:  # each is checked per generated token
            raise ValueError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, "
                             f"got {len(self.stop_token_ids)}")
        self.stop_token_set = frozenset(self.stop_token_ids)  # what the scheduler tests each token against
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # rejects NaN

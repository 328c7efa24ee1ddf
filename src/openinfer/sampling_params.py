"""Per-request sampling options and every rule they must meet.

The rules live here alone. The Python API raises `InvalidRequest` from `SamplingParams(...)` as it
is; the HTTP server builds a `SamplingParams` from the request body and answers an `InvalidRequest`
with an OpenAI-style 400 naming the parameter. So a value gets the same verdict through both
(tests/test_validation.py). Where OpenAI and vLLM differ, or the engine needs more:

- max_tokens: a positive int, or None (up to max_model_len).
- temperature: a number in [0, 2] (OpenAI's range); below 1e-5 it is 0 (greedy).
- top_p: a number in (0, 1]; below 1e-6 it is 1e-6 (still the top token alone).
- top_k: an int >= -1; -1 and 0 are off (vLLM's rule: below -1 is refused), and so is a k past any
  vocabulary.
- seed: an int in [-2**63, 2**64), or None (the engine draws one). OpenAI's seed is an int64 and the
  engine's a uint64: a negative seed is the uint64 of the same bits (seed + 2**64), so -1 and
  2**64 - 1 draw alike.
- stop: a string, or a list (or tuple) of at most 16 strings. Empty strings are dropped: one would
  stop before any text.
- stop_token_ids: a list of at most 1024 non-negative ints (each is checked per generated token).
- ignore_eos, skip_special_tokens: booleans.
- logprobs: None, or an int in [0, 20] (0: the sampled token's alone).

A boolean is not a number here (True is not 1) and NaN is no number. None is a field's default, as
a JSON null is an omitted field (OpenAI's fields are nullable).
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

MAX_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
GREEDY_BELOW = 1e-5
MIN_TOP_P = 1e-6
MAX_STOP = 16
MAX_STOP_TOKEN_IDS = 1024


class InvalidRequest(ValueError):
    """A request parameter that breaks its rule; `param` names it."""

    def __init__(self, param: str, rule: str, value: Any):
        super().__init__(f"'{param}' must be {rule}, got {value!r}"[:300])
        self.param, self.rule, self.value = param, rule, value

    def renamed(self, param: str) -> "InvalidRequest":
        """The same error under the name a client used for the parameter."""
        return InvalidRequest(param, self.rule, self.value)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def _max_tokens(v):
    if v is None or (_is_int(v) and v >= 1):
        return v
    raise InvalidRequest("max_tokens", "a positive integer", v)


def _temperature(v):
    if not _is_num(v) or not 0 <= v <= MAX_TEMPERATURE:
        raise InvalidRequest("temperature", f"a number in [0, {MAX_TEMPERATURE:g}]", v)
    return 0.0 if v < GREEDY_BELOW else float(v)  # 1/temperature would overflow float32: greedy anyway


def _top_p(v):
    if not _is_num(v) or not 0 < v <= 1:
        raise InvalidRequest("top_p", "a number in (0, 1]", v)
    # Below 1/vocabulary a nucleus holds only the top token; far below it the value would round to 0
    # in float32 on its way to the device, which refuses it (failing the whole step).
    return max(float(v), MIN_TOP_P)


def _top_k(v):
    if not _is_int(v) or v < -1:
        raise InvalidRequest("top_k", "an integer >= -1 (-1 or 0: off)", v)
    return 0 if v <= 0 or v >= 2**31 else v  # a k beyond any vocabulary keeps everything: off


def _seed(v):
    if v is None:
        return None
    if not _is_int(v) or not -2**63 <= v < 2**64:
        raise InvalidRequest("seed", "an integer in [-2**63, 2**64)", v)
    return v % 2**64


def _stop(v):
    stops = [] if v is None else [v] if isinstance(v, str) else v
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise InvalidRequest("stop", "a string or a list of strings", v)
    stops = [s for s in stops if s]
    if len(stops) > MAX_STOP:
        raise InvalidRequest("stop", f"a list of at most {MAX_STOP} strings", v)
    return stops


def _stop_token_ids(v):
    ok = isinstance(v, (list, tuple)) and len(v) <= MAX_STOP_TOKEN_IDS and all(_is_int(t) and t >= 0 for t in v)
    if not ok:
        raise InvalidRequest("stop_token_ids", f"a list of at most {MAX_STOP_TOKEN_IDS} non-negative integers", v)
    return list(v)


def _boolean(name):
    def check(v):
        if not isinstance(v, bool):
            raise InvalidRequest(name, "a boolean", v)
        return v
    return check


def _logprobs(v):
    if v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS):
        return v
    raise InvalidRequest("logprobs", f"an integer in [0, {MAX_LOGPROBS}]", v)


# field -> its rule: the value as the engine takes it, or InvalidRequest
RULES = {"max_tokens": _max_tokens, "temperature": _temperature, "top_p": _top_p, "top_k": _top_k,
         "seed": _seed, "stop": _stop, "stop_token_ids": _stop_token_ids,
         "ignore_eos": _boolean("ignore_eos"), "logprobs": _logprobs,
         "skip_special_tokens": _boolean("skip_special_tokens")}


@dataclass
class SamplingParams:
    max_tokens: int | None = None  # None: generate up to max_model_len
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # -1 or 0: off
    seed: int | None = None  # None: the engine draws one from its own seeded generator
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; N: plus the top N
    skip_special_tokens: bool = True

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:  # the default, as a JSON null is an omitted field
                v = f.default_factory() if f.default is MISSING else f.default
            setattr(self, f.name, RULES[f.name](v))
        self.stop_token_set = frozenset(self.stop_token_ids)  # what the scheduler tests each token against

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


COMPLETION_MAX_TOKENS = 16  # OpenAI's /v1/completions default


def sampling_defaults(generation_config: dict) -> dict:
    """temperature/top_p/top_k a request gets when it leaves them out: the model's own
    generation_config.json (Qwen3: 0.6 / 0.95 / 20), as the releases intend; values that break
    the rules above are ignored."""
    out = {}
    for k in ("temperature", "top_p", "top_k"):
        if k in generation_config:
            try:
                RULES[k](generation_config[k])
            except InvalidRequest:
                continue
            out[k] = generation_config[k]
    if generation_config.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def default_params(generation_config: dict) -> SamplingParams:
    """What `Engine.generate` runs a prompt with when given no SamplingParams: what a /v1/completions
    request that sets nothing gets (the model's sampling defaults, COMPLETION_MAX_TOKENS)."""
    return SamplingParams(max_tokens=COMPLETION_MAX_TOKENS, **sampling_defaults(generation_config))


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The parameters of n choices of one request: with a seed, choice j > 0 samples with its own seed
    derived from it (the same seed would repeat choice 0); without one the engine draws each its own."""
    if params.seed is None:
        return [params] * n
    return [params] + [replace(params, seed=(params.seed + j * 0x9E3779B97F4A7C15) % 2**64)
                       for j in range(1, n)]

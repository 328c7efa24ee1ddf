"""Property-based tests (hypothesis): sampling parameters agree with their documented rules
(sampling_params.py's docstring, restated below as an independent oracle); any JSON body gets a 2xx
or an OpenAI-style 4xx, never a 5xx; the tokenizer's length bound and piecewise encoding hold for any
text."""

import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openinfer import EngineConfig, LLMEngine
from openinfer import tokenizer as tokenizer_mod
from openinfer.sampling_params import InvalidRequest, SamplingParams
from test_server_harness import RunningServer

# ----------------------------------------------------------------------------- sampling parameters

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=5))
values = st.one_of(scalars, st.lists(scalars, max_size=20), st.tuples(scalars, scalars),
                   st.lists(st.text(max_size=3), max_size=20), st.lists(st.integers(-3, 10**6), max_size=1100))


def _int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v):
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and not (isinstance(v, float) and math.isnan(v))


def _stops_ok(v):
    if v is None or isinstance(v, str):
        return True
    return isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v) and len([s for s in v if s]) <= 16


# the documented rule of each field: is v accepted? (None is the field's default and always is)
DOCUMENTED = {
    "max_tokens": lambda v: v is None or (_int(v) and v >= 1),
    "temperature": lambda v: v is None or (_num(v) and 0 <= v <= 2),
    "top_p": lambda v: v is None or (_num(v) and 0 < v <= 1),
    "top_k": lambda v: v is None or (_int(v) and v >= -1),
    "seed": lambda v: v is None or (_int(v) and -2**63 <= v < 2**64),
    "stop": _stops_ok,
    "stop_token_ids": lambda v: v is None or (isinstance(v, (list, tuple)) and len(v) <= 1024
                                              and all(_int(t) and t >= 0 for t in v)),
    "ignore_eos": lambda v: v is None or isinstance(v, bool),
    "skip_special_tokens": lambda v: v is None or isinstance(v, bool),
    "logprobs": lambda v: v is None or (_int(v) and 0 <= v <= 20),
}


@settings(max_examples=600, deadline=None)
@given(name=st.sampled_from(sorted(DOCUMENTED)), v=values)
def test_sampling_params_follow_their_documented_rules(name, v):
    try:
        p = SamplingParams(**{name: v})
    except InvalidRequest as e:
        assert not DOCUMENTED[name](v), (name, v)
        assert e.param == name and name in str(e)
        return
    assert DOCUMENTED[name](v), (name, v)
    got = getattr(p, name)
    if name == "temperature" and v is not None:
        assert got == (0.0 if v < 1e-5 else float(v))
    elif name == "top_p" and v is not None:
        assert 1e-6 <= got <= 1 and (got == float(v) or v < 1e-6)
    elif name == "top_k" and v is not None:
        assert got == (0 if v <= 0 or v >= 2**31 else v)
    elif name == "seed" and v is not None:
        assert 0 <= got < 2**64 and got % 2**64 == v % 2**64
    elif name == "stop":
        assert all(got) and len(got) <= 16


# ----------------------------------------------------------------------------- tokenizer


@settings(max_examples=300, deadline=None)
@given(text=st.text(st.characters(codec="utf-8"), max_size=300)
       | st.lists(st.sampled_from(["word", " ", "  ", "\n", "réseau", "数据", "한", "e\u0301", "\u1100\u1161",
                                   "<|im_start|>", "'s", "42", "!!", "\t"]), max_size=200).map("".join))
def test_min_tokens_bounds_and_pieces_keep_the_tokens(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.min_tokens(text) <= len(ids)
    # the long-text path (pieces cut between a letter and " " + a letter), forced onto short texts
    old = tokenizer_mod._RELEASE_GIL_CHARS, tokenizer_mod._PIECE_CHARS
    tokenizer_mod._RELEASE_GIL_CHARS, tokenizer_mod._PIECE_CHARS = 0, 7
    try:
        assert tokenizer.encode(text) == ids
        if ids:
            with pytest.raises(tokenizer_mod.TooManyTokens) as e:
                tokenizer.encode(text, cap=len(ids) - 1)
            assert len(ids) - 1 < e.value.n <= len(ids)
    finally:
        tokenizer_mod._RELEASE_GIL_CHARS, tokenizer_mod._PIECE_CHARS = old


# ----------------------------------------------------------------------------- request bodies


@pytest.fixture(scope="module")
def server(tiny_dir):
    # max_model_len 24: whatever a body asks, a generation is short
    engine = LLMEngine(EngineConfig(str(tiny_dir), device="cpu", num_kv_blocks=64, max_model_len=24, max_waiting=16))
    srv = RunningServer(engine, served_model_name="m")
    yield srv
    srv.stop()


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**66, 2**66) | st.floats(allow_nan=False, allow_infinity=False)
                           | st.text(max_size=8), lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.text(max_size=6), kids, max_size=4), max_leaves=12)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "n", "seed", "stop", "stream", "stream_options", "logprobs", "top_logprobs", "ignore_eos", "tools",
          "tool_choice", "stop_token_ids", "skip_special_tokens", "chat_template_kwargs", "echo", "best_of"]
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                           "content": st.text(max_size=10) | json_values}), max_size=3)
field_values = {"prompt": st.text(max_size=12) | st.lists(st.integers(-2, 200000), max_size=5) | json_values,
                "messages": messages | json_values, "model": st.just("m") | json_values}
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6).flatmap(
    lambda d: st.fixed_dictionaries({k: field_values.get(k, st.just(v)) for k, v in d.items()})) | json_values


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]), body=bodies)
def test_any_json_body_is_answered_2xx_or_an_openai_4xx(server, path, body):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["type"] == "invalid_request_error"

"""One verdict per value: every sampling parameter goes through the same rules (sampling_params.py)
whether it comes as `SamplingParams(...)` or in an HTTP request body, and a refusal names the
parameter both ways (InvalidRequest.param, the 400's error.param)."""

import httpx
import pytest

from openinfer import EngineConfig, LLMEngine
from openinfer.sampling_params import InvalidRequest, SamplingParams
from test_server_harness import RunningServer

CASES = [  # (parameter, value): bad values and the edges around them
    ("max_tokens", 1), ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.0), ("max_tokens", True),
    ("max_tokens", "4"), ("max_tokens", None),
    ("temperature", 0), ("temperature", 2), ("temperature", 2.0001), ("temperature", -0.1),
    ("temperature", 1e-30), ("temperature", True), ("temperature", "1"), ("temperature", None),
    ("top_p", 1), ("top_p", 0), ("top_p", 1e-300), ("top_p", 1.01), ("top_p", -0.5), ("top_p", False),
    ("top_k", -1), ("top_k", 0), ("top_k", -2), ("top_k", -5), ("top_k", 2**63), ("top_k", 1.0),
    ("top_k", True), ("top_k", None),
    ("seed", 0), ("seed", -1), ("seed", -2**63), ("seed", -2**63 - 1), ("seed", 2**64 - 1), ("seed", 2**64),
    ("seed", 1.5), ("seed", True), ("seed", "1"), ("seed", None),
    ("stop", "a"), ("stop", ""), ("stop", []), ("stop", [""]), ("stop", ["a", ""]), ("stop", 5),
    ("stop", ["a", 1]), ("stop", {"a": 1}), ("stop", ["a"] * 16), ("stop", ["a"] * 17),
    ("stop", ["a"] * 16 + [""]), ("stop", None),
    ("stop_token_ids", []), ("stop_token_ids", [0]), ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]),
    ("stop_token_ids", [True]), ("stop_token_ids", "1"), ("stop_token_ids", 5),
    ("stop_token_ids", [7] * 1024), ("stop_token_ids", [7] * 1025), ("stop_token_ids", None),
    ("ignore_eos", True), ("ignore_eos", 0), ("ignore_eos", "no"), ("ignore_eos", None),
    ("skip_special_tokens", False), ("skip_special_tokens", 1), ("skip_special_tokens", None),
    ("logprobs", 0), ("logprobs", 20), ("logprobs", 21), ("logprobs", -1), ("logprobs", True),
    ("logprobs", 1.0), ("logprobs", None),
]
# chat's names for two of them: the same rule, the refusal under the client's name
CHAT_ALIASES = {"max_tokens": "max_completion_tokens", "logprobs": "top_logprobs"}


def _ids(cases):
    return [f"{k}={v!r}"[:40] for k, v in cases]


@pytest.fixture(scope="module")
def server(tiny_dir):
    engine = LLMEngine(EngineConfig(tiny_dir, device="cpu", max_model_len=256, num_kv_blocks=64))
    srv = RunningServer(engine, served_model_name="tiny")
    yield srv
    srv.stop()


def api_verdict(param, value):
    """None: accepted; else the parameter the refusal names."""
    try:
        SamplingParams(**{param: value})
    except InvalidRequest as e:
        return e.param
    return None


def http_verdict(server, path, body):
    r = httpx.post(server.url + path, json=body, timeout=60)
    if r.status_code == 200:
        return None
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    return err["param"]


@pytest.mark.parametrize("param,value", CASES, ids=_ids(CASES))
def test_same_verdict_through_the_api_and_the_server(server, param, value):
    body = {"prompt": "hi", "max_tokens": 1, param: value}
    assert api_verdict(param, value) in (None, param)
    assert http_verdict(server, "/v1/completions", body) == api_verdict(param, value)


ALIASED = [(p, v) for p, v in CASES if p in CHAT_ALIASES]


@pytest.mark.parametrize("param,value", ALIASED, ids=_ids(ALIASED))
def test_chat_names_get_the_same_verdict(server, param, value):
    name = CHAT_ALIASES[param]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True, name: value}
    want = api_verdict(param, value)
    assert http_verdict(server, "/v1/chat/completions", body) == (want and name)


def test_normalised_values():
    """What the engine gets for the edge values the table accepts."""
    p = SamplingParams(top_k=-1, seed=-1, stop=["", "a"], temperature=1e-30, top_p=1e-300)
    assert (p.top_k, p.seed, p.stop, p.temperature, p.top_p) == (0, 2**64 - 1, ["a"], 0.0, 1e-6)
    assert SamplingParams(seed=-2**63).seed == 2**63
    assert SamplingParams(top_k=None, stop_token_ids=None) == SamplingParams()
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(stop=5)  # was a TypeError
    assert e.value.param == "stop" and isinstance(e.value, ValueError)

"""Request validation units (the HTTP-level table lives in test_server.py)."""

import pytest

from openinfer.sampling_params import sampling_defaults
from openinfer.server.protocol import APIError, parse_chat, parse_completion

QWEN_GEN = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}


def test_generation_config_supplies_defaults_not_overrides():
    d = sampling_defaults(QWEN_GEN)
    assert d == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    g = parse_completion({"prompt": "x"}, d).gen
    s = g.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (0.6, 0.95, 20, 16)
    g = parse_chat({"messages": [{"role": "user", "content": "x"}], "temperature": 0,
                    "top_k": -1}, d).gen
    s = g.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (0.0, 0.95, 0, None)
    assert sampling_defaults({"do_sample": False, "temperature": "hot"}) == {"temperature": 0.0}


def test_chat_fields():
    r = parse_chat({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5,
                    "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 3, "seed": -1,
                    "stop": "END", "tools": [{"type": "function", "function": {"name": "f"}}],
                    "tool_choice": {"type": "function", "function": {"name": "f"}},
                    "chat_template_kwargs": {"enable_thinking": False}})
    s = r.gen.sampling
    assert (s.max_tokens, s.logprobs, s.seed, s.stop) == (7, 3, 2**64 - 1, ["END"])
    assert r.named_tool == "f" and r.enable_thinking is False and r.tool_choice["type"] == "function"
    assert parse_chat({"messages": [{"role": "user", "content": "x"}]}).tool_choice == "none"


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "frequency_penalty": 0.1}, "frequency_penalty"),
    ({"prompt": "x", "temperature": float("nan")}, "temperature"),
    ({"prompt": "x", "temperature": float("inf")}, "temperature"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
    ({"prompt": ["a"] * 65}, "prompt"),
    ({"prompt": [[1], "a"]}, "prompt"),
    ({"prompt": "x", "presence_penalty": False}, "presence_penalty"),  # a boolean is not the number 0
    ({"prompt": "x", "repetition_penalty": True}, "repetition_penalty"),
    ({"prompt": "x", "echo": 0}, "echo"),
])
def test_rejections_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        parse_completion(body)
    assert e.value.status == 400 and e.value.param == param


def test_built_once_encoders_write_as_json_dumps():
    """SSE events and non-streamed answers: the same bytes as json.dumps per call would write."""
    import json

    from starlette.responses import JSONResponse

    from openinfer.server.routes import _RENDER
    from openinfer.server.sse import event
    for obj in ({"id": "cmpl-1", "choices": [{"index": 0, "text": " Paris é 数 😀 \u2028", "logprobs": None}]},
                {"a": [1, 2.5, True, None, "x\n\"y\""], "b": {}}, []):
        assert event(obj) == f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
        assert _RENDER(obj).encode() == JSONResponse(obj).body
    with pytest.raises(ValueError):
        _RENDER({"x": float("nan")})

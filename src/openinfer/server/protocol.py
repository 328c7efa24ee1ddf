"""OpenAI request validation and error shape.

Every client mistake becomes an `APIError` (a 4xx in OpenAI's `{"error": {...}}` shape) before the
request reaches the engine. Sampling fields go through `SamplingParams`' own rules
(sampling_params.py), so the server and the Python API refuse the same values. Fields we do not
implement are refused by name when they are set to a non-default value (clients commonly send
`frequency_penalty: 0`, which means "off" and is accepted); fields we do not know are ignored (OpenAI's
API refuses them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..sampling_params import COMPLETION_MAX_TOKENS, RULES, InvalidRequest, SamplingParams

MAX_CHOICES = 64  # engine requests per HTTP request: prompts x n


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def internal(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


def engine_error(e: Exception) -> APIError:
    """What a request the engine failed is answered (an EngineStepError: its status and code)."""
    return APIError(e.status, str(e), type="server_error", code=e.code)


# Unsupported fields and the value(s) that mean "off" (accepted and ignored).
_UNSUPPORTED_COMMON = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "min_tokens": (None, 0),
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,),
    "prompt_logprobs": (None,),
}
_UNSUPPORTED_COMPLETIONS = {"echo": (None, False), "suffix": (None, "")}
_UNSUPPORTED_CHAT = {"audio": (None,), "functions": (None, []), "function_call": (None, "none", "auto"), "modalities": (None, ["text"]), "prediction": (None,),
                     "web_search_options": (None,)}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt(body: dict, name: str, check, what: str, default=None):
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise bad(f"'{name}' must be {what}, got {v!r}"[:300], name)
    return v


@dataclass
class GenParams:
    """What both endpoints generate with: the engine's sampling parameters and the HTTP side's own."""
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    n: int = 1  # choices per prompt


def _same(v, d) -> bool:
    """v == d, where a boolean matches only a boolean (in Python False == 0 and True == 1)."""
    return v == d and (isinstance(v, bool) == isinstance(d, bool))


def _check_unsupported(body: dict, table: dict) -> None:
    """An unsupported field passes only at its neutral value."""
    for name, defaults in table.items():
        if name in body and body[name] is not None and not any(_same(body[name], d) for d in defaults):
            raise bad(f"'{name}' is not supported by this server", name, "unsupported_parameter")


# Body fields that are SamplingParams fields of the same name and meaning (chat's logprobs is not).
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                    "ignore_eos", "skip_special_tokens")


def _sampling_params(body: dict, chat: bool, default_max_tokens: int | None, defaults: dict) -> SamplingParams:
    """The body's sampling fields through SamplingParams' own rules (sampling_params.py), so the
    Python API and the server refuse the same values."""
    given = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    kw = {"max_tokens": default_max_tokens, **defaults, **given}
    renamed = {}  # SamplingParams field -> the body field it came from, where they differ
    try:
        if chat:
            if body.get("max_completion_tokens") is not None:  # the newer name wins, as in OpenAI's API
                RULES["max_tokens"](kw["max_tokens"])  # max_tokens is still checked
                kw["max_tokens"] = body["max_completion_tokens"]
                renamed["max_tokens"] = "max_completion_tokens"
            want = _opt(body, "logprobs", lambda v: isinstance(v, bool), "a boolean", False)
            top = body.get("top_logprobs")
            if top is not None and not want:
                raise bad("'top_logprobs' requires 'logprobs': true", "top_logprobs")
            if want:
                kw["logprobs"] = 0 if top is None else top
                renamed["logprobs"] = "top_logprobs"
        elif body.get("logprobs") is not None:
            kw["logprobs"] = body["logprobs"]
        return SamplingParams(**kw)
    except InvalidRequest as e:
        e = e.renamed(renamed.get(e.param, e.param))
        raise bad(str(e), e.param) from None


def _gen_params(body: dict, *, chat: bool, default_max_tokens: int | None,
                defaults: dict | None) -> GenParams:
    _check_unsupported(body, _UNSUPPORTED_COMMON)
    _check_unsupported(body, _UNSUPPORTED_CHAT if chat else _UNSUPPORTED_COMPLETIONS)
    n = _opt(body, "n", lambda v: _is_int(v) and 1 <= v <= MAX_CHOICES, f"an integer in [1, {MAX_CHOICES}]", 1)
    sampling = _sampling_params(body, chat, default_max_tokens, defaults or {})
    stream = _opt(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    so = _opt(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = so.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad("'stream_options.include_usage' must be a boolean", "stream_options")
    if "stream_options" in body and body["stream_options"] is not None and not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    return GenParams(sampling, stream, include_usage, n)


@dataclass
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]  # one entry per choice
    gen: GenParams


@dataclass
class ChatRequest:
    model: str | None
    messages: Any  # validated by chat.normalize_messages
    tools: Any
    tool_choice: str | dict  # "auto" | "none" | "required" | {"type":"function","function":{"name"}}
    enable_thinking: bool
    template_kwargs: dict
    add_generation_prompt: bool
    gen: GenParams
    named_tool: str | None = field(default=None)
    parallel_tool_calls: bool = True  # False: a response carries at most the first call


def model_field(body: dict) -> str | None:
    return _opt(body, "model", lambda v: isinstance(v, str), "a string")


def _token_list(v) -> bool:
    # type() and not isinstance: a bool is no token id; map() and set(): 16k ids in 0.2 ms, not 0.3
    return isinstance(v, list) and len(v) > 0 and set(map(type, v)) == {int}


def parse_completion(body: Any, defaults: dict | None = None) -> CompletionRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    p = body.get("prompt")
    if isinstance(p, str):
        prompts = [p]
    elif _token_list(p):
        prompts = [p]
    elif isinstance(p, list) and p and (all(isinstance(x, str) for x in p) or all(_token_list(x) for x in p)):
        prompts = list(p)
    elif p is None:
        raise bad("'prompt' is required", "prompt")
    else:
        raise bad("'prompt' must be a string, a list of strings, a list of token ids or a list of "
                  "token-id lists", "prompt")
    if any(isinstance(x, str) and not x for x in prompts):
        raise bad("'prompt' must not be empty", "prompt")
    if len(prompts) > MAX_CHOICES:
        raise bad(f"at most {MAX_CHOICES} prompts per request", "prompt")
    gen = _gen_params(body, chat=False, default_max_tokens=COMPLETION_MAX_TOKENS, defaults=defaults)
    if len(prompts) * gen.n > MAX_CHOICES:
        raise bad(f"{len(prompts)} prompts x n={gen.n} is over {MAX_CHOICES} choices per request", "n")
    return CompletionRequest(model_field(body), prompts, gen)


def parse_chat(body: Any, defaults: dict | None = None) -> ChatRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad("'tools' must be a list", "tools")
    tool_choice = body.get("tool_choice")
    named = None
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    elif isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none", "required"):
            raise bad("'tool_choice' must be 'auto', 'none', 'required' or a named function",
                      "tool_choice")
    elif isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(fn, dict) or \
                not isinstance(fn.get("name"), str):
            raise bad("'tool_choice' object must be {\"type\": \"function\", \"function\": "
                      "{\"name\": ...}}", "tool_choice")
        named = fn["name"]
    else:
        raise bad("'tool_choice' must be a string or an object", "tool_choice")
    if (tool_choice == "required" or named) and not tools:
        raise bad("'tool_choice' requires 'tools'", "tool_choice")
    if named and not any(isinstance(t, dict) and isinstance(t.get("function"), dict)
                         and t["function"].get("name") == named for t in tools):
        raise bad(f"'tool_choice' names function {named!r}, which is not in 'tools'", "tool_choice")
    ptc = body.get("parallel_tool_calls")
    if ptc is not None and not isinstance(ptc, bool):
        raise bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    kwargs = _opt(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object", {})
    thinking = kwargs.get("enable_thinking", True)
    if not isinstance(thinking, bool):
        raise bad("'chat_template_kwargs.enable_thinking' must be a boolean", "chat_template_kwargs")
    reserved = {"messages", "tools", "add_generation_prompt"} & set(kwargs)
    if reserved:
        raise bad(f"'chat_template_kwargs' may not set {sorted(reserved)}", "chat_template_kwargs")
    agp = _opt(body, "add_generation_prompt", lambda v: isinstance(v, bool), "a boolean", True)
    gen = _gen_params(body, chat=True, default_max_tokens=None, defaults=defaults)
    return ChatRequest(model_field(body), messages, tools, tool_choice, thinking,
                       {k: v for k, v in kwargs.items() if k != "enable_thinking"}, agp, gen, named,
                       parallel_tool_calls=ptc is not False)

"""Chat template rendering, tool-call parsing and reasoning parsing for Qwen3 chat output, and the
chat policy: what a request's prompt is (a forced tool call's prefill, reasoning) and how its answer
is read back (`chat_prompt`, `ChatPrompt.parser`). No HTTP here.

The template is the model directory's own (`ModelFiles.chat_template`), rendered with a sandboxed
jinja2 environment set up the way Hugging Face's `apply_chat_template` sets it up, so a prompt here
is byte-identical to the one the model was trained on.

The parsers are streaming state machines; the non-streaming functions run the same machine once
over the whole text, so a stream's concatenated deltas always equal the non-streaming result,
however the text is split.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "ChatError", "ChatTemplate", "normalize_messages", "normalize_tools",
    "ToolCall", "ToolCallStreamParser", "parse_tool_calls",
    "ReasoningStreamParser", "parse_reasoning", "ChatOutputParser", "ChatDelta", "ChatPrompt", "chat_prompt",
    "TOOL_CALL_START", "TOOL_CALL_END", "THINK_START", "THINK_END", "loads_text_json",
]

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
THINK_START, THINK_END = "<think>", "</think>"
_ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatError(ValueError):
    """A request whose messages/tools cannot be rendered: the client's mistake (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# ----------------------------------------------------------------------------- template


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Same as transformers' filter: jinja's built-in tojson HTML-escapes and sorts keys.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class ChatTemplate:
    """A compiled chat template. `render()` takes already-normalized messages and tools."""

    def __init__(self, source: str):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self._template = env.from_string(source)

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = True, extra: dict[str, Any] | None = None, **kwargs: Any) -> str:
        """`extra`: a client's template variables (any names: "self" too), under messages, tools,
        add_generation_prompt and kwargs."""
        # One mapping, so that no variable name can collide with a Python parameter (jinja2's "self").
        context = {**(extra or {}), **kwargs, "messages": messages, "tools": tools or None,
                   "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(context)
        except jinja2.exceptions.TemplateError as e:
            raise ChatError(f"chat template error: {e}", "messages") from e
        except (TypeError, AttributeError, KeyError, IndexError) as e:
            # A message shape the template did not expect: the client's input, not our crash.
            raise ChatError(f"messages cannot be rendered by the chat template: {e}",
                            "messages") from e


def _text_content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, dict):
                raise ChatError(f"{where}.content[{j}] must be an object", f"{where}.content")
            kind = part.get("type", "text")
            if kind != "text":
                raise ChatError(f"{where}.content[{j}]: content part type {kind!r} is not "
                                "supported (text only)", f"{where}.content")
            if not isinstance(part.get("text"), str):
                raise ChatError(f"{where}.content[{j}].text must be a string", f"{where}.content")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ChatError(f"{where}.content must be a string or a list of text parts",
                    f"{where}.content")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"{text} is out of range")
    return v


# json.loads builds a decoder per call when given hooks: these are built once (a request's body is
# parsed ~20 us sooner on the 2-vCPU VM, right after a step). Decoders keep no state between calls.
_DECODE = json.JSONDecoder(parse_constant=_reject_constant).decode
_DECODE_FINITE = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float).decode


def loads_text_json(text: str | bytes, finite: bool = False) -> Any:
    """json.loads for JSON whose strings go back out as UTF-8 text. ValueError for malformed JSON,
    nesting past the interpreter's recursion limit, an integer past Python's digit limit, NaN or
    Infinity, an escaped lone surrogate ("\\ud800" decodes to one, which no UTF-8 text can carry) and,
    with `finite`, a number out of float range (1e999 would go back out as Infinity, not JSON)."""
    try:
        if isinstance(text, (bytes, bytearray)):  # as json.loads reads bytes
            s = text.decode(json.detect_encoding(text), "surrogatepass")
        elif text.startswith("\ufeff"):
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        else:
            s = text
        value = (_DECODE_FINITE if finite else _DECODE)(s)
        # in JSON bytes only an escape or a surrogate's own UTF-8 (ED A0..BF, which json.loads lets through)
        # can make a lone surrogate; the finds take 8 ms for 7 MB, the check 45 ms (a regex: 70), GIL held
        if not isinstance(text, bytes) or b"\\u" in text or b"\xed" in text:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    return value


def _normalize_tool_call(tc: Any, where: str) -> dict:
    if not isinstance(tc, dict):
        raise ChatError(f"{where} must be an object", where)
    fn = tc.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ChatError(f"{where}.function.name must be a non-empty string", where)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:  # normalise to a dict so the template writes canonical JSON
            parsed = loads_text_json(args) if args.strip() else {}
        except ValueError:
            raise ChatError(f"{where}.function.arguments is not valid JSON", where) from None
        args = parsed
    if not isinstance(args, dict):
        raise ChatError(f"{where}.function.arguments must be a JSON object", where)
    return {"id": tc.get("id"), "type": "function",
            "function": {"name": fn["name"], "arguments": args}}


def normalize_messages(messages: Any) -> list[dict]:
    """OpenAI chat messages -> the plain dicts the Qwen3 template expects (string content)."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatError(f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in _ROLES:
            raise ChatError(f"{where}.role must be one of {', '.join(_ROLES)}", "messages")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if "content" not in m and not (role == "assistant" and m.get("tool_calls")):
            raise ChatError(f"{where}.content is required", "messages")
        msg: dict[str, Any] = {"role": role, "content": _text_content(m.get("content"), where)}
        if role == "assistant":
            if m.get("tool_calls") is not None:
                if not isinstance(m["tool_calls"], list):
                    raise ChatError(f"{where}.tool_calls must be a list", "messages")
                msg["tool_calls"] = [_normalize_tool_call(tc, f"{where}.tool_calls[{j}]")
                                     for j, tc in enumerate(m["tool_calls"])]
            rc = m.get("reasoning_content")
            if isinstance(rc, str):
                msg["reasoning_content"] = rc
        if role == "tool" and isinstance(m.get("tool_call_id"), str):
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def normalize_tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatError("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise ChatError(f"tools[{i}] must be an object of type 'function'", "tools")
        fn = t.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatError(f"tools[{i}].function.name must be a non-empty string", "tools")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise ChatError(f"tools[{i}].function.parameters must be an object", "tools")
        out.append({"type": "function", "function": fn})
    return out or None


# ----------------------------------------------------------------------------- parsers


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _parse_tool_call_body(body: str) -> ToolCall | None:
    """The JSON between the tags, or None when it is not a well-formed call (the call then stays
    content): what the client gets back must be JSON it can parse, so the checks of loads_text_json."""
    try:
        obj = loads_text_json(body, finite=True)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models double-encode; accept only a JSON object inside
        try:
            args = loads_text_json(args, finite=True)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (a tag maybe starting)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallStreamParser:
    """Splits model text into content and `<tool_call>` blocks as it streams in.

    `feed(delta)` / `finish()` return (content_delta, [ToolCall, ...]). Text that might still become
    part of a tag is held back, so tag text never reaches content. Whitespace next to a well-formed
    block is dropped (it is only the model's separator); a malformed or unclosed block is returned
    as content, verbatim. With `max_calls` (parallel_tool_calls=false: 1), everything after that
    many calls is dropped.
    """

    def __init__(self, max_calls: int | None = None):
        self._buf = ""
        self._after_call = False  # strip whitespace that follows a parsed call
        self._max_calls = max_calls
        self.calls: list[ToolCall] = []

    @property
    def capped(self) -> bool:
        """The last call allowed is out: nothing the model writes after it will be returned."""
        return self._max_calls is not None and len(self.calls) >= self._max_calls

    def _content(self, text: str, out: list[str]) -> None:
        if self._after_call:
            text = text.lstrip()
        if text:
            self._after_call = False
            out.append(text)

    def _process(self, final: bool) -> tuple[str, list[ToolCall]]:
        out: list[str] = []
        calls: list[ToolCall] = []
        buf = self._buf
        while self._max_calls is None or len(self.calls) + len(calls) < self._max_calls:
            i = buf.find(TOOL_CALL_START)
            if i < 0:
                if final:
                    self._content(buf, out)
                    buf = ""
                    break
                # Hold a possible tag start, and trailing whitespace that a tag may yet follow.
                cut = len(buf) - _partial_suffix(buf, TOOL_CALL_START)
                while cut > 0 and buf[cut - 1].isspace():
                    cut -= 1
                self._content(buf[:cut], out)
                buf = buf[cut:]
                break
            j = buf.find(TOOL_CALL_END, i + len(TOOL_CALL_START))
            if j < 0:
                if final:  # unclosed (e.g. cut by max_tokens): plain content
                    self._content(buf, out)
                    buf = ""
                    break
                pre = buf[:i].rstrip()
                self._content(pre, out)
                buf = buf[len(pre):]
                break
            end = j + len(TOOL_CALL_END)
            call = _parse_tool_call_body(buf[i + len(TOOL_CALL_START):j].strip())
            if call is None:
                self._content(buf[:end], out)
            else:
                self._content(buf[:i].rstrip(), out)
                calls.append(call)
                self._after_call = True
            buf = buf[end:]
        else:
            buf = ""  # the last call allowed is out: the rest is dropped
        self._buf = buf
        self.calls.extend(calls)
        return "".join(out), calls

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._buf += delta
        return self._process(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self._process(final=True)


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Whole-text variant: (content or None, tool calls)."""
    p = ToolCallStreamParser()
    a, c1 = p.feed(text)
    b, c2 = p.finish()
    content = a + b
    calls = c1 + c2
    if calls and not content.strip():
        content = ""
    return (content or None), calls


class ReasoningStreamParser:
    """Splits `<think>...</think>` (at the start of the output) into reasoning, the rest into content.

    `feed(delta)` / `finish()` return (reasoning_delta, content_delta). With `enabled=False` (the
    prompt already closed the think block: enable_thinking=False) everything is content.
    `started_in_think=True` is for templates whose prompt opens `<think>` itself.
    Newlines around the reasoning and those just after `</think>` are the template's framing and are
    dropped, as the template itself does when it renders a past turn.
    """

    def __init__(self, enabled: bool = True, started_in_think: bool = False):
        self._state = ("reason" if started_in_think else "start") if enabled else "content"
        self._buf = ""
        self._reason_started = False

    def _process(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        buf = self._buf
        if self._state == "start":
            head = buf.lstrip()
            if head.startswith(THINK_START):
                buf = head[len(THINK_START):]
                self._state = "reason"
            elif THINK_START.startswith(head) and not final:
                return "", ""  # could still be "<think>"
            else:
                self._state = "content"
        if self._state == "reason":
            if not self._reason_started:
                buf = buf.lstrip("\n")
                self._reason_started = bool(buf)
            j = buf.find(THINK_END)
            if j >= 0:
                reasoning.append(buf[:j].rstrip("\n"))
                buf = buf[j + len(THINK_END):]
                self._state = "after"
            elif final:
                reasoning.append(buf.rstrip("\n"))
                buf = ""
            else:
                cut = len(buf) - _partial_suffix(buf, THINK_END)
                while cut > 0 and buf[cut - 1] == "\n":
                    cut -= 1
                reasoning.append(buf[:cut])
                buf = buf[cut:]
        if self._state == "after":
            buf = buf.lstrip("\n")
            if buf:
                self._state = "content"
        if self._state == "content":
            content.append(buf)
            buf = ""
        self._buf = buf
        return "".join(reasoning), "".join(content)

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        return self._process(final=False)

    def finish(self) -> tuple[str, str]:
        return self._process(final=True)


def parse_reasoning(text: str, enabled: bool = True) -> tuple[str | None, str]:
    p = ReasoningStreamParser(enabled)
    r1, c1 = p.feed(text)
    r2, c2 = p.finish()
    return (r1 + r2) or None, c1 + c2


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self):
        return bool(self.reasoning or self.content or self.tool_calls)

    def join(self, later: "ChatDelta") -> "ChatDelta":
        return ChatDelta(self.reasoning + later.reasoning, self.content + later.content,
                         self.tool_calls + later.tool_calls)


class ChatOutputParser:
    """Reasoning split first, then tool calls out of the content: the whole chat-output pipeline.

    `prefill`: the answer's opening that the prompt already wrote (a forced call's, `chat_prompt`),
    parsed as if the model had written it."""

    def __init__(self, reasoning: bool = True, tools: bool = True, started_in_think: bool = False,
                 max_tool_calls: int | None = None, prefill: str = ""):
        self._reason = ReasoningStreamParser(enabled=reasoning, started_in_think=started_in_think)
        self._tools = ToolCallStreamParser(max_tool_calls) if tools else None
        self.num_tool_calls = 0
        self._cut = ""
        if prefill:
            self.feed(prefill)  # held inside the open tag: yields nothing
        # A forced call that does not complete comes back as content, led by that prefill, which the
        # model never wrote: it is cut from the first content (nothing else can come before it). Once
        # the parser gives a call or content, the prefill has been accounted for.
        self._cut = prefill

    @property
    def capped(self) -> bool:
        return self._tools is not None and self._tools.capped

    def _chain(self, r: str, c: str, final: bool) -> ChatDelta:
        calls: list[ToolCall] = []
        if self._tools is not None:
            c, calls = self._tools.feed(c)
            if final:
                c2, more = self._tools.finish()
                c, calls = c + c2, calls + more
            self.num_tool_calls += len(calls)
        if self._cut and (c or calls):
            c, self._cut = c.removeprefix(self._cut), ""
        return ChatDelta(r, c, calls)

    def feed(self, delta: str) -> ChatDelta:
        return self._chain(*self._reason.feed(delta), final=False)

    def finish(self) -> ChatDelta:
        return self._chain(*self._reason.finish(), final=True)

    def parse(self, text: str) -> ChatDelta:
        """Whole text at once (non-streaming): content is None-able in the caller."""
        return self.feed(text).join(self.finish())

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's finish_reason for an answer the engine ended with `reason`."""
        return "tool_calls" if self.num_tool_calls and reason == "stop" else reason


# ----------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class ChatPrompt:
    """What a chat request generates from, and how its answer is read back."""
    text: str  # the prompt to tokenize, the prefill included
    reasoning: bool  # the answer may open with a think block
    started_in_think: bool  # the prompt opened that block itself
    tools: bool  # tool calls are parsed out of the answer
    prefill: str  # the answer's opening, written by us (a forced call's)

    def parser(self, parallel_tool_calls: bool = True) -> ChatOutputParser:
        """A parser for one answer; parallel_tool_calls=False keeps only the first call."""
        return ChatOutputParser(self.reasoning, self.tools, self.started_in_think,
                                None if parallel_tool_calls else 1, self.prefill)


def chat_prompt(template: ChatTemplate, messages: Any, tools: Any = None, tool_choice: str | dict = "auto",
                named_tool: str | None = None, *, add_generation_prompt: bool = True,
                enable_thinking: bool = True, template_kwargs: dict | None = None) -> ChatPrompt:
    """The prompt of an OpenAI chat request. tool_choice: "auto", "none", "required" or a named
    function (`named_tool` its name); "none" shows the model no tools and parses no calls."""
    messages = normalize_messages(messages)
    tools = normalize_tools(tools) if tool_choice != "none" else None
    if named_tool and tools:  # the model sees only the function it must call
        tools = [t for t in tools if t["function"]["name"] == named_tool]
    prompt = template.render(messages, tools, add_generation_prompt=add_generation_prompt,
                             extra=template_kwargs, enable_thinking=enable_thinking)
    tail = prompt.rstrip()
    reasoning = not tail.endswith(THINK_END)  # enable_thinking=False closed the block already
    prefill = ""
    if (named_tool or (tool_choice == "required" and tools)) and add_generation_prompt:
        # A forced call: the answer opens with the call, written by us (a named function: its name
        # too, and the model writes the arguments; "required": the model picks the function). The
        # parser sees the prefill as if the model had written it. A template that thinks gets its
        # think block closed empty first, as its enable_thinking=False form does, so that the call
        # comes where the model would write it.
        if reasoning and THINK_START in template.source:
            opened = tail.endswith(THINK_START)
            prompt = (tail if opened else prompt + THINK_START) + "\n\n" + THINK_END + "\n\n"
        prefill = TOOL_CALL_START + "\n"
        if named_tool:
            prefill += json.dumps({"name": named_tool})[:-1] + ", \"arguments\": "
        reasoning = False
    return ChatPrompt(prompt + prefill, reasoning, tail.endswith(THINK_START), tools is not None, prefill)

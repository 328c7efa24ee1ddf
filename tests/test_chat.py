"""Chat template rendering and the tool-call / reasoning parsers (no engine needed)."""

import json
import random
from pathlib import Path

import pytest

from openinfer.chat import (ChatError, ChatOutputParser, ChatTemplate, ReasoningStreamParser,
                            ToolCallStreamParser, chat_prompt, normalize_messages, normalize_tools,
                            parse_reasoning, parse_tool_calls)
from openinfer.model_files import ModelFiles

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "src/openinfer/data/qwen3-tokenizer"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def tmpl():
    return ChatTemplate(ModelFiles.read(TOKENIZER_DIR).chat_template)


def render(tmpl, messages, tools=None, **kw):
    return tmpl.render(normalize_messages(messages), normalize_tools(tools), **kw)


# ----------------------------------------------------------------------------- template


def test_template_plain_turns(tmpl):
    out = render(tmpl, [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Hi"}])
    assert out == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                   "<|im_start|>assistant\n")


def test_template_enable_thinking_false_and_no_generation_prompt(tmpl):
    msgs = [{"role": "user", "content": "Hi"}]
    assert render(tmpl, msgs, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(tmpl, msgs, add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"


def test_template_content_parts_and_developer_role(tmpl):
    out = render(tmpl, [{"role": "developer", "content": [{"type": "text", "text": "A"}]},
                        {"role": "user", "content": [{"type": "text", "text": "x"},
                                                     {"type": "text", "text": "y"}]}])
    assert out.startswith("<|im_start|>system\nA<|im_end|>\n<|im_start|>user\nx\ny<|im_end|>\n")


def test_template_tools_and_tool_turns(tmpl):
    call_str = {"id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
    call_dict = {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
    outs = []
    for call in (call_str, call_dict):
        outs.append(render(tmpl, [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
            {"role": "tool", "tool_call_id": "c2", "content": "sunny"}], tools=[WEATHER]))
    assert outs[0] == outs[1]  # arguments as a JSON string or a dict render the same
    out = outs[0]
    assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>" in out
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>' in out
    # consecutive tool results share one user turn
    assert ("<|im_start|>user\n<tool_response>\n21 C\n</tool_response>\n<tool_response>\nsunny\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in out


def test_template_raise_exception_and_tojson():
    t = ChatTemplate("{% if messages|length > 1 %}{{ raise_exception('one only') }}{% endif %}"
                     "{{ messages[0] | tojson }}")
    assert t.render([{"role": "user", "content": "é<>"}]) == '{"role": "user", "content": "é<>"}'
    with pytest.raises(ChatError, match="one only"):
        t.render([{"role": "user", "content": "a"}] * 2)


def test_template_is_sandboxed():
    t = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatError):
        t.render([{"role": "user", "content": "a"}])


@pytest.mark.parametrize("messages", [
    [], "hi", [{"role": "wizard", "content": "x"}], [{"content": "x"}], [{"role": "user"}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}],
    [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "{not json"}}]}],
])
def test_bad_messages(messages):
    with pytest.raises(ChatError):
        normalize_messages(messages)


@pytest.mark.parametrize("tools", ["x", [{"type": "function"}], [{"type": "code", "function": {}}],
                                   [{"type": "function", "function": {"name": "f", "parameters": 3}}]])
def test_bad_tools(tools):
    with pytest.raises(ChatError):
        normalize_tools(tools)


# ----------------------------------------------------------------------------- tool calls


def tc(name, args):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def test_one_call():
    content, calls = parse_tool_calls(tc("get_weather", {"city": "Paris"}))
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].id.startswith("call_")


def test_several_calls_with_text_before():
    text = "Let me check both.\n" + tc("a", {"x": 1}) + "\n" + tc("b", {}) + "\n"
    content, calls = parse_tool_calls(text)
    assert content == "Let me check both."
    assert [c.name for c in calls] == ["a", "b"]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("block", [
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n',  # unclosed (cut by max_tokens)
])
def test_malformed_block_stays_content(block):
    text = "Before " + block
    content, calls = parse_tool_calls(text)
    assert calls == [] and content == text


@pytest.mark.parametrize("block", [
    # what the client gets back must be JSON it can parse and UTF-8 text (found by a fuzzing pass:
    # the surrogates were a 500 or a cut stream, the nesting and digits an unhandled error, NaN
    # went out as invalid JSON)
    '<tool_call>\n{"name": "get", "arguments": {"a": "\\ud800"}}\n</tool_call>',  # lone surrogate
    '<tool_call>\n{"name": "\\ud83d", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "get", "arguments": "' + "[" * 1100 + '"}\n</tool_call>',  # double-encoded, deep
    '<tool_call>\n{"name": "get", "arguments": {"a": ' + "1" * 4400 + '}}\n</tool_call>',  # digit limit
    '<tool_call>\n{"name": "get", "arguments": "{\\"a\\": ' + "1" * 4400 + '}"}\n</tool_call>',
    '<tool_call>\n{"name": "get", "arguments": {"a": NaN}}\n</tool_call>',
    '<tool_call>\n{"name": "get", "arguments": {"a": -Infinity}}\n</tool_call>',
    '<tool_call>\n{"name": "get", "arguments": {"a": 1e999}}\n</tool_call>',  # Infinity on the way out
])
def test_call_the_client_could_not_parse_stays_content(block):
    content, calls = parse_tool_calls(block)
    assert calls == [] and content == block
    content.encode("utf-8")


def test_escaped_surrogate_pair_and_floats_parse():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"a": "\\ud83d\\ude00", '
                                      '"b": 1.5e300}}\n</tool_call>')
    assert content is None and json.loads(calls[0].arguments) == {"a": "\U0001F600", "b": 1.5e300}


def test_malformed_next_to_valid():
    text = tc("a", {}) + "<tool_call>oops</tool_call> tail"
    content, calls = parse_tool_calls(text)
    assert [c.name for c in calls] == ["a"]
    assert content == "<tool_call>oops</tool_call> tail"


def test_no_calls_leaves_text_untouched():
    for text in ("", "  plain  \n", "a < b <tool and <tool_cal", "x </tool_call> y"):
        assert parse_tool_calls(text) == (text or None, [])


def _stream_tools(pieces):
    p = ToolCallStreamParser()
    content, calls = [], []
    for piece in pieces:
        c, k = p.feed(piece)
        content.append(c)
        calls += k
    c, k = p.finish()
    return content + [c], calls + k


STREAM_CASES = [
    tc("get_weather", {"city": "Paris"}),
    "Sure — checking 🌦️ now.\n\n" + tc("get_weather", {"city": "Zürich"}) + "\n" + tc("t", {"n": [1, 2]}),
    "Text <tool_cal and <tool_call>broken</tool_call> then " + tc("x", {}) + " after\n",
    "Unclosed: <tool_call>\n{\"name\": \"f\"",
    "no tags at all, just < and <<tool",
]


@pytest.mark.parametrize("text", STREAM_CASES)
def test_stream_split_everywhere_equals_whole(text):
    want_content, want_calls = parse_tool_calls(text)
    want = ((want_content or ""), [(c.name, c.arguments) for c in want_calls])
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    splits.append(list(text))  # one character per chunk
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), min(5, len(text) + 1)))
        splits.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    for pieces in splits:
        content, calls = _stream_tools(pieces)
        got = ("".join(content), [(c.name, c.arguments) for c in calls])
        assert got == want, pieces
        if want_calls:  # no fragment of a parsed call's tags may reach content
            for c in content:
                assert "tool_call" not in c.replace("<tool_call>broken</tool_call>", "")


def test_stream_emits_content_before_call_completes():
    p = ToolCallStreamParser()
    assert p.feed("Hello wor") == ("Hello wor", [])
    assert p.feed("ld <tool") == ("ld", [])  # space and partial tag held back
    assert p.feed('_call>{"name": "f"') == ("", [])
    c, calls = p.feed("}</tool_call>")
    assert c == "" and calls[0].name == "f" and calls[0].arguments == "{}"


# ----------------------------------------------------------------------------- reasoning


def test_reasoning_split():
    assert parse_reasoning("<think>\nLet me think.\n</think>\n\nParis.") == ("Let me think.", "Paris.")
    assert parse_reasoning("<think>\n\n</think>\n\nHi") == (None, "Hi")
    assert parse_reasoning("No thinking here") == (None, "No thinking here")
    assert parse_reasoning("<think>\ncut off by max_tok") == ("cut off by max_tok", "")
    # enable_thinking=False: the prompt closed the block; tags in the output are just text
    assert parse_reasoning("<think>x</think>y", enabled=False) == (None, "<think>x</think>y")


def test_reasoning_started_in_prompt():
    p = ReasoningStreamParser(started_in_think=True)
    r1, c1 = p.feed("hmm\n</think>\n\nok")
    r2, c2 = p.finish()
    assert (r1 + r2, c1 + c2) == ("hmm", "ok")


@pytest.mark.parametrize("text", ["<think>\nStep 1.\nStep 2.\n</think>\n\nAnswer: 4",
                                  "  <think>a</think>b", "<thin", "<think>", "x<think>y</think>z"])
def test_reasoning_stream_split_everywhere(text):
    want = parse_reasoning(text)
    for i in range(len(text) + 1):
        for pieces in ([text[:i], text[i:]], list(text)):
            p = ReasoningStreamParser()
            r, c = zip(*[p.feed(x) for x in pieces], p.finish())
            got = ("".join(r) or None, "".join(c))
            assert got == want, pieces
            assert all("think>" not in x for x in r)


def test_chat_output_parser_reasoning_then_tool_call_streamed():
    text = "<think>\nNeed weather.\n</think>\n\n" + tc("get_weather", {"city": "Oslo"})
    whole = ChatOutputParser().parse(text)
    assert whole.reasoning == "Need weather." and whole.content == ""
    assert whole.tool_calls[0].name == "get_weather"
    for i in range(len(text) + 1):
        p = ChatOutputParser()
        deltas = [p.feed(text[:i]), p.feed(text[i:]), p.finish()]
        assert "".join(d.reasoning for d in deltas) == "Need weather."
        assert "".join(d.content for d in deltas) == ""
        assert [c.arguments for d in deltas for c in d.tool_calls] == ['{"city": "Oslo"}']


# ----------------------------------------------------------------------------- policy

USER = [{"role": "user", "content": "Weather in Oslo?"}]


def answer(prompt, text, **kw):
    """The parsed answer when the model writes `text` after the prompt, streamed in two pieces."""
    p = prompt.parser(**kw)
    deltas = [p.feed(text[:5]), p.feed(text[5:]), p.finish()]
    d = deltas[0].join(deltas[1]).join(deltas[2])
    return d, p


def test_policy_auto_reads_reasoning_and_calls(tmpl):
    pr = chat_prompt(tmpl, USER, [WEATHER])
    assert pr.text == render(tmpl, USER, [WEATHER]) and pr.prefill == ""
    assert pr.reasoning and pr.tools and not pr.started_in_think
    d, p = answer(pr, "<think>\nhm\n</think>\n\n" + tc("get_weather", {"city": "Oslo"}))
    assert d.reasoning == "hm" and d.content == "" and d.tool_calls[0].name == "get_weather"
    assert p.finish_reason("stop") == "tool_calls" and p.finish_reason("length") == "length"


def test_policy_none_hides_tools_and_parses_no_calls(tmpl):
    pr = chat_prompt(tmpl, USER, [WEATHER], "none")
    assert pr.text == render(tmpl, USER) and not pr.tools
    call = tc("get_weather", {"city": "Oslo"})
    d, p = answer(pr, call)
    assert d.content == call and not d.tool_calls and p.finish_reason("stop") == "stop"


def test_policy_required_closes_the_think_block_and_opens_a_call(tmpl):
    pr = chat_prompt(tmpl, USER, [WEATHER], "required")
    assert pr.text == render(tmpl, USER, [WEATHER], enable_thinking=False) + "<tool_call>\n"
    assert pr.prefill == "<tool_call>\n" and not pr.reasoning
    d, _ = answer(pr, json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}}) + "\n</tool_call>")
    assert d.content == "" and d.tool_calls[0].arguments == '{"city": "Oslo"}'


def test_policy_named_function_writes_its_name_and_shows_only_it(tmpl):
    other = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    pr = chat_prompt(tmpl, USER, [WEATHER, other], {"type": "function", "function": {"name": "get_weather"}},
                     "get_weather")
    assert "get_time" not in pr.text
    assert pr.text.endswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    d, _ = answer(pr, '{"city": "Oslo"}}\n</tool_call>')
    assert [(c.name, c.arguments) for c in d.tool_calls] == [("get_weather", '{"city": "Oslo"}')]
    # cut short (max_tokens): content, as the model wrote it, without the prefill it never wrote
    d, _ = answer(pr, '{"city": "Os')
    assert d.content == '{"city": "Os' and not d.tool_calls


def test_policy_forced_call_needs_a_generation_prompt(tmpl):
    pr = chat_prompt(tmpl, USER, [WEATHER], "required", add_generation_prompt=False)
    assert pr.prefill == "" and pr.text == render(tmpl, USER, [WEATHER], add_generation_prompt=False)


def test_policy_enable_thinking_false_reads_no_reasoning(tmpl):
    pr = chat_prompt(tmpl, USER, enable_thinking=False)
    assert not pr.reasoning and not pr.tools
    d, _ = answer(pr, "<think>x</think>Hi")
    assert d.reasoning == "" and d.content == "<think>x</think>Hi"


def test_policy_parallel_tool_calls_false_keeps_the_first(tmpl):
    pr = chat_prompt(tmpl, USER, [WEATHER])
    two = tc("get_weather", {"city": "Oslo"}) + tc("get_weather", {"city": "Rome"})
    d, p = answer(pr, two, parallel_tool_calls=False)
    assert len(d.tool_calls) == 1 and p.capped

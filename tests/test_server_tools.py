"""Tool calling and reasoning through the HTTP server, driven by the parser on scripted model output.

A random-weight model never writes a valid `<tool_call>`, so here (and only here) a scripted engine
stands in for the model's output: it implements the LLMEngine API with the real tokenizer and the
real incremental detokenizer, and answers according to the rendered prompt it receives. Everything
between the HTTP client and that output (template, parsers, SSE, the engine thread) is the real code.
"""

import json
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from openinfer.detokenizer import IncrementalDetokenizer
from openinfer.tokenizer import Tokenizer
from test_server_harness import RunningServer, wait_until

NAME = "scripted"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def call(name, args):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def script(prompt: str, choice: int = 0) -> str:
    """The 'model': what it says depends only on the last turn of the rendered prompt (and, for
    "uneven", on the choice: n > 1)."""
    if prompt == "fraktur":  # a completion whose middle character is two byte-level tokens
        return "a\U0001D518b"
    last = prompt.rsplit("<|im_start|>", 2)[-2]
    if "uneven" in last:  # choice 0 calls early and would go on long after; choice 1 only talks
        return call("get_weather", {"city": "Paris"}) + " x" * 300 if choice == 0 else "Sunny" + " y" * 150
    if "<tool_response>" in last:
        temp = json.loads(last.split("<tool_response>\n")[1].split("\n</tool_response>")[0])["temp"]
        return f"<think>\nThe tool says {temp}.\n</think>\n\nIt is {temp} °C in Paris."
    if "two cities" in last:
        return ("Checking both.\n" + call("get_weather", {"city": "Paris"}) + "\n"
                + call("get_weather", {"city": "Zürich"}))
    if "broken" in last:
        return "Oops <tool_call>\n{\"name\": get_weather}\n</tool_call>"
    if prompt.endswith("<tool_call>\n"):  # tool_choice "required": the prompt opened a call
        out = json.dumps({"name": "get_weather", "arguments": {"city": "Rome"}}) + "\n</tool_call>"
        if "then a bad one" in last:
            out += "\n<tool_call>\n{\"name\": get_weather}\n</tool_call>"
        return out
    if "arguments\": " in prompt[-40:]:  # a forced (named) call: the prompt opened it already
        if "cut short" in last:  # as when max_tokens ends it mid-arguments
            return '{"city": "Os'
        return '{"city": "Oslo"}}\n</tool_call>'
    return ("<think>\nI need the weather tool.\n</think>\n\nLet me check.\n"
            + call("get_weather", {"city": "Paris"}))


class ScriptedEngine:
    """The LLMEngine API over scripted output. chars=True emits one character per update, so every
    split point of the text crosses an SSE chunk boundary."""

    def __init__(self, chars: bool):
        self.tokenizer = Tokenizer.from_model_dir("/nonexistent")  # the bundled Qwen3 files
        self.model_config = SimpleNamespace(vocab_size=151936)
        self.config = SimpleNamespace(max_model_len=4096)
        self.scheduler = SimpleNamespace(max_waiting=1024)  # the waiting bound the server reads
        self.collected = None  # no step times: the server's path traces stay incomplete, unobserved
        self.chars = chars
        self.prompts: list[str] = []
        self.reqs: dict[str, list] = {}
        self.want_lp: dict[str, bool] = {}
        self.broken = False
        self.steps = 0
        self.pace = 0.0  # seconds per step while an "uneven" request runs (a real engine takes time)
        self.aborted_at: dict[str, int] = {}  # request id -> step count when aborted unfinished
        self.finished_at: dict[str, int] = {}

    def add_request(self, rid, ids, params):
        prompt = self.tokenizer.decode(ids, skip_special_tokens=False)
        self.prompts.append(prompt)
        out = script(prompt, int(rid.rsplit("-", 1)[1]))  # the server's ids end with the choice index
        if "uneven" in prompt:  # paced, so that the server sees choice 0's call long before choice 1 ends
            self.pace = 0.003
        if self.chars:
            pieces = [([0], ch) for ch in out]
        else:
            detok = IncrementalDetokenizer(self.tokenizer, True, params.stop)
            out_ids = self.tokenizer.encode(out)
            pieces = [([t], detok.add_token(t)[0]) for t in out_ids]
            pieces[-1] = (pieces[-1][0], pieces[-1][1] + detok.flush())
        self.reqs[rid] = pieces
        self.want_lp[rid] = params.logprobs is not None

    def abort_request(self, rid):
        if self.reqs.pop(rid, None) is None:
            return False
        self.aborted_at[rid] = self.steps
        if not self.reqs:
            self.pace = 0.0
        return True

    def has_unfinished(self):
        if self.broken:
            raise RuntimeError("loop-level fault")
        return bool(self.reqs)

    def step(self, before_launch=None):
        if before_launch is not None:  # where a real engine launches the device step
            before_launch()
        ups = []
        self.steps += 1
        if self.pace:
            time.sleep(self.pace)
        for rid, pieces in list(self.reqs.items()):
            ids, text = pieces.pop(0)
            done = not pieces
            if done:
                del self.reqs[rid]
                self.finished_at[rid] = self.steps
            lp = [SimpleNamespace(token_id=t, logprob=-0.5, top=[(t, -0.5)]) for t in ids] \
                if self.want_lp.get(rid) else None
            ups.append(SimpleNamespace(request_id=rid, new_token_ids=ids, new_text=text,
                                       finished=done, finish_reason="stop" if done else None,
                                       logprobs=lp))
        if not self.reqs:
            self.pace = 0.0
        return ups

    def stats(self):
        return {"num_running": len(self.reqs), "num_waiting": 0}


@pytest.fixture(scope="module", params=[False, True], ids=["token-chunks", "char-chunks"])
def srv(request):
    eng = ScriptedEngine(chars=request.param)
    s = RunningServer(eng, served_model_name=NAME)
    s.engine = eng
    yield s
    s.stop()


@pytest.fixture
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=30, max_retries=0)


def stream_message(client, **kw):
    """Accumulates a chat stream the way OpenAI clients do; checks no tag text reaches content."""
    content, reasoning, calls, finish = "", "", {}, None
    for ch in client.chat.completions.create(model=NAME, stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        assert "<tool_call" not in (d.content or "") and "</tool_call" not in (d.content or "") \
            or "Oops" in content + (d.content or "")
        assert "think>" not in (d.content or "") and "think>" not in (getattr(d, "reasoning_content", None) or "")
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = tc.id or c["id"]
            if tc.function:
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content, reasoning, [calls[k] for k in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_full_tool_round_trip(srv, client, stream):
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    if stream:
        content, reasoning, calls, finish = stream_message(client, messages=messages, tools=TOOLS)
    else:
        r = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS)
        m = r.choices[0].message
        content, reasoning, finish = m.content, m.reasoning_content, r.choices[0].finish_reason
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in m.tool_calls]
        assert m.tool_calls[0].type == "function"
    assert finish == "tool_calls"
    assert content == "Let me check." and reasoning == "I need the weather tool."
    assert len(calls) == 1 and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert "<tools>" in srv.engine.prompts[-1] and '"name": "get_weather"' in srv.engine.prompts[-1]

    # the client runs the tool and sends the result back
    messages += [
        {"role": "assistant", "content": content, "tool_calls": [
            {"id": calls[0]["id"], "type": "function",
             "function": {"name": "get_weather", "arguments": calls[0]["arguments"]}}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": json.dumps({"temp": 21})}]
    if stream:
        content, reasoning, calls, finish = stream_message(client, messages=messages, tools=TOOLS)
    else:
        r = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS)
        m = r.choices[0].message
        content, reasoning, finish, calls = (m.content, m.reasoning_content,
                                             r.choices[0].finish_reason, m.tool_calls or [])
    assert (content, reasoning, finish, calls) == ("It is 21 °C in Paris.", "The tool says 21.",
                                                   "stop", [])
    p = srv.engine.prompts[-1]  # the model saw its own call and the tool's answer
    assert ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>') in p
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>' in p


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_several_calls_and_malformed(srv, client, stream):
    for prompt, want_content, want_args in [
        ("weather in two cities", "Checking both.", [{"city": "Paris"}, {"city": "Zürich"}]),
        ("broken call", "Oops <tool_call>\n{\"name\": get_weather}\n</tool_call>", []),
    ]:
        msgs = [{"role": "user", "content": prompt}]
        if stream:
            content, _, calls, finish = stream_message(client, messages=msgs, tools=TOOLS)
            ids = [c["id"] for c in calls]
            args = [json.loads(c["arguments"]) for c in calls]
        else:
            r = client.chat.completions.create(model=NAME, messages=msgs, tools=TOOLS)
            m, finish = r.choices[0].message, r.choices[0].finish_reason
            content = m.content
            ids = [c.id for c in m.tool_calls or []]
            args = [json.loads(c.function.arguments) for c in m.tool_calls or []]
        assert content == want_content and args == want_args
        assert len(set(ids)) == len(ids)
        assert finish == ("tool_calls" if want_args else "stop")


def test_named_tool_choice_forces_the_call(srv, client):
    r = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Anything"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content is None
    assert m.tool_calls[0].function.name == "get_weather"
    assert json.loads(m.tool_calls[0].function.arguments) == {"city": "Oslo"}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_forced_call_cut_short_returns_only_what_the_model_wrote(srv, client, stream):
    """The server writes the forced call's opening into the prompt; when the call does not complete,
    the content is the model's own text, not that opening (a fuzzing pass saw it returned)."""
    kw = dict(messages=[{"role": "user", "content": "cut short"}], tools=TOOLS,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        content, _, calls, _ = stream_message(client, **kw)
    else:
        m = client.chat.completions.create(model=NAME, **kw).choices[0].message
        content, calls = m.content, m.tool_calls or []
    assert calls == [] and content == '{"city": "Os'


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_required_tool_choice_opens_a_call(srv, client, stream):
    """tool_choice "required": the server opens the answer with a call (the model picks the function),
    after an empty think block, as the template writes one for enable_thinking=False."""
    kw = dict(messages=[{"role": "user", "content": "Anything"}], tools=TOOLS, tool_choice="required")
    if stream:
        content, reasoning, calls, finish = stream_message(client, **kw)
    else:
        r = client.chat.completions.create(model=NAME, **kw)
        m, finish = r.choices[0].message, r.choices[0].finish_reason
        content, reasoning = m.content, getattr(m, "reasoning_content", None)  # absent: none was sent
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls]
    assert srv.engine.prompts[-1].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n")
    assert '"name": "get_weather"' in srv.engine.prompts[-1]  # every tool stays offered
    assert finish == "tool_calls" and not content and not reasoning
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Rome"})]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_forced_call_then_a_malformed_block_keeps_its_text(srv, client, stream):
    """The pre-filled opening is cut only from what the parser returns first: a malformed block after a
    good call comes back verbatim (it lost its opening tag before)."""
    kw = dict(model=NAME, messages=[{"role": "user", "content": "one call then a bad one"}], tools=TOOLS,
              tool_choice="required")
    if stream:
        content, args = "", {}
        for ch in client.chat.completions.create(stream=True, **kw):
            d = ch.choices[0].delta if ch.choices else None
            content += (d and d.content) or ""
            for tc in (d and d.tool_calls) or []:
                args[tc.index] = args.get(tc.index, "") + ((tc.function and tc.function.arguments) or "")
        args = [json.loads(args[k]) for k in sorted(args)]
    else:
        m = client.chat.completions.create(**kw).choices[0].message
        content, args = m.content, [json.loads(c.function.arguments) for c in m.tool_calls]
    assert args == [{"city": "Rome"}] and content == '<tool_call>\n{"name": get_weather}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_parallel_tool_calls_false_keeps_the_first_call(srv, client, stream):
    """The response ends with the first call, and the request stops there (the tokens counted are
    fewer than those of the whole answer)."""
    kw = dict(messages=[{"role": "user", "content": "weather in two cities"}], tools=TOOLS,
              parallel_tool_calls=False)
    if stream:
        content, _, calls, finish = stream_message(client, **kw)
        args = [json.loads(c["arguments"]) for c in calls]
    else:
        r = client.chat.completions.create(model=NAME, **kw)
        m, finish = r.choices[0].message, r.choices[0].finish_reason
        content, args = m.content, [json.loads(c.function.arguments) for c in m.tool_calls]
        whole = client.chat.completions.create(model=NAME, **{**kw, "parallel_tool_calls": True})
        assert len(whole.choices[0].message.tool_calls) == 2
        assert r.usage.completion_tokens < whole.usage.completion_tokens
    assert content == "Checking both." and args == [{"city": "Paris"}] and finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_n_choices_parse_and_stop_each_on_their_own(srv, client, stream):
    """n = 2 with parallel_tool_calls=false: each choice has its own parser, ends with its own first
    call and is stopped there on its own; the request ends once both are out."""
    kw = dict(messages=[{"role": "user", "content": "weather in two cities"}], tools=TOOLS,
              parallel_tool_calls=False)
    if stream:
        per: dict = {}
        finish: dict = {}
        for ch in client.chat.completions.create(model=NAME, stream=True, n=2, **kw):
            for c in ch.choices:
                p = per.setdefault(c.index, {"content": "", "args": {}})
                p["content"] += c.delta.content or ""
                for tc in c.delta.tool_calls or []:
                    p["args"][tc.index] = p["args"].get(tc.index, "") + (tc.function.arguments or "")
                if c.finish_reason:
                    assert c.index not in finish
                    finish[c.index] = c.finish_reason
        got = [(per[i]["content"], [json.loads(a) for a in per[i]["args"].values()], finish[i]) for i in (0, 1)]
    else:
        r = client.chat.completions.create(model=NAME, n=2, **kw)
        assert [c.index for c in r.choices] == [0, 1]
        got = [(c.message.content, [json.loads(t.function.arguments) for t in c.message.tool_calls],
                c.finish_reason) for c in r.choices]
        one = client.chat.completions.create(model=NAME, **kw)
        assert r.usage.completion_tokens == 2 * one.usage.completion_tokens
        assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert got == [("Checking both.", [{"city": "Paris"}], "tool_calls")] * 2


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_n_choices_stop_apart(srv, client, stream):
    """n = 2 with parallel_tool_calls=false where choice 0 calls early and choice 1 talks on: choice 0
    is cut at its call and its engine request aborted at once (before choice 1 finishes), while
    choice 1 runs to its end; usage counts what each generated."""
    kw = dict(messages=[{"role": "user", "content": "uneven"}], tools=TOOLS, parallel_tool_calls=False)
    eng = srv.engine
    before = set(eng.aborted_at) | set(eng.finished_at)
    if stream:
        text, calls, finish, usage = {0: "", 1: ""}, {0: 0, 1: 0}, {}, None
        for ch in client.chat.completions.create(model=NAME, stream=True, n=2,
                                                 stream_options={"include_usage": True}, **kw):
            usage = ch.usage or usage
            for c in ch.choices:
                text[c.index] += c.delta.content or ""
                calls[c.index] += len(c.delta.tool_calls or [])
                if c.finish_reason:
                    assert c.index not in finish
                    finish[c.index] = c.finish_reason
        got = [(text[i], calls[i], finish[i]) for i in (0, 1)]
    else:
        r = client.chat.completions.create(model=NAME, n=2, **kw)
        usage = r.usage
        got = [(c.message.content or "", len(c.message.tool_calls or []), c.finish_reason) for c in r.choices]
    assert got == [("", 1, "tool_calls"), ("Sunny" + " y" * 150, 0, "stop")]
    ids = {rid.rsplit("-", 1)[1]: rid for rid in set(eng.aborted_at) | set(eng.finished_at) if rid not in before}
    assert eng.aborted_at[ids["0"]] < eng.finished_at[ids["1"]], (eng.aborted_at, eng.finished_at)
    one = client.chat.completions.create(model=NAME, **kw)  # choice 0 alone
    talk = "Sunny" + " y" * 150
    assert usage.completion_tokens == one.usage.completion_tokens + (len(talk) if eng.chars else len(eng.tokenizer.encode(talk)))


def test_tool_choice_none_leaves_text_alone(srv, client):
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "two cities"}],
                                       tools=TOOLS, tool_choice="none")
    assert "<tools>" not in srv.engine.prompts[-1]
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content


def test_health_is_503_once_the_engine_loop_dies():
    eng = ScriptedEngine(chars=False)
    s = RunningServer(eng, served_model_name=NAME)
    try:
        assert httpx.get(s.url + "/health", timeout=5).status_code == 200
        eng.broken = True
        assert wait_until(lambda: httpx.get(s.url + "/health", timeout=5).status_code == 503, 10)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    finally:
        s.stop()


def test_completion_text_offsets_where_a_token_is_part_of_a_character(srv, client):
    """text_offset is where each token's text starts in the returned text, counted alike with and
    without streaming: the two tokens of one character start at the same place (the non-streamed
    offsets used to sum the tokens' own strings, U+FFFD each)."""
    kw = dict(model=NAME, prompt="fraktur", max_tokens=10, logprobs=1)
    r = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    streamed = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert r.text == "a\U0001D518b" and r.logprobs.text_offset == streamed
    if not srv.engine.chars:  # a, the character's two tokens, b
        assert streamed == [0, 1, 1, 2]

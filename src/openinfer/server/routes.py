"""The OpenAI-compatible routes: how each request is read, checked, submitted and answered.

Request path: read the body (size-capped) -> JSON -> protocol validation -> prompt token ids (chat:
chat.chat_prompt) -> length checks -> one engine request per choice -> JSON or SSE response.
Every failure before the engine is an APIError (4xx); an engine failure is a 500 for the requests
it touched, never for the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import sys
import time
from time import perf_counter_ns as ns
import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..chat import ChatDelta, ChatError, ChatOutputParser, ChatPrompt, ChatTemplate, chat_prompt
from ..engine import QueueFull, RequestRejected
from ..engine import _prompt_ids as _engine_prompt_ids
from ..sampling_params import SamplingParams, choice_params
from ..tokenizer import TooManyTokens
from ..version import build_info
from .async_engine import AsyncEngine, EngineDeadError, EngineStepError
from .json_body import LongArray, loads_body
from .logprobs import chat_logprobs, completion_logprobs, logprob_rows, merge_logprobs
from .metrics import ARRIVAL, CONTENT_TYPE, Metrics, PathTrace, RequestTimer
from .protocol import APIError, bad, engine_error, internal, model_field, parse_chat, parse_completion
from .sse import DONE, CancelOnDisconnect, SSEResponse, error_event, event

log = logging.getLogger("openinfer.server")

CLOSE = {"Connection": "close"}  # the rest of the request's body is never read: the connection goes
CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it, but the access log shows it


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Any
    template: ChatTemplate | None
    model_name: str
    max_model_len: int
    vocab_size: int
    api_key: str | None
    max_body_bytes: int
    metrics: Metrics
    body_read_timeout: float = 30.0  # seconds for a whole request body (408 beyond)
    defaults: dict = field(default_factory=dict)  # sampling defaults from generation_config.json
    build: dict = field(default_factory=build_info)  # GET /version: the package's and its engine's
    created: int = field(default_factory=lambda: int(time.time()))


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body over {limit} bytes", code="request_too_large", headers=CLOSE)


if sys.version_info >= (3, 11):
    # asyncio's own timeout: ~60 us less than anyio's cancel scope on a request's path (2-vCPU VM, right
    # after a step; 6 against 16 us in a warm loop)
    _deadline = asyncio.timeout
else:
    @contextlib.asynccontextmanager
    async def _deadline(seconds: float):
        with anyio.fail_after(seconds):
            yield


async def _read_json(st: ServerState, request: Request, parse=None, trace: PathTrace | None = None,
                     max_items: int | None = None) -> Any:
    """The body as JSON (then `parse(body)`), read under the size limit and the read timeout; a body
    over the limit or late is answered (413, 408) and the rest of it never read (Connection: close).
    Parsing a large body runs off the event loop, and `parse` with it: what a handler does with a large
    body before it reaches the engine (validation, the chat template, tokenizing) goes in one hop to a
    worker thread and back, ~120 us each. `max_items`: a "prompt" of more token ids than that is left
    unparsed, a json_body.LongArray in its place."""
    limit = st.max_body_bytes
    cl = request.headers.get("content-length", "")
    if cl.isdigit() and int(cl) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    try:
        async with _deadline(st.body_read_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {st.body_read_timeout:g} s",
                       code="request_timeout", headers=CLOSE) from None
    request.state.body_bytes = size
    if trace is not None:  # the last of the body is in: what a slow client costs stays in `body`
        trace.body = ns()
    return await _off_loop(size, _parse_json, b"".join(chunks), parse, max_items)


def _parse_json(raw: bytes, parse, max_items: int | None) -> Any:
    try:  # lone surrogates refused here, once, not wherever a string is encoded later
        body = loads_body(raw, max_items)
    except ValueError as e:
        raise bad(f"request body is not valid JSON: {e}"[:300]) from None
    return body if parse is None else parse(body)


def _check_model(st: ServerState, model: str | None) -> None:
    if model is not None and model != st.model_name:
        raise APIError(404, f"The model '{model}' does not exist; this server serves "
                            f"'{st.model_name}'", param="model", code="model_not_found")


def _check_ids(st: ServerState, ids: list[int], param: str) -> list[int]:
    """The ids, checked once here: the engine takes them as they are (TokenIds)."""
    try:
        return _engine_prompt_ids(ids, st.vocab_size)
    except RequestRejected:
        raise bad(f"token ids must be in [0, {st.vocab_size})", param) from None


def _check_length(st: ServerState, n_prompt: int, max_tokens: int | None, param: str,
                  at_least: bool = False) -> None:
    """n_prompt: the prompt's tokens, or with `at_least` a lower bound on them."""
    if n_prompt == 0 and not at_least:
        raise bad("the prompt is empty after tokenization", param)
    want = n_prompt + (max_tokens or 1)
    if want > st.max_model_len:
        more = "at least " if at_least else ""
        raise bad(f"This model's maximum context length is {st.max_model_len} tokens. However, you "
                  f"requested {more}{want} tokens ({more}{n_prompt} in the prompt, {max_tokens or 1} for "
                  "the completion). Please reduce the prompt or max_tokens.", param,
                  "context_length_exceeded")


def _prompt_ids(st: ServerState, prompt: str | list[int], max_tokens: int | None, param: str) -> list[int]:
    """A prompt's token ids, checked against max_model_len. A text that cannot fit is refused from its
    length (Tokenizer.min_tokens: a 7 MB ASCII text is >= 54k tokens) before it is tokenized; one
    that may fit is tokenized until it is known not to fit."""
    if isinstance(prompt, list):  # its length first: min() and max() of 1M ids hold the GIL 20 ms
        _check_length(st, len(prompt), max_tokens, param)
        ids = _check_ids(st, prompt, param)
    else:
        _check_length(st, st.tokenizer.min_tokens(prompt), max_tokens, param, at_least=True)
        try:
            ids = st.tokenizer.encode(prompt, cap=max(0, st.max_model_len - (max_tokens or 1)))
        except TooManyTokens as e:
            _check_length(st, e.n, max_tokens, param, at_least=True)
            raise  # unreachable: more than the cap is too long
    _check_length(st, len(ids), max_tokens, param)
    return ids


async def _submit(st: ServerState, prompts: list[list[int]], params: SamplingParams, param: str,
                  trace: PathTrace | None = None):
    """One engine request per prompt; maps admission errors to 400 / 503."""
    ae = st.engine
    if len(prompts) > ae.max_waiting:  # all of them wait in the queue at once: never admitted
        raise bad(f"this request needs {len(prompts)} engine requests (prompts x n), but the waiting queue "
                  f"holds at most {ae.max_waiting} (--max-waiting-requests); send fewer prompts or a smaller n",
                  "n", "too_many_requests_in_one")
    _refuse_if_busy(ae, len(prompts))
    try:
        group = ae.new_group(trace)
    except EngineDeadError as e:
        raise APIError(503, str(e), type="server_error", code="engine_dead") from None
    try:
        await group.add(prompts, params)
    except EngineDeadError as e:
        group.close()
        raise APIError(503, str(e), type="server_error", code="engine_dead") from None
    except QueueFull as e:
        group.close()
        raise _queue_full(ae, str(e)) from None
    except (RequestRejected, ValueError) as e:
        group.close()
        raise bad(str(e), param, "request_rejected") from None
    except BaseException:
        group.close()
        raise
    return group


EARLY_DRAIN_BYTES = 64 << 10  # an unread body up to this size is read and dropped by uvicorn after an early 503


def _refuse_if_busy(ae: AsyncEngine, n: int, request: Request | None = None) -> None:
    """503 when the engine cannot take n more requests now. Called before the body is read too (n = 1,
    with the request): under overload a refusal then costs no parsing or tokenizing, and comes back at
    once. uvicorn then reads and drops a small unread body and keeps the connection; a large, chunked or
    unannounced one is not read (Connection: close), so neither the body limit nor the read timeout is
    bypassed by being refused."""
    headers = {}
    if request is not None:
        cl = request.headers.get("content-length", "")
        if not cl.isdigit() or int(cl) > EARLY_DRAIN_BYTES:
            headers = dict(CLOSE)
    if why := ae.refusing:  # shutting down, or the loop died: no body worth reading
        raise APIError(503, why, type="server_error", code="engine_dead", headers=headers)
    if not ae.healthy:
        raise APIError(503, "the engine is recovering from a failed step", type="server_error",
                       code="engine_unavailable", headers={"Retry-After": "1", **headers})
    if why := ae.busy(n):
        e = _queue_full(ae, why)
        e.headers.update(headers)
        raise e


def _queue_full(ae: AsyncEngine, why: str) -> APIError:
    return APIError(503, f"server busy: {why}", type="server_error", code="queue_full",
                    headers={"Retry-After": str(ae.retry_after())})


async def _collect(request: Request, group, on_update) -> bool:
    """Feeds every update to on_update until it returns True (the rest is aborted) or all finish;
    False (requests aborted) when the client went away."""
    try:
        async with CancelOnDisconnect(request.receive) as watch:
            async for idx, u in group.updates():
                if on_update(idx, u):
                    break
    finally:
        group.close()
    return not watch.gone


def _state(request: Request) -> ServerState:
    return request.app.state.openinfer


def _auth(st: ServerState, request: Request) -> None:
    if st.api_key is None:
        return
    h = request.headers.get("authorization", "")
    key = h[7:].strip() if h[:7].lower() == "bearer " else ""
    if not hmac.compare_digest(key.encode(), st.api_key.encode()):
        raise APIError(401, "Incorrect or missing API key (send 'Authorization: Bearer <key>')",
                       code="invalid_api_key", headers=CLOSE)


def _route(fn, authed: bool = True):
    """Wraps a handler: auth, APIError -> OpenAI error JSON, anything else -> logged 500."""
    async def handler(request: Request) -> Response:
        st = _state(request)
        try:
            if authed:
                _auth(st, request)
            return await fn(st, request)
        except APIError as e:
            return _error(e)
        except ChatError as e:
            return _error(bad(str(e), e.param))
        except EngineStepError as e:
            return _error(engine_error(e))
        except ClientDisconnect:  # gone while sending its body: nobody to answer
            return Response(status_code=CLIENT_GONE)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("unhandled error in %s", request.url.path)
            return _error(internal(f"internal error: {type(e).__name__}"))
    return handler


async def health(st: ServerState, request: Request) -> Response:
    if not st.engine.alive:
        return JSONResponse({"status": "engine loop not running"}, status_code=503)
    if not st.engine.healthy:
        return JSONResponse({"status": "recovering from a failed step"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def index(st: ServerState, request: Request) -> Response:
    """What a browser or a curl at the server's root finds: the version and the routes."""
    served = sorted((r.path, m) for r in request.app.routes for m in r.methods - {"HEAD"})
    return JSONResponse({"name": "openinfer", "version": st.build["version"],
                         "routes": [f"{m} {path}" for path, m in served]})


async def version(st: ServerState, request: Request) -> Response:
    return JSONResponse(st.build)


async def metrics(st: ServerState, request: Request) -> Response:
    return Response(st.metrics.render(), media_type=CONTENT_TYPE)


def _model_card(st: ServerState) -> dict:
    return {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "openinfer",
            "max_model_len": st.max_model_len}


async def list_models(st: ServerState, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(st)]})


async def get_model(st: ServerState, request: Request) -> Response:
    _check_model(st, request.path_params["model"])
    return JSONResponse(_model_card(st))


# Bodies up to this size are rendered and tokenized on the event loop: a worker thread is one more
# thread contending for the GIL with the engine loop, and at concurrency 64 (1k-token prompts) that
# left the GPU idle 11% of the time against 5% inline (docs/benchmarks.md).
_INLINE_BYTES = 1 << 15


async def _off_loop(size: int, fn, *args):
    """fn(*args), in a worker thread when `size` (the input's bytes or characters) is over _INLINE_BYTES:
    rendering and tokenizing a large body takes seconds, during which the event loop would answer
    nothing else (/health included)."""
    if size <= _INLINE_BYTES:
        return fn(*args)
    return await anyio.to_thread.run_sync(fn, *args)


async def tokenize(st: ServerState, request: Request) -> Response:
    body = await _read_json(st, request)
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _check_model(st, model_field(body))
    if "messages" in body:
        req = parse_chat({k: v for k, v in body.items() if k in (
            "messages", "tools", "tool_choice", "chat_template_kwargs", "add_generation_prompt")})
        text = (await _off_loop(request.state.body_bytes, _chat_prompt, st, req)).text
    elif isinstance(body.get("prompt"), str):
        text = body["prompt"]
    else:
        raise bad("'prompt' (a string) or 'messages' is required", "prompt")
    ids = await _off_loop(len(text), st.tokenizer.encode, text)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": st.max_model_len})


async def detokenize(st: ServerState, request: Request) -> Response:
    body = await _read_json(st, request)
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _check_model(st, model_field(body))
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad("'tokens' must be a list of token ids", "tokens")
    _check_ids(st, ids, "tokens")
    return JSONResponse({"prompt": await _off_loop(request.state.body_bytes, st.tokenizer.decode, ids, False)})


def _trace(request: Request, endpoint: str) -> PathTrace:
    """The request's path trace, from its arrival (app.py stamps it as the app's first code) to the
    handler's first line, here: what lies between is routing, the Request and the auth check."""
    t = ns()
    tr = PathTrace(endpoint, request.scope.get(ARRIVAL) or t)
    tr.handler = t
    return tr


# JSONResponse's rendering (compact, UTF-8, no NaN) with an encoder built once, not per response.
_RENDER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


class _Answer(JSONResponse):
    """A non-streamed answer (its body rendered): its bytes are the first token's."""

    def __init__(self, content: Any, st: ServerState, trace: PathTrace):
        super().__init__(content)
        self._st, self._trace = st, trace

    def render(self, content: Any) -> bytes:
        return _RENDER(content).encode("utf-8")

    async def __call__(self, scope, receive, send) -> None:
        self._trace.sending()
        await super().__call__(scope, receive, send)
        self._st.metrics.path.observe(self._trace)
        self._st.metrics.flush()  # its latencies too, now that its bytes are out


def _on_close(st: ServerState, group, trace: PathTrace):
    """A stream's end: its requests aborted if unfinished, its trace and latencies observed (after the
    stream, so that no chunk waits for them)."""
    def close():
        group.close()
        st.metrics.path.observe(trace)
        st.metrics.flush()
    return close


def _usage(n_prompt: int, n_gen: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}


async def completions(st: ServerState, request: Request) -> Response:
    trace = _trace(request, "completions")
    t0 = trace.handler * 1e-9  # perf_counter()'s clock

    def prepare(body):  # where the body is read: off the event loop for a large one (many small prompts too)
        if isinstance(body, dict) and isinstance(long := body.get("prompt"), LongArray):
            _check_model(st, model_field(body))
            raise bad(f"This model's maximum context length is {st.max_model_len} tokens. However, the prompt "
                      f"has {long.n} token ids. Please reduce the prompt.", "prompt", "context_length_exceeded")
        req = parse_completion(body, st.defaults)
        trace.parsed = ns()  # JSON and the protocol's checks: a request now, not bytes
        _check_model(st, req.model)
        prompts = [_prompt_ids(st, p, req.gen.sampling.max_tokens, "prompt") for p in req.prompts]
        trace.tokenized = ns()  # every prompt's ids, checked against max_model_len: ready for the engine
        return req, prompts

    _refuse_if_busy(st.engine, 1, request)
    req, prompts = await _read_json(st, request, prepare, trace, st.max_model_len)
    trace.stream = req.gen.stream
    n_prompt = sum(len(p) for p in prompts)  # counted once per prompt, whatever n
    # choice i * n + j is prompt i's j-th sample, as OpenAI orders them
    per = choice_params(req.gen.sampling, req.gen.n)
    prompts = [p for p in prompts for _ in range(req.gen.n)]
    group = await _submit(st, prompts, per * (len(prompts) // req.gen.n), "prompt", trace)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    timers = [RequestTimer(st.metrics, t0) for _ in prompts]
    want_lp = req.gen.sampling.logprobs is not None

    def chunk(choices, usage=None):
        c = {"id": rid, "object": "text_completion", "created": created, "model": st.model_name,
             "choices": choices}
        if req.gen.include_usage:
            c["usage"] = usage
        return c

    if req.gen.stream:
        async def events():
            n_gen, offsets = 0, [0] * len(prompts)
            try:
                async for idx, u in group.updates():
                    t = ns()
                    trace.got(t)
                    timers[idx].tokens_arrived(len(u.new_token_ids), t * 1e-9)
                    n_gen += len(u.new_token_ids)
                    rows = logprob_rows(u) if want_lp else []
                    if u.new_text or rows or u.finished:
                        lp = completion_logprobs(st.tokenizer, rows, offsets[idx]) if want_lp else None
                        offsets[idx] += len(u.new_text)
                        ev = event(chunk([{"index": idx, "text": u.new_text, "logprobs": lp,
                                           "finish_reason": u.finish_reason if u.finished else None}]))
                        trace.sending()
                        yield ev
                    if u.finished:
                        timers[idx].finish()
                if req.gen.include_usage:
                    yield event(chunk([], _usage(n_prompt, n_gen)))
            except Exception as e:
                yield error_event(e)
            yield DONE
        return SSEResponse(events(), _on_close(st, group, trace))

    texts = [[] for _ in prompts]
    ntok = [0] * len(prompts)
    lps = [[] for _ in prompts]  # per update, offsets counted as the stream counts them
    textlen = [0] * len(prompts)
    finish = [None] * len(prompts)

    def on_update(idx, u):
        t = ns()
        trace.got(t)
        timers[idx].tokens_arrived(len(u.new_token_ids), t * 1e-9)
        texts[idx].append(u.new_text)
        ntok[idx] += len(u.new_token_ids)
        if want_lp:
            lps[idx].append(completion_logprobs(st.tokenizer, logprob_rows(u), textlen[idx]))
        textlen[idx] += len(u.new_text)
        if u.finished:
            finish[idx] = u.finish_reason
            timers[idx].finish()

    if not await _collect(request, group, on_update):
        return Response(status_code=CLIENT_GONE)
    choices = [{"index": i, "text": "".join(texts[i]),
                "logprobs": merge_logprobs(lps[i]) if want_lp else None,
                "finish_reason": finish[i]} for i in range(len(prompts))]
    return _Answer({"id": rid, "object": "text_completion", "created": created,
                    "model": st.model_name, "choices": choices,
                    "usage": _usage(n_prompt, sum(ntok))}, st, trace)


def _delta_json(d, tool_index: int) -> tuple[dict, int]:
    out: dict = {}
    if d.reasoning:
        out["reasoning_content"] = d.reasoning
    if d.content:
        out["content"] = d.content
    if d.tool_calls:
        out["tool_calls"] = []
        for c in d.tool_calls:
            out["tool_calls"].append({"index": tool_index, **c.to_openai()})
            tool_index += 1
    return out, tool_index


def _chat_prompt(st: ServerState, req) -> ChatPrompt:
    if st.template is None:
        raise bad("this model has no chat template; use /v1/completions", "messages")
    return chat_prompt(st.template, req.messages, req.tools, req.tool_choice, req.named_tool,
                       add_generation_prompt=req.add_generation_prompt,
                       enable_thinking=req.enable_thinking, template_kwargs=req.template_kwargs)


class _ChatChoice:
    """One choice of a chat completion: its output parser and what it produced."""

    def __init__(self, parser: ChatOutputParser):
        self.parser = parser
        self.tool_index = 0  # tool calls streamed so far
        self.got: list[ChatDelta] = []  # non-streamed: the parser's output per update
        self.rows: list = []  # non-streamed: logprob rows
        self.finish: str | None = None

    def message(self, index: int, tok, want_lp: bool) -> dict:
        """The non-streamed choice."""
        d = ChatDelta()
        for g in self.got + [self.parser.finish()]:
            d = d.join(g)
        message: dict = {"role": "assistant",
                         "content": d.content if (d.content and (d.content.strip() or not d.tool_calls))
                         else None}
        if d.reasoning:
            message["reasoning_content"] = d.reasoning
        if d.tool_calls:
            message["tool_calls"] = [c.to_openai() for c in d.tool_calls]
        return {"index": index, "message": message, "finish_reason": self.parser.finish_reason(self.finish),
                "logprobs": {"content": chat_logprobs(tok, self.rows)} if want_lp else None}


async def chat_completions(st: ServerState, request: Request) -> Response:
    trace = _trace(request, "chat_completions")
    t0 = trace.handler * 1e-9  # perf_counter()'s clock

    def prepare(body):  # where the body is read: off the event loop for a large one
        req = parse_chat(body, st.defaults)
        trace.parsed = ns()
        _check_model(st, req.model)
        prompt = _chat_prompt(st, req)
        trace.templated = ns()  # the prompt's text (jinja2): apart from tokenizing, which completions share
        ids = _prompt_ids(st, prompt.text, req.gen.sampling.max_tokens, "messages")
        trace.tokenized = ns()  # its ids, checked against max_model_len: ready for the engine
        return req, prompt, ids

    _refuse_if_busy(st.engine, 1, request)
    req, prompt, ids = await _read_json(st, request, prepare, trace)
    trace.stream = req.gen.stream
    n = req.gen.n
    group = await _submit(st, [ids] * n, choice_params(req.gen.sampling, n), "messages", trace)
    choices = [_ChatChoice(prompt.parser(req.parallel_tool_calls)) for _ in range(n)]
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    timers = [RequestTimer(st.metrics, t0) for _ in range(n)]
    want_lp = req.gen.sampling.logprobs is not None

    if req.gen.stream:
        def chunk(i, delta, fr=None, lp=None, usage=None, choices=True):
            c = {"id": rid, "object": "chat.completion.chunk", "created": created,
                 "model": st.model_name,
                 "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": fr}]
                 if choices else []}
            if req.gen.include_usage:
                c["usage"] = usage
            return c

        async def events():
            n_gen = 0
            try:
                for i in range(n):
                    yield event(chunk(i, {"role": "assistant", "content": ""}))
                async for i, u in group.updates():
                    c = choices[i]
                    t = ns()
                    trace.got(t)
                    timers[i].tokens_arrived(len(u.new_token_ids), t * 1e-9)
                    n_gen += len(u.new_token_ids)
                    delta, c.tool_index = _delta_json(c.parser.feed(u.new_text), c.tool_index)
                    done = u.finished or c.parser.capped  # capped: the one call allowed is out
                    if done:
                        tail, c.tool_index = _delta_json(c.parser.finish(), c.tool_index)
                        for k, v in tail.items():
                            delta[k] = delta[k] + v if k in delta else v
                    rows = logprob_rows(u) if want_lp else []
                    lp = {"content": chat_logprobs(st.tokenizer, rows)} if rows else None
                    if delta or lp:
                        ev = event(chunk(i, delta, lp=lp))
                        trace.sending()
                        yield ev
                    if done:
                        timers[i].finish()
                        ev = event(chunk(i, {}, fr=c.parser.finish_reason(u.finish_reason if u.finished else "stop")))
                        trace.sending()
                        yield ev
                        group.abort(i)  # capped: what the model would still write is not wanted
                if req.gen.include_usage:
                    yield event(chunk(0, None, usage=_usage(len(ids), n_gen), choices=False))
            except Exception as e:
                yield error_event(e)
            yield DONE
        return SSEResponse(events(), _on_close(st, group, trace))

    n_gen = 0

    def on_update(i, u) -> bool:
        nonlocal n_gen
        c = choices[i]
        t = ns()
        trace.got(t)
        timers[i].tokens_arrived(len(u.new_token_ids), t * 1e-9)
        c.got.append(c.parser.feed(u.new_text))
        n_gen += len(u.new_token_ids)
        if want_lp:
            c.rows.extend(logprob_rows(u))
        if u.finished or c.parser.capped:  # capped: the one call allowed is out, the rest is aborted
            c.finish = u.finish_reason if u.finished else "stop"
            timers[i].finish()
            group.abort(i)
        return False

    if not await _collect(request, group, on_update):
        return Response(status_code=CLIENT_GONE)
    return _Answer({"id": rid, "object": "chat.completion", "created": created,
                    "model": st.model_name,
                    "choices": [c.message(i, st.tokenizer, want_lp) for i, c in enumerate(choices)],
                    "usage": _usage(len(ids), n_gen)}, st, trace)


async def http_error(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return _error(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                           code=code))


def routes() -> list[Route]:
    return [
        Route("/", _route(index, authed=False), methods=["GET"]),
        Route("/version", _route(version, authed=False), methods=["GET"]),
        Route("/health", _route(health, authed=False), methods=["GET"]),
        Route("/metrics", _route(metrics, authed=False), methods=["GET"]),
        Route("/v1/models", _route(list_models), methods=["GET"]),
        Route("/v1/models/{model:path}", _route(get_model), methods=["GET"]),
        Route("/v1/completions", _route(completions), methods=["POST"]),
        Route("/v1/chat/completions", _route(chat_completions), methods=["POST"]),
        Route("/tokenize", _route(tokenize), methods=["POST"]),
        Route("/detokenize", _route(detokenize), methods=["POST"]),
    ]

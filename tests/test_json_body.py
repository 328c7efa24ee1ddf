"""server/json_body.loads_body: the same value, or the same refusal, as loads_text_json for any body,
with pieces small enough that every cut rule (UTF-8 sequences, escapes, surrogate pairs, commas of a
flat array) is exercised; and a large body holds the GIL in short pieces only."""

import json
import threading
import time
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openinfer.chat import loads_text_json
from openinfer.server import json_body


@contextmanager
def piece(n):
    old, json_body._PIECE = json_body._PIECE, n
    try:
        yield
    finally:
        json_body._PIECE = old


def outcome(fn, raw):
    try:
        return "ok", json.dumps(fn(raw))  # type-exact: 1 and 1.0 differ here
    except ValueError:
        return "refused", None


def same(raw, n):
    with piece(n):
        got = outcome(json_body.loads_body, raw)
    assert got == outcome(loads_text_json, raw), raw


texts = st.text(st.characters(codec="utf-8") | st.sampled_from(["\\", '"', "😀", "é", "数", "\n"]),
                max_size=40)
scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False) | texts
docs = st.recursive(scalars, lambda c: st.lists(c, max_size=6) | st.dictionaries(texts, c, max_size=4), max_leaves=30)
flat = st.lists(st.integers(0, 151935) | st.booleans() | st.none() | st.floats(-1e6, 1e6), max_size=60)


@settings(max_examples=400, deadline=None)
@given(docs, st.booleans(), st.integers(2, 9), st.data())
def test_any_body_parses_as_json_does(doc, ascii, n, data):
    raw = json.dumps(doc, ensure_ascii=ascii, separators=data.draw(st.sampled_from([(",", ":"), (", ", ": ")]))).encode()
    same(raw, n)
    if raw:  # and every corruption is refused alike (or accepted alike)
        i = data.draw(st.integers(0, len(raw) - 1))
        b = data.draw(st.sampled_from([b"", b",", b"\\", b'"', b"]", b"\xed", b"\xe6", b"\x01", b"\\ud800", b" "]))
        same(raw[:i] + b + raw[i + 1:], n)
        same(raw[:i] + b + raw[i:], n)


@settings(max_examples=200, deadline=None)
@given(flat, st.integers(2, 9), st.sampled_from([",", ", ", " ,", "\n,\t"]))
def test_flat_arrays_cut_at_commas(items, n, sep):
    raw = ("{\"prompt\": [" + sep.join(json.dumps(x) for x in items) + "], \"max_tokens\": 3}").encode()
    same(raw, n)
    for bad in (raw.replace(b"]", b",]", 1), raw.replace(b"[", b"[,", 1), raw.replace(sep.encode(), sep.encode() * 2, 1)):
        same(bad, n)


@pytest.mark.parametrize("raw", [
    '{"p": "' + "\\ud83d\\ude00" * 50 + '"}',  # a surrogate pair at every possible cut
    '{"p": "' + "\\\\" * 100 + '"}',  # escaped backslashes: no cut is safe
    '{"p": "' + "\\ud83d" * 30 + '"}',  # lone high surrogates
    '{"p": "' + "a\\ude00" * 30 + '"}',  # lone low ones
    '{"p": "' + "数据é" * 40 + '", "q": [' + ",".join(["7"] * 80) + ']}',
    '["' + "x" * 90 + '", ' + '"' + "y" * 90 + '"]',  # long strings as neighbours
    '{"' + "k" * 90 + '": 1}',  # a long key
    '{"p": "' + "x" * 90,  # unterminated
    '[' + "1" * 90 + ']',  # one number longer than a piece
])
def test_awkward_bodies(raw):
    for n in range(2, 12):
        same(raw.encode(), n)
    same(raw.encode("utf-16"), 4)  # another encoding (with its BOM): json's own detection


def test_large_bodies_hold_the_gil_in_short_pieces():
    """The longest wait of another thread for the GIL while a 7 MB text and a 1M-id list are parsed
    (json.loads: 10 ms and 50 ms on a fast core). The interpreter hands the GIL over every 5 ms."""
    bodies = [json.dumps({"prompt": "réseau 数据 " * 460_000}, ensure_ascii=False).encode(),
              json.dumps({"prompt": list(range(1_000_000))}).encode()]
    for raw in bodies:
        assert json_body.loads_body(raw) == loads_text_json(raw)
        waits, done = [], threading.Event()

        def probe():
            while not done.is_set():
                t = time.perf_counter()
                time.sleep(0.0005)
                waits.append(time.perf_counter() - t)

        th = threading.Thread(target=probe)
        th.start()
        t0 = time.perf_counter()
        json_body.loads_body(raw)
        wall = time.perf_counter() - t0
        done.set()
        th.join()
        # a parse in one call would leave the probe one wait as long as the parse itself
        assert max(waits) < max(0.5 * wall, 0.012), (max(waits), wall)


def test_a_prompt_past_max_items_is_left_unparsed():
    raw = json.dumps({"prompt": list(range(40_000)), "max_tokens": 4}).encode()
    got = json_body.loads_body(raw, max_items=32_768)
    assert isinstance(got["prompt"], json_body.LongArray) and got["prompt"].n == 40_000 and got["max_tokens"] == 4
    assert json_body.loads_body(raw, max_items=40_000) == json.loads(raw)  # at the bound: parsed
    ids = json.dumps(list(range(40_000))).encode()
    for raw in (json.dumps({"prompt": [list(range(30_000))] * 2}).encode(),  # each list on its own
                b'{"prompt": "hi", "vector": ' + ids + b'}',  # not the prompt: parsed (and ignored later)
                b'{"prompt": ' + ids + b', "prompt": "hi"}',  # a later key wins, as in json
                b'{"x\\"prompt": ' + ids + b'}',  # a key that only ends in "prompt"
                ids):
        assert json_body.loads_body(raw, max_items=32_768) == json.loads(raw), raw[:40]


@pytest.mark.parametrize("raw", [
    b'{"a": 1, [' + b" " * 40 + b']: 1}',  # an array where a key belongs: refused, not a 500
    b'{"x": {[' + b"0," * 30 + b'0]: 1}, "x": 2, "p": "' + b"x" * 40 + b'"}',  # ... even in a dropped value
    b'[' * 500 + b'"' + b"x" * 40 + b'"' + b']' * 500,  # as deep as json goes
    b'{"p": "hi", "x": "' + b"y" * 40 + b'\\udc00", "x": 1}',  # a lone surrogate in a dropped value
    b'{"' + b"k" * 40 + b'": "' + b"v" * 40 + b'"}',  # a long key
    b'{"p": "' + b"\n" * 60 + b'"}',  # escapes back to back: no place to cut
    b'{"p": "' + b"\\" * 60 + b'"}',
    # a cut value's placeholder is a number: what touches it must not join it (hypothesis, 2026-12-07)
    b'[null,false,"\\u001f\\u0007"0]',
    b'["' + b"x" * 40 + b'"0]', b'[-"' + b"x" * 40 + b'"]', b'["' + b"x" * 40 + b'".5]',
    b'["' + b"x" * 40 + b'"e3]', b'["' + b"x" * 40 + b'""' + b"y" * 40 + b'"]',
    b'[[' + b"1," * 40 + b'1]0]', b'[-[' + b"1," * 40 + b'1]]',
])
def test_what_a_review_found(raw):
    for n in (4, 8, 16):
        same(raw, n)


def test_no_quadratic_walks():
    """Nested short arrays and back-to-back escapes cost what json.loads costs, within a small factor."""
    import time
    for raw in (json.dumps({"prompt": [[1]] * 200_000}).encode(), json.dumps({"p": "\n" * 400_000}).encode(),
                json.dumps({"p": [[i % 1000, 7, 9] for i in range(100_000)]}).encode()):
        t0 = time.perf_counter()
        json.loads(raw)
        t1 = time.perf_counter()
        json_body.loads_body(raw, max_items=32_768)
        t2 = time.perf_counter()
        assert t2 - t1 < 10 * (t1 - t0) + 0.05, (t2 - t1, t1 - t0)


def _loads_per_call(raw, finite=False):
    """loads_text_json as it was written before its decoders were built once: json.loads with the hooks."""
    from openinfer.chat import _finite_float, _reject_constant
    value = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float if finite else None)
    if not isinstance(raw, bytes) or b"\\u" in raw or b"\xed" in raw:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    return value


@settings(max_examples=300, deadline=None)
@given(docs, st.booleans(), st.booleans(), st.booleans(), st.data())
def test_built_once_decoders_read_as_json_loads(doc, ascii, finite, as_text, data):
    raw = json.dumps(doc, ensure_ascii=ascii)
    raw = raw if as_text else raw.encode(data.draw(st.sampled_from(["utf-8", "utf-16", "utf-32", "utf-8-sig"])))
    if raw:
        i = data.draw(st.integers(0, len(raw) - 1))
        b = data.draw(st.sampled_from(["", "\ufeff", "1e999", "NaN", "\\ud800", "]"]))
        raw = raw[:i] + (b if as_text else b.encode()) + raw[i:]
    assert outcome(lambda r: loads_text_json(r, finite), raw) == outcome(lambda r: _loads_per_call(r, finite), raw)

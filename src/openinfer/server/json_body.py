"""Large JSON request bodies, parsed in bounded pieces.

json.loads is one C call that holds the GIL to the end: 7 MB of text takes 10-15 ms on a fast core
(three times that on a 2-core CI runner) and a million-id token list over 50 ms, all that time the
event loop, /health included, waits. What makes a body large is a few long values (a prompt, a
message's content, a token-id list), so loads_body cuts those out of the body, decodes each in
pieces of _PIECE bytes (a Python loop between the pieces, where other threads get the GIL), parses
what is left with a number in place of each (an int no client can guess, and a number, so that
json still refuses one where a key belongs) and puts them back. Same result and same refusals as
loads_text_json(raw); only the position in a syntax error's message is counted differently.
Bodies made of many short values are parsed in one call, as before.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from ..chat import loads_text_json

_PIECE = 1 << 17  # bytes per json.loads call: ~0.3 ms of a 7 MB body
_SEEK = 256  # bytes searched past a piece's end for a place to cut a string; else the rest in one call
_CONT = range(0x80, 0xC0)  # UTF-8 continuation bytes: never cut before one
_HIGH = b"dD"  # \uD800-\uDBFF (high surrogates) start with \uD8..\uDB
_HIGH2 = b"89abAB"
_KEY_AFTER = re.compile(rb"[ \t\r\n]*:")  # what follows a string that is an object's key
_PROMPT_BEFORE = re.compile(rb'(?<!\\)"prompt"[ \t\r\n]*:[ \t\r\n]*$')


class LongArray:
    """What loads_body leaves unparsed in place of a "prompt" key's flat array of `n` elements."""

    def __init__(self, n: int):
        self.n = n


def loads_body(raw: bytes, max_items: int | None = None) -> Any:
    """loads_text_json(raw), holding the GIL for at most one _PIECE-sized parse at a time. With
    `max_items`, a long flat array that is the value of a "prompt" key and has more elements than
    that is not parsed: a LongArray stands in its place (its elements counted by its commas, a million
    ids in 2 ms instead of 70), for the caller to refuse once it has checked what comes first."""
    if len(raw) <= 2 * _PIECE or json.detect_encoding(raw[:4]) != "utf-8":  # UTF-16 or -32, or a BOM
        return loads_text_json(raw)
    # A value longer than 2 pieces leaves a whole aligned piece without a quote: none, nothing to cut.
    if all(raw.find(b'"', i, i + _PIECE) >= 0 for i in range(0, len(raw) - _PIECE, _PIECE)):
        return loads_text_json(raw)
    cuts = _Cuts(raw)
    free = 0  # raw[free:] starts outside any string
    while True:
        q = raw.find(b'"', free)
        stop = len(raw) if q < 0 else q
        if stop - free > _PIECE:  # a long run between strings: maybe a flat array (token ids)
            _cut_arrays(raw, free, stop, cuts, max_items)
        if q < 0:
            break
        end = _string_end(raw, q)
        if end < 0:  # unterminated: let json say so
            return loads_text_json(raw)
        if end - q > _PIECE and not _KEY_AFTER.match(raw, end + 1):  # a key stays where it is
            text, check = _long_string(raw, q + 1, end)
            key = cuts.take(q, end + 1, text)
            if check:
                cuts.checks.add(key)
        free = end + 1
    if not cuts.values:
        return loads_text_json(raw)
    cuts.out.append(raw[cuts.last:])
    return _put_back(loads_text_json(b"".join(cuts.out)), cuts.values, cuts.checks)


class _Cuts:
    """The body with its long values cut out: `out` (the parts kept, each cut value's placeholder in its
    place) up to raw[last:], and the values by placeholder."""

    def __init__(self, raw: bytes):
        self.raw, self.out, self.last = raw, [], 0
        self.values, self.checks = {}, set()  # checks: the strings to check for lone surrogates
        self.base = 10 ** 30 + secrets.randbits(96)  # the placeholders: base, base + 1, ...

    def take(self, start: int, end: int, value) -> int:
        """raw[start:end] is `value`: its placeholder goes in its place."""
        key = self.base + len(self.values)
        self.values[key] = value
        # spaced: a digit, "-", "." or "e" beside the cut value (or another placeholder) must not join the number
        self.out += (self.raw[self.last:start], b" %d " % key)
        self.last = end
        return key


def _string_end(raw: bytes, q: int) -> int:
    """The index of the quote closing the string opened at raw[q], or -1."""
    j = q
    while True:
        j = raw.find(b'"', j + 1)
        if j < 0:
            return -1
        k = j
        while raw[k - 1] == 0x5C:  # a quote after an odd run of backslashes is escaped
            k -= 1
        if (j - k) % 2 == 0:
            return j


def _long_string(raw: bytes, a: int, b: int) -> tuple[str, bool]:
    """The JSON string raw[a:b] (its text between the quotes), decoded _PIECE bytes at a time, and
    whether it may hold a lone surrogate (checked once it is known to be in the result: json lets one
    through in a value a duplicate key drops). A cut never falls inside a UTF-8 sequence or an escape,
    nor between the two escapes of a surrogate pair (each half alone would be a lone surrogate)."""
    parts, check = [], False
    while a < b:
        p = min(a + _PIECE, b)
        seek = min(p + _SEEK, b)
        while p < seek and not _cut_ok(raw, p, a):
            p += 1
        if p == seek:  # no place to cut near the piece's end (escapes back to back): the rest at once
            p = b
        piece = raw[a:p]
        check = check or b"\\u" in piece or b"\xed" in piece
        try:
            parts.append(json.loads(b'"' + piece + b'"'))
        except ValueError as e:
            raise ValueError(f"{getattr(e, 'msg', e)} (byte {a - 1 + getattr(e, 'pos', 0)})") from None
        a = p
    return "".join(parts), check


def _cut_ok(raw: bytes, p: int, a: int) -> bool:
    """Whether the string whose text starts at raw[a] may be cut before raw[p]."""
    if raw[p] in _CONT or 0x5C in raw[max(a, p - 5):p]:  # escapes are at most 6 bytes: \uXXXX
        return False
    return p - 6 < a or not (raw[p - 6] == 0x5C and raw[p - 5] == 0x75 and raw[p - 4] in _HIGH
                             and raw[p - 3] in _HIGH2)


def _cut_arrays(raw: bytes, a: int, b: int, cuts: _Cuts, max_items: int | None) -> None:
    """Cuts each long flat array (numbers and literals, no strings or nesting: a token-id list) out of
    raw[a:b], which holds no string."""
    # a flat array over 2 pieces leaves an aligned piece with no bracket: none, nothing to cut (and no
    # walk over a million short arrays)
    if all(raw.find(b"[", w, w + _PIECE) >= 0 or raw.find(b"]", w, w + _PIECE) >= 0
           for w in range(a, b - _PIECE, _PIECE)):
        return
    nxt = dict.fromkeys(b"[]{}", -2)  # each bracket's next position found so far (-1: none left)

    def next_of(c: int, i: int) -> int:  # each find resumes past the last: one pass over raw[a:b] in all
        if 0 <= nxt[c] < i or nxt[c] == -2:
            nxt[c] = raw.find(bytes((c,)), i, b)
        return nxt[c]

    i = a
    while (i := next_of(0x5B, i)) >= 0:
        j = min((x for x in (next_of(c, i + 1) for c in b"[]{}") if x >= 0), default=-1)
        if j < 0:
            break
        if raw[j] == 0x5D and j - i > _PIECE:  # "]": raw[i:j] holds scalars alone
            long = (max_items is not None and _PROMPT_BEFORE.search(raw, max(a - 16, 0), i)
                    and (n := raw.count(b",", i, j) + 1) > max_items)
            cuts.take(i, j + 1, LongArray(n) if long else _flat_array(raw, i + 1, j))
        i = j


def _flat_array(raw: bytes, a: int, b: int) -> list:
    """The elements of the flat JSON array whose text between the brackets is raw[a:b], about _PIECE
    bytes at a time, cut at commas (each piece must hold a value: "[1,]" is refused as json does)."""
    items = []
    while True:
        p = b if b - a <= _PIECE else raw.rfind(b",", a, a + _PIECE)
        if p < a:  # no comma in a piece's length: one scalar that long (json refuses it)
            p = b
        piece = raw[a:p]
        if (p < b or items) and not piece.strip():
            raise ValueError(f"Expecting value (byte {p})")
        try:
            items += loads_text_json(b"[" + piece + b"]")
        except ValueError as e:
            raise ValueError(f"{getattr(e, 'msg', e)} (byte {a - 1 + getattr(e, 'pos', 0)})") from None
        if p == b:
            return items
        a = p + 1


def _put_back(value: Any, values: dict, checks: set) -> Any:
    """`value` with each placeholder int replaced by its string or list (in place, without recursion:
    a body may nest as deep as json allows)."""
    def sub(v):
        if type(v) is int and v in values:
            if v in checks:
                _check_text(values[v])
            return values[v]
        if isinstance(v, (list, dict)):
            stack.append(v)
        return v

    stack = []
    value = sub(value)
    while stack:
        c = stack.pop()
        if isinstance(c, list):
            for i, v in enumerate(c):
                c[i] = sub(v)
        else:
            for k, v in c.items():
                c[k] = sub(v)
    return value


def _check_text(s: str) -> None:
    """ValueError for a lone surrogate (no UTF-8 text can carry one), as loads_text_json refuses it."""
    for i in range(0, len(s), _PIECE):  # a str holds no surrogate pairs (json joins them): any cut will do
        s[i:i + _PIECE].encode("utf-8")

"""Large JSON request bodies, parsed in bounded pieces.

json.loads is one C call that holds the GIL to the end: 7 MB of text takes 10-15 ms on a fast core
(three times that on a 2-core CI runner) and a million-id token list over 50 ms, all that time the
event loop, /health included, waits. What makes a body large is a few long values (a prompt, a
message's content, a token-id list), so loads_body cuts those out of the body, decodes each in
pieces of _PIECE bytes (a Python loop between the pieces, where other threads get the GIL), parses
what is left with them as placeholders and puts them back. Same result and same refusals as
loads_text_json(raw); only the position in a syntax error's message is counted differently.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from ..chat import loads_text_json

_PIECE = 1 << 17  # bytes per json.loads call: ~0.3 ms of a 7 MB body
_CONT = range(0x80, 0xC0)  # UTF-8 continuation bytes: never cut before one
_HIGH = b"dD"  # \uD800-\uDBFF (high surrogates) start with \uD8..\uDB
_HIGH2 = b"89abAB"


class LongArray(ValueError):
    """A flat array of more than loads_body's max_items elements (`n` of them), refused unparsed."""

    def __init__(self, n: int):
        super().__init__(f"an array of {n} numbers")
        self.n = n


def loads_body(raw: bytes, max_items: int | None = None) -> Any:
    """loads_text_json(raw), holding the GIL for at most one _PIECE-sized parse at a time. With
    `max_items`, a long flat array (token ids) of more elements than that raises LongArray before it
    is parsed (counted by its commas: a million ids in 2 ms, not 70)."""
    if len(raw) <= 2 * _PIECE or json.detect_encoding(raw[:4]) != "utf-8":  # UTF-16 or -32, or a BOM
        return loads_text_json(raw)
    nonce = secrets.token_hex(8)  # a placeholder no client can write on purpose
    out, values = [], {}
    last = free = 0  # raw[last:] is not in `out` yet; raw[free:] starts outside any string
    while True:
        q = raw.find(b'"', free)
        stop = len(raw) if q < 0 else q
        if stop - free > _PIECE:  # a long run between strings: maybe a flat array (token ids)
            last = _cut_arrays(raw, free, stop, last, out, values, nonce, max_items)
        if q < 0:
            break
        end = _string_end(raw, q)
        if end < 0:  # unterminated: let json say so
            return loads_text_json(raw)
        if end - q > _PIECE:
            out.append(raw[last:q])
            values[key := f"{nonce}s{len(values)}"] = _long_string(raw, q + 1, end)
            out.append(b'"' + key.encode() + b'"')
            last = end + 1
        free = end + 1
    if not values:
        return loads_text_json(raw)
    out.append(raw[last:])
    try:
        return _put_back(loads_text_json(b"".join(out)), values)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


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


def _long_string(raw: bytes, a: int, b: int) -> str:
    """The JSON string raw[a:b] (its text between the quotes), decoded _PIECE bytes at a time. A cut
    never falls inside a UTF-8 sequence or an escape, nor between the two escapes of a surrogate
    pair (each half alone would be refused as a lone surrogate)."""
    parts = []
    while a < b:
        p = min(a + _PIECE, b)
        while p < b and not _cut_ok(raw, p, a):
            p += 1
        parts.append(_loads_piece(b'"' + raw[a:p] + b'"', a - 1))
        a = p
    return "".join(parts)


def _cut_ok(raw: bytes, p: int, a: int) -> bool:
    """Whether the string whose text starts at raw[a] may be cut before raw[p]."""
    if raw[p] in _CONT or 0x5C in raw[max(a, p - 5):p]:  # escapes are at most 6 bytes: \uXXXX
        return False
    return p - 6 < a or not (raw[p - 6] == 0x5C and raw[p - 5] == 0x75 and raw[p - 4] in _HIGH
                             and raw[p - 3] in _HIGH2)


def _cut_arrays(raw: bytes, a: int, b: int, last: int, out: list, values: dict, nonce: str,
                max_items: int | None) -> int:
    """Cuts each long flat array (numbers and literals, no strings or nesting: a token-id list) out of
    raw[a:b], which holds no string; returns where the part of raw not yet in `out` starts."""
    i = a
    while True:
        i = raw.find(b"[", i, b)
        if i < 0:
            return last
        j = min((x for x in (raw.find(c, i + 1, b) for c in (b"[", b"]", b"{", b"}")) if x >= 0), default=-1)
        if j < 0:
            return last
        if raw[j] == 0x5D and j - i > _PIECE:  # "]": raw[i:j] holds scalars alone
            if max_items is not None and (n := raw.count(b",", i, j) + 1) > max_items:
                raise LongArray(n)
            out.append(raw[last:i])
            values[key := f"{nonce}a{len(values)}"] = _flat_array(raw, i + 1, j)
            out.append(b'"' + key.encode() + b'"')
            last = j + 1
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
        items += _loads_piece(b"[" + piece + b"]", a - 1)
        if p == b:
            return items
        a = p + 1


def _loads_piece(piece: bytes, offset: int) -> Any:
    try:
        return loads_text_json(piece)
    except ValueError as e:
        pos = getattr(e, "pos", None)
        if pos is None:
            raise
        raise ValueError(f"{e.msg} (byte {offset + pos})") from None


def _put_back(value: Any, values: dict) -> Any:
    if isinstance(value, str):
        return values.pop(value, value) if value in values else value
    if isinstance(value, list):
        return [_put_back(v, values) for v in value]
    if isinstance(value, dict):
        return {_put_back(k, values): _put_back(v, values) for k, v in value.items()}
    return value

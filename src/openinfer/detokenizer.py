"""Incremental detokenization with stop strings, and the per-token finish decision (EOS, stop
token ids, stop strings, length) that the scheduler makes for every sampled token."""
from __future__ import annotations

import codecs
from typing import Sequence

from .sampling_params import SamplingParams
from .tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
_UTF8 = codecs.getincrementaldecoder("utf-8")  # looked up once, not per request


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Byte-level BPE (Qwen3): each token's bytes go through a streaming UTF-8 decoder, which holds a
    character split across tokens until it completes. Other tokenizers, the prefix/read-offset
    method: decode the window ids[prefix:] and emit what it adds over ids[prefix:read]; while the
    window ends in U+FFFD (a UTF-8 character split across tokens) wait for more tokens.
    Stop strings: the text ends before the first stop string; while streaming, the last
    len(longest stop) - 1 characters are held back so a stop string that arrives in pieces never
    leaks.
    """

    # A UTF-8 character is at most 4 bytes: a window still ending in U+FFFD after this many
    # pending tokens is genuinely invalid, so emit it rather than stall.
    MAX_PENDING = 4

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, stop: Sequence[str] = ()):
        self.tok = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Byte-level BPE: one table lookup and a streaming UTF-8 decoder per token instead of two decodes
        # (the same text: tests/test_detokenizer.py); it holds an incomplete character until it completes.
        self._bytes = tokenizer.byte_table(skip_special_tokens)
        self._utf8 = _UTF8("replace") if self._bytes is not None else None
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.tail = ""  # decoded but not yet returned (at most `holdback` characters between calls)
        self.stopped = False

    def add_token(self, token_id: int) -> tuple[str, bool]:
        """Feeds one token; returns (text delta to emit now, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        if self._utf8 is not None:
            b = self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""
            return self._append(self._utf8.decode(b))
        self.ids.append(token_id)  # the window method re-decodes from these
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        window = self.tok.decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        pending = len(self.ids) - self.read_offset
        if len(window) > len(prefix) and (not window.endswith(REPLACEMENT_CHAR) or pending >= self.MAX_PENDING):
            new = window[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        else:
            new = ""
        return self._append(new)

    def _append(self, new: str) -> tuple[str, bool]:
        if not new:
            return "", False
        # A stop string cannot start in text already returned: only the tail and the new text are
        # searched, and only they are kept (no copy of the whole output per token).
        buf = self.tail + new
        if self.stop:
            hits = [i for i in (buf.find(s) for s in self.stop) if i >= 0]
            if hits:
                self.tail = ""
                self.stopped = True
                return buf[:min(hits)], True
        cut = len(buf) - self.holdback
        if cut <= 0:
            self.tail = buf
            return "", False
        self.tail = buf[cut:]
        return buf[:cut], False

    def flush(self) -> str:
        """Releases everything held back; call once when the request finishes."""
        out = ""
        if self._utf8 is not None:
            if not self.stopped:
                out, _ = self._append(self._utf8.decode(b"", final=True))
        elif not self.stopped and self.read_offset < len(self.ids):
            prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
            window = self.tok.decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
            self.prefix_offset = self.read_offset = len(self.ids)
            out, _ = self._append(window[len(prefix):])
        out, self.tail = out + self.tail, ""
        return out


def next_text(detok: IncrementalDetokenizer, token_id: int, params: SamplingParams,
              eos_token_ids: frozenset[int], at_max_len: bool) -> tuple[str, str | None]:
    """One sampled token, already appended to its request (`at_max_len`: the request now holds
    max_len tokens): (text to emit, finish reason or None while it goes on). An EOS id (unless
    ignore_eos) or a stop token id ends it with "stop" and adds no text of its own; a stop string
    ends it with "stop" and the text before it; else a full request ends with "length". A finished
    request's held-back text comes with its last delta."""
    if (token_id in eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_set:
        text, reason = "", "stop"
    else:
        text, hit = detok.add_token(token_id)
        reason = "stop" if hit else "length" if at_max_len else None
    if reason is not None:
        text += detok.flush()
    return text, reason

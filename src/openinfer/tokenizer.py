"""Tokenizer wrapper (`tokenizers` library) and incremental detokenization with stop strings."""
from __future__ import annotations

import codecs
import json
import logging
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer as _HFTokenizer

log = logging.getLogger("openinfer")

BUNDLED_TOKENIZER_DIR = Path(__file__).parent / "data" / "qwen3-tokenizer"
REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    def __init__(self, hf: _HFTokenizer, config: dict | None = None):
        self._tok = hf
        self.config = config or {}  # tokenizer_config.json: chat_template, eos_token, ...
        self.chat_template: str | None = self.config.get("chat_template")
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        eos = self.config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        eos_id = hf.token_to_id(eos) if eos else None
        self.eos_token_ids: tuple[int, ...] = (eos_id,) if eos_id is not None else ()
        self._byte_tables: dict[bool, list[bytes] | None] = {}  # by skip_special_tokens
        self._special_ids = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}

    def byte_table(self, skip_special_tokens: bool) -> list[bytes] | None:
        """The bytes each id decodes to, when the decoder is plain byte-level BPE (Qwen3's): then the
        text of ids is the lossy UTF-8 decoding of the concatenated bytes, which a streaming UTF-8
        decoder reproduces with one table lookup per token. None for any other decoder."""
        tables = self._byte_tables
        if False not in tables:
            tables[False] = self._build_byte_table()
        if skip_special_tokens and True not in tables:
            full = tables[False]
            tables[True] = None if full is None else [b"" if i in self._special_ids else t for i, t in enumerate(full)]
        return tables[skip_special_tokens]

    def _build_byte_table(self) -> list[bytes] | None:
        if type(self._tok.decoder).__name__ != "ByteLevel" or type(self._tok.model).__name__ != "BPE":
            return None
        # GPT-2's byte -> printable-character map, inverted: printable Latin-1 bytes stand for
        # themselves, the other 68 bytes for U+0100.. in byte order. Latin-1 characters outside the
        # alphabet map to U+FFFF, so a token holding one fails the Latin-1 encode below and falls back
        # to its own UTF-8 (what the tokenizers library does with such tokens).
        inverse, n = {}, 0
        for b in range(256):
            if ord("!") <= b <= ord("~") or ord("¡") <= b <= ord("¬") or ord("®") <= b <= ord("ÿ"):
                inverse[b] = b
            else:
                inverse[256 + n] = b
                inverse[b] = 0xFFFF
                n += 1
        trans = {c: chr(b) for c, b in inverse.items()}
        table = [b""] * self.vocab_size  # ids without a token decode to nothing
        for t, i in self._tok.get_vocab(with_added_tokens=True).items():
            if i >= self.vocab_size:
                continue
            try:
                table[i] = t.translate(trans).encode("latin-1")
            except UnicodeEncodeError:
                table[i] = t.encode()
        return table

    @classmethod
    def from_model_dir(cls, path: str | Path) -> "Tokenizer":
        p = Path(path)
        if not (p / "tokenizer.json").is_file():
            # random-weight directories may carry only config.json: the bundled Qwen3 files fit them
            log.info("no tokenizer.json in %s: using the bundled Qwen3 tokenizer", p)
            p = BUNDLED_TOKENIZER_DIR
        cfg_path = p / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        return cls(_HFTokenizer.from_file(str(p / "tokenizer.json")), cfg)

    def encode(self, text: str) -> list[int]:
        # Qwen3 adds no BOS; special-token strings in the text map to their ids.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Byte-level BPE (Qwen3): each token's bytes go through a streaming UTF-8 decoder, which holds a
    character split across tokens until it completes. Other tokenizers, the prefix/read-offset
    method: decode the window ids[prefix:] and emit what it adds over ids[prefix:read]; while the
    window ends in U+FFFD (a UTF-8 character split across tokens) wait for more tokens. Stop strings: the text ends before the first stop string; while
    streaming, the last len(longest stop) - 1 characters are held back so a stop string that
    arrives in pieces never leaks.
    """

    # A UTF-8 character is at most 4 bytes: a window still ending in U+FFFD after this many
    # pending tokens is genuinely invalid, so emit it rather than stall.
    MAX_PENDING = 4

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, stop: Sequence[str] = ()):
        self.tok = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Byte-level BPE: one table lookup and a streaming UTF-8 decoder per token instead of two decodes
        # (the same text: tests/test_tokenizer.py); it holds an incomplete character until it completes.
        self._bytes = tokenizer.byte_table(skip_special_tokens)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if self._bytes is not None else None
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

"""Tokenizer wrapper (`tokenizers` library); incremental detokenization is in detokenizer.py."""
from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Iterator, Sequence

from tokenizers import Tokenizer as _HFTokenizer

from .model_files import ModelFiles

log = logging.getLogger("openinfer")


class TooManyTokens(ValueError):
    """A text with more tokens than the caller's cap; `n`: its tokens, or at least that many."""

    def __init__(self, n: int, cap: int):
        super().__init__(f"{n} tokens, more than {cap}")
        self.n = n


# How far a normalizer can shrink UTF-8 text, by its type (None: no normalizer). NFC composes at most
# three UTF-8 bytes into one (a Hangul syllable, 3 bytes, from three 3-byte jamo; e + U+0301, 3 bytes,
# is é, 2) and leaves ASCII alone. A normalizer not listed here gets no bound.
_SHRINK = {None: 1, "NFC": 3}
# Texts longer than this (characters) are encoded with the GIL released (encode_batch; encode holds it:
# a 7 MB text held it for 7 s, stalling every other thread of the server), in pieces of about
# _PIECE_CHARS where the pre-tokenizer allows (freeing the Encoding of 1M tokens held the GIL 250 ms),
# _GROUP_CHARS of them per call, which encodes its pieces in parallel (the library's thread pool): a
# 16k-token prompt in 16 pieces at once instead of ~20 ms of one core. The cap is checked between calls.
_RELEASE_GIL_CHARS = 1 << 13
_PIECE_CHARS = 1 << 12
_GROUP_CHARS = 1 << 16
# Qwen3's pre-tokenizer: this split, then byte-level. No pretoken of it holds a letter then a space, and
# a space then letters begin one (` ?\p{L}+`), so a text cut between a letter and a space followed by a
# letter tokenizes as its two halves do (BPE merges within pretokens only; NFC composes nothing with a
# space; no added token holds a space).
_QWEN_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
               "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


def _pieces(text: str) -> Iterator[str]:
    """text in pieces of about _PIECE_CHARS, each cut between a letter and " " + a letter."""
    start = 0
    while len(text) - start > _PIECE_CHARS:
        i = start + _PIECE_CHARS
        while True:
            i = text.find(" ", i, len(text) - 1)
            if i < 0 or (text[i - 1].isalpha() and text[i + 1].isalpha()):
                break
            i += 1
        if i < 0:
            break
        yield text[start:i]
        start = i
    yield text[start:]


def _groups(pieces: Iterator[str]) -> Iterator[list[str]]:
    """Consecutive pieces, about _GROUP_CHARS characters a list."""
    group, n = [], 0
    for p in pieces:
        group.append(p)
        n += len(p)
        if n >= _GROUP_CHARS:
            yield group
            group, n = [], 0
    if group:
        yield group


class Tokenizer:
    def __init__(self, hf: _HFTokenizer, files: ModelFiles):
        self._tok = hf
        self.files = files  # what it was read from; the server takes its chat template and defaults there
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        eos = files.tokenizer_config.get("eos_token")
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
    def from_files(cls, files: ModelFiles) -> "Tokenizer":
        if files.tokenizer_dir != files.path:
            log.info("no tokenizer.json in %s: using the bundled Qwen3 tokenizer", files.path)
        return cls(_HFTokenizer.from_file(str(files.tokenizer_dir / "tokenizer.json")), files)

    @classmethod
    def from_model_dir(cls, path: str | Path) -> "Tokenizer":
        return cls.from_files(ModelFiles.read(path))

    def encode(self, text: str, cap: int | None = None) -> list[int]:
        """The text's token ids; with `cap`, TooManyTokens for a text of more tokens than that (the id
        list of a long text is not built: 1M ids take 70 ms with the GIL held)."""
        # Qwen3 adds no BOS; special-token strings in the text map to their ids.
        if len(text) <= _RELEASE_GIL_CHARS:
            enc = self._tok.encode(text, add_special_tokens=False)
            if cap is not None and len(enc) > cap:
                raise TooManyTokens(len(enc), cap)
            return enc.ids
        ids: list[int] = []
        for group in _groups(_pieces(text) if self._cuts_at_spaces else iter([text])):
            encs = self._tok.encode_batch(group, add_special_tokens=False)
            for i in range(len(encs)):
                enc, encs[i] = encs[i], None  # each Encoding freed once read, not all at the end
                if cap is not None and len(ids) + len(enc) > cap:
                    raise TooManyTokens(len(ids) + len(enc), cap)  # at least that many: the rest is not read
                ids += enc.ids
        return ids

    @functools.cached_property
    def _cuts_at_spaces(self) -> bool:
        """Whether _pieces' cuts leave the tokens as they are: Qwen3's pre-tokenizer and normalizer."""
        pre = json.loads(self._tok.pre_tokenizer.__getstate__()) if self._tok.pre_tokenizer else {}
        norm = json.loads(self._tok.normalizer.__getstate__()) if self._tok.normalizer else None
        split = [p for p in pre.get("pretokenizers", []) if p.get("type") == "Split"]
        return (norm in (None, {"type": "NFC"}) and len(pre.get("pretokenizers", [])) == 2 and len(split) == 1
                and split[0].get("pattern") == {"Regex": _QWEN_SPLIT} and split[0].get("behavior") == "Isolated"
                and not any(" " in t.content for t in self._tok.get_added_tokens_decoder().values()))

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token stands for (Qwen3: 128; added tokens included)."""
        table = self.byte_table(False)
        if table is None:  # not byte-level BPE: the tokens' own spellings
            table = [t.encode() for t in self._tok.get_vocab(with_added_tokens=True)]
        return max(map(len, table))

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) from the text's length alone, without tokenizing: every
        token stands for at most max_token_bytes of the normalized text (special tokens are matched in
        the raw text, and are as long at most), and the normalizer shrinks the text by at most
        _SHRINK (none for ASCII). 0 under a normalizer of unknown shrinkage."""
        norm = self._tok.normalizer
        shrink = _SHRINK.get(None if norm is None else type(norm).__name__)
        if shrink is None:
            return 0
        if text.isascii():  # O(1) in CPython; NFC leaves ASCII as it is
            nbytes, shrink = len(text), 1
        else:  # in pieces: encoding 7 MB at once holds the GIL 5 ms
            nbytes = sum(len(text[i:i + _PIECE_CHARS].encode("utf-8", "surrogatepass"))
                         for i in range(0, len(text), _PIECE_CHARS))
        return -(-nbytes // (shrink * self.max_token_bytes))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

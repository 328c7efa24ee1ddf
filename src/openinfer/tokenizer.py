"""Tokenizer wrapper (`tokenizers` library); incremental detokenization is in detokenizer.py."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer as _HFTokenizer

from .model_files import ModelFiles

log = logging.getLogger("openinfer")


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

    def encode(self, text: str) -> list[int]:
        # Qwen3 adds no BOS; special-token strings in the text map to their ids.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

"""A Hugging Face model directory's JSON files, each read and parsed once, for every reader:
`ModelConfig` (config.json, generation_config.json's EOS ids), `Tokenizer` (tokenizer.json's
directory, tokenizer_config.json), the chat template, the server's sampling defaults
(generation_config.json)."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("openinfer")

BUNDLED_TOKENIZER_DIR = Path(__file__).parent / "data" / "qwen3-tokenizer"


@dataclass(frozen=True)
class ModelFiles:
    path: Path
    config: dict  # config.json; {} for a file that is not there, as for the next ones
    generation_config: dict
    tokenizer_dir: Path  # where tokenizer.json is: the model's directory, or the bundled Qwen3 files
    tokenizer_config: dict  # tokenizer_dir's tokenizer_config.json
    chat_template: str | None  # the template chat requests render with; None: the model has none

    @classmethod
    def read(cls, path: str | Path) -> "ModelFiles":
        p = Path(path)
        tok_dir = p
        if not (p / "tokenizer.json").is_file():
            # random-weight directories may carry only config.json: the bundled Qwen3 files fit them
            tok_dir = BUNDLED_TOKENIZER_DIR
        tok_config = _json(tok_dir / "tokenizer_config.json")
        return cls(p, _json(p / "config.json"), _json(p / "generation_config.json"), tok_dir, tok_config,
                   _chat_template(tok_dir, tok_config))


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _chat_template(tok_dir: Path, tok_config: dict) -> str | None:
    """As transformers resolves it: a chat_template.jinja file (newer checkpoints) wins over
    tokenizer_config.json's `chat_template`, which is a string or a list of named templates
    ({"name", "template"}) of which "default" is the one used. Without a default transformers refuses
    to guess, and so do we: the model then has no template."""
    jinja = tok_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8") or None
    source = tok_config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if "default" not in named:
            log.warning("%s names chat templates %s but none 'default': chat requests are refused",
                        tok_dir / "tokenizer_config.json", sorted(map(str, named)))
        source = named.get("default")
    return source if isinstance(source, str) and source else None

"""A model directory's files, read once by one reader: the chat template's forms (a string, a list
of named templates, a chat_template.jinja file, none) and the readers that take the result."""
import json
import logging
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from openinfer.chat import ChatTemplate
from openinfer.config import ModelConfig
from openinfer.model_files import BUNDLED_TOKENIZER_DIR, ModelFiles
from openinfer.server import build_app
from openinfer.tokenizer import Tokenizer

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def model_dir(tmp_path, tiny_dir):
    """A copy of the tiny checkpoint's JSON files with its own tokenizer (linked), whose
    tokenizer_config.json the test rewrites."""
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_text((tiny_dir / name).read_text())
    (tmp_path / "tokenizer.json").symlink_to(BUNDLED_TOKENIZER_DIR / "tokenizer.json")
    return tmp_path


def write_tokenizer_config(d, **fields):
    cfg = json.loads((BUNDLED_TOKENIZER_DIR / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, **fields}))


def test_one_read_for_every_reader(model_dir):
    write_tokenizer_config(model_dir, chat_template="{{ messages[0].content }}")
    files = ModelFiles.read(model_dir)
    assert files.tokenizer_dir == model_dir and files.chat_template == "{{ messages[0].content }}"
    assert files.config["model_type"] == "qwen3" and files.generation_config["top_k"] == 20
    assert ModelConfig.from_model_dir(model_dir) == ModelConfig.from_dict(files.config, files.generation_config)
    tok = Tokenizer.from_files(files)
    assert tok.files is files and tok.eos_token_ids == (151645,)


def test_list_valued_template_uses_the_default(model_dir):
    write_tokenizer_config(model_dir, chat_template=[{"name": "tool_use", "template": "T"},
                                                     {"name": "default", "template": "D{{ messages|length }}"}])
    files = ModelFiles.read(model_dir)
    assert files.chat_template == "D{{ messages|length }}"
    assert ChatTemplate(Tokenizer.from_files(files).files.chat_template).render(USER) == "D1"


def test_list_valued_template_without_a_default_is_none(model_dir, caplog):
    write_tokenizer_config(model_dir, chat_template=[{"name": "tool_use", "template": "T"}])
    with caplog.at_level(logging.WARNING, logger="openinfer"):
        assert ModelFiles.read(model_dir).chat_template is None  # transformers refuses to guess too
    assert "tool_use" in caplog.text


def test_jinja_file_wins_over_tokenizer_config(model_dir):
    write_tokenizer_config(model_dir, chat_template="inline")
    (model_dir / "chat_template.jinja").write_text("from the file")
    assert ModelFiles.read(model_dir).chat_template == "from the file"
    write_tokenizer_config(model_dir)  # newer checkpoints keep the template in the file alone
    assert ModelFiles.read(model_dir).chat_template == "from the file"


def test_missing_template_and_missing_files(model_dir, tmp_path_factory):
    write_tokenizer_config(model_dir)
    assert ModelFiles.read(model_dir).chat_template is None
    (model_dir / "generation_config.json").unlink()
    assert ModelFiles.read(model_dir).generation_config == {}
    # no tokenizer.json: the bundled Qwen3 tokenizer, its config and its template
    bare = tmp_path_factory.mktemp("bare")
    (bare / "config.json").write_text("{}")
    files = ModelFiles.read(bare)
    assert files.tokenizer_dir == BUNDLED_TOKENIZER_DIR and files.config == {}
    bundled = ModelFiles.read(BUNDLED_TOKENIZER_DIR).chat_template
    assert bundled and files.chat_template == bundled


def serve(files):
    """The app over an engine stand-in whose tokenizer came from `files` (its loop never starts)."""
    engine = SimpleNamespace(tokenizer=Tokenizer.from_files(files), config=SimpleNamespace(max_model_len=64),
                             model_config=SimpleNamespace(vocab_size=151936),
                             scheduler=SimpleNamespace(max_waiting=8))  # the waiting bound the server reads
    return build_app(engine, served_model_name="m")


def test_the_server_takes_the_tokenizers_files(model_dir):
    write_tokenizer_config(model_dir, chat_template=[{"name": "default", "template": "D"}])
    st = serve(ModelFiles.read(model_dir)).state.openinfer
    assert st.template.source == "D" and st.defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    write_tokenizer_config(model_dir)
    app = serve(ModelFiles.read(model_dir))
    r = TestClient(app).post("/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "no chat template" in r.json()["error"]["message"]

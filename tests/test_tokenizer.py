import pytest

from openinfer.tokenizer import IncrementalDetokenizer, Tokenizer

# src/openinfer/data/qwen3-tokenizer/README.md, "Checked encodings"
README_IDS = {"Hello world": [9707, 1879], "The capital of France is": [785, 6722, 315, 9625, 374],
              "你好，世界": [108386, 3837, 99489]}
SPECIAL = {"<|im_start|>": 151644, "<|im_end|>": 151645, "<|endoftext|>": 151643, "<tool_call>": 151657,
           "</tool_call>": 151658, "<tool_response>": 151665, "</tool_response>": 151666, "<think>": 151667,
           "</think>": 151668, "assistant": 77091, "user": 872, "\n": 198, "\n\n": 271}
MULTIBYTE = "😀🙃 𝔘𝔫𝔦 ok 鿰鿱 Ꙃ done"


def test_readme_encodings(tokenizer):
    for text, ids in README_IDS.items():
        assert tokenizer.encode(text) == ids
        assert tokenizer.decode(ids) == text
    for text, i in SPECIAL.items():
        assert tokenizer.encode(text) == [i], text
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>")[:3] == [151644, 872, 198]
    assert tokenizer.eos_token_ids == (151645,) and tokenizer.chat_template


def test_bundled_fallback(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert Tokenizer.from_model_dir(tmp_path).encode("Hello world") == [9707, 1879]


def stream(tok, ids, stop=(), skip=True):
    d = IncrementalDetokenizer(tok, skip, stop)
    deltas, hit = [], False
    for i in ids:
        delta, hit = d.add_token(i)
        deltas.append(delta)
        if hit:
            break
    deltas.append(d.flush())
    return deltas, hit


def test_multibyte_never_yields_replacement_char(tokenizer):
    ids = tokenizer.encode(MULTIBYTE)
    assert len(ids) > len(MULTIBYTE.split())  # characters really are split across tokens
    deltas, _ = stream(tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("<|im_start|>hi<|im_end|><think>ok")  # <think> is not special in Qwen3
    assert "".join(stream(tokenizer, ids)[0]) == "hi<think>ok"
    assert "".join(stream(tokenizer, ids, skip=False)[0]) == "<|im_start|>hi<|im_end|><think>ok"


@pytest.mark.parametrize("stop,expected", [(["d, st"], "Hello worl"), ([" here"], "Hello world, stop"),
                                           (["xyz", "o w"], "Hell"), (["nothing"], "Hello world, stop here")])
def test_stop_strings_split_across_tokens(tokenizer, stop, expected):
    ids = tokenizer.encode("Hello world, stop here")
    deltas, hit = stream(tokenizer, ids, stop)
    assert "".join(deltas) == expected
    assert hit == (expected != "Hello world, stop here")
    emitted = ""
    for d in deltas:  # no prefix of the stream ever shows text past the cut
        emitted += d
        assert expected.startswith(emitted)


def test_holdback_is_released_when_no_stop(tokenizer):
    d = IncrementalDetokenizer(tokenizer, True, ["abcdefgh"])
    out = [d.add_token(i)[0] for i in tokenizer.encode("Hello world")]
    assert "".join(out) == "Hell"  # 7 characters held back: a stop string could still start there
    assert d.flush() == "o world"


def test_byte_table_decodes_every_id_like_the_tokenizer(tokenizer):
    import codecs
    for skip in (True, False):
        table = tokenizer.byte_table(skip)
        assert table is not None and len(table) == tokenizer.vocab_size
        for i in range(151936):  # the model's vocabulary: ids past the tokenizer's decode to nothing
            b = table[i] if i < len(table) else b""
            assert codecs.decode(b, "utf-8", "replace") == tokenizer.decode([i], skip), (skip, i)


def test_fast_stream_equals_window_method_and_full_decode(tokenizer, monkeypatch):
    import numpy as np
    rng = np.random.default_rng(7)
    seqs = [tokenizer.encode(MULTIBYTE + " 你好，世界<think>x</think>")]
    seqs += [[int(x) for x in rng.integers(0, 151936, int(rng.integers(1, 60)))] for _ in range(300)]
    fast = {}
    for k, ids in enumerate(seqs):
        for skip in (True, False):
            d, _ = stream(tokenizer, ids, skip=skip)
            assert "".join(d) == tokenizer.decode(ids, skip)
            fast[k, skip] = "".join(d)
    monkeypatch.setattr(tokenizer, "byte_table", lambda skip: None)  # the generic window method
    for k, ids in enumerate(seqs[:1]):
        for skip in (True, False):
            assert "".join(stream(tokenizer, ids, skip=skip)[0]) == fast[k, skip]

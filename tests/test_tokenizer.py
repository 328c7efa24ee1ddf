from openinfer.tokenizer import Tokenizer

# src/openinfer/data/qwen3-tokenizer/README.md, "Checked encodings"
README_IDS = {"Hello world": [9707, 1879], "The capital of France is": [785, 6722, 315, 9625, 374],
              "你好，世界": [108386, 3837, 99489]}
SPECIAL = {"<|im_start|>": 151644, "<|im_end|>": 151645, "<|endoftext|>": 151643, "<tool_call>": 151657,
           "</tool_call>": 151658, "<tool_response>": 151665, "</tool_response>": 151666, "<think>": 151667,
           "</think>": 151668, "assistant": 77091, "user": 872, "\n": 198, "\n\n": 271}


def test_readme_encodings(tokenizer):
    for text, ids in README_IDS.items():
        assert tokenizer.encode(text) == ids
        assert tokenizer.decode(ids) == text
    for text, i in SPECIAL.items():
        assert tokenizer.encode(text) == [i], text
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>")[:3] == [151644, 872, 198]
    assert tokenizer.eos_token_ids == (151645,) and tokenizer.files.chat_template


def test_bundled_fallback(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert Tokenizer.from_model_dir(tmp_path).encode("Hello world") == [9707, 1879]


def test_byte_table_decodes_every_id_like_the_tokenizer(tokenizer):
    import codecs
    for skip in (True, False):
        table = tokenizer.byte_table(skip)
        assert table is not None and len(table) == tokenizer.vocab_size
        for i in range(151936):  # the model's vocabulary: ids past the tokenizer's decode to nothing
            b = table[i] if i < len(table) else b""
            assert codecs.decode(b, "utf-8", "replace") == tokenizer.decode([i], skip), (skip, i)

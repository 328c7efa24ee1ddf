"""Incremental detokenization, stop strings and the per-token finish decision (detokenizer.py)."""
import pytest

from openinfer.detokenizer import IncrementalDetokenizer, next_text
from openinfer.sampling_params import SamplingParams

MULTIBYTE = "😀🙃 𝔘𝔫𝔦 ok 鿰鿱 Ꙃ done"
EOS = frozenset({151645})


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


def finish(tokenizer, text, params, eos=EOS, max_len=None):
    """next_text over the tokens of `text` (a string or ids) as the scheduler calls it: (the text,
    the finish reason, tokens consumed)."""
    ids = tokenizer.encode(text) if isinstance(text, str) else text
    d = IncrementalDetokenizer(tokenizer, params.skip_special_tokens, params.stop)
    out = ""
    for n, t in enumerate(ids, 1):
        delta, reason = next_text(d, t, params, eos, max_len is not None and n >= max_len)
        out += delta
        if reason is not None:
            return out, reason, n
    return out + d.flush(), None, len(ids)


def test_next_text_eos_and_stop_token_ids_end_without_their_text(tokenizer):
    ids = tokenizer.encode("Hello world") + [151645] + tokenizer.encode(" more")
    assert finish(tokenizer, ids, SamplingParams()) == ("Hello world", "stop", 3)
    # the stop token's own text never shows; what was held back for a stop string does
    p = SamplingParams(stop=["zzzzzz"], stop_token_ids=[ids[1]])
    assert finish(tokenizer, ids, p) == ("Hello", "stop", 2)


def test_next_text_ignore_eos_decodes_eos_like_any_token(tokenizer):
    ids = tokenizer.encode("Hi") + [151645] + tokenizer.encode(" there")
    out, reason, n = finish(tokenizer, ids, SamplingParams(ignore_eos=True, skip_special_tokens=False))
    assert (out, reason, n) == ("Hi<|im_end|> there", None, len(ids))
    # a stop token id still stops when ignore_eos is set
    assert finish(tokenizer, ids, SamplingParams(ignore_eos=True, stop_token_ids=[151645]))[1:] == ("stop", 2)


def test_next_text_stop_string_cuts_and_length_flushes(tokenizer):
    assert finish(tokenizer, "Hello world, stop here", SamplingParams(stop=["o w"]))[:2] == ("Hell", "stop")
    ids = tokenizer.encode("Hello world, stop here")
    out, reason, n = finish(tokenizer, ids, SamplingParams(stop=["nothing"]), max_len=3)
    assert (reason, n) == ("length", 3) and out == tokenizer.decode(ids[:3])  # held-back text flushed
    # a stop string beats length on the same token
    ids = tokenizer.encode("Hello world")
    assert finish(tokenizer, ids, SamplingParams(stop=["world"]), max_len=len(ids))[:2] == ("Hello ", "stop")

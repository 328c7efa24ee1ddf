"""Log-probabilities in OpenAI's two shapes: completions' parallel lists with text offsets, chat's
entries with each token's bytes."""

from __future__ import annotations


def _token_str(tok, tid: int) -> str:
    return tok.decode([tid], skip_special_tokens=False)


def logprob_rows(u) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """An update's logprobs as (token id, logprob, [(top id, top logprob), ...]) per new token."""
    return [(e.token_id, e.logprob, e.top) for e in (u.logprobs or [])]


def completion_logprobs(tok, rows, offset: int) -> dict:
    """`offset`: where the first token's text starts in the choice's text."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, lp, top in rows:
        s = _token_str(tok, tid)
        out["tokens"].append(s)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append({_token_str(tok, i): v for i, v in top})
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def merge_logprobs(parts: list[dict]) -> dict:
    """Per-update completion logprobs (each with its own text offsets) as one."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key, values in part.items():
            out[key].extend(values)
    return out


def chat_logprobs(tok, rows) -> list[dict]:
    table = tok.byte_table(False)  # a token's own bytes: its text alone may be part of a character

    def entry(tid, lp):
        s = _token_str(tok, tid)
        b = table[tid] if table is not None and tid < len(table) else s.encode("utf-8")
        return {"token": s, "logprob": lp, "bytes": list(b)}
    return [{**entry(tid, lp), "top_logprobs": [entry(i, v) for i, v in top]}
            for tid, lp, top in rows]

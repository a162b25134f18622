"""Log-probabilities in the shapes OpenAI's API gives them (the engine's are `StreamEvent.logprobs`).

    chat         choices[].logprobs.content[]: {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}
    completions  choices[].logprobs: {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}
    native       per token: {logprob, top_logprobs: [{token_id, logprob}]} (ids, not text: the native API's way)

`token` is the token's bytes decoded as UTF-8 (a token that is part of a multi-byte character shows U+FFFD;
`bytes` has the exact bytes). A log-probability of -inf (a token the sampling cut away) is reported as
-9999.0, as OpenAI does, since JSON has no infinity.
"""

from __future__ import annotations

from typing import Any

FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(float(value), FLOOR)


def _token(tokenizer, tid: int) -> tuple[str, list[int]]:
    b = tokenizer.token_bytes(tid)
    return b.decode("utf-8", errors="replace"), list(b)


def chat_content(tokenizer, ids: list[int], lps: list) -> list[dict[str, Any]]:
    out = []
    for tid, (lp, alts) in zip(ids, lps):
        text, raw = _token(tokenizer, tid)
        tops = []
        for aid, alp in alts:
            atext, araw = _token(tokenizer, aid)
            tops.append({"token": atext, "logprob": _lp(alp), "bytes": araw})
        out.append({"token": text, "logprob": _lp(lp), "bytes": raw, "top_logprobs": tops})
    return out


def chat_logprobs(content: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat choice's (or chunk's) `logprobs` object: the content tokens', and `refusal` null (OpenAI's schema
    requires both; these models write no separate refusal)."""
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer, ids: list[int], lps: list, offset: int = 0) -> dict[str, Any]:
    """`offset`: the character offset of the first token in the returned text. An entry None (the first
    prompt token's, with echo) gives null logprob and alternatives."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(ids, lps):
        text, _ = _token(tokenizer, tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        lp, alts = entry
        token_lps.append(_lp(lp))
        top: dict[str, float] = {}
        for aid, alp in alts:
            top.setdefault(_token(tokenizer, aid)[0], _lp(alp))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def join(first: dict[str, list], then: dict[str, list]) -> dict[str, list]:
    """Two completions logprobs objects, one after the other (echo: the prompt's, then the output's)."""
    return {k: first[k] + then[k] for k in first}


def completion_tail(tokenizer, ids: list[int], lps: list, stop, offset: int, end: int) -> dict[str, list]:
    """Generated tokens' logprobs (`offset`: the first one's character offset), plus `stop` (the stop token
    that ended the output, (id, entry), or None) at `end`, the end of the text: OpenAI's completions (and
    vLLM's) list the end-of-text token too, though its text is not returned."""
    if stop is None:
        return completion_logprobs(tokenizer, ids, lps, offset)
    out = completion_logprobs(tokenizer, [*ids, stop[0]], [*lps, stop[1]], offset)
    out["text_offset"][-1] = end
    return out


def native_logprob(entry) -> dict[str, Any] | None:
    if entry is None:
        return None
    lp, alts = entry
    return {"logprob": _lp(lp), "top_logprobs": [{"token_id": int(a), "logprob": _lp(v)} for a, v in alts]}

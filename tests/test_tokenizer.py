from tinyloop.tokenizer import Tokenizer


def test_gpt2_vectors(tokenizer):
    assert tokenizer.encode("Hello world, the capital of France is Paris.") == \
        [15496, 995, 11, 262, 3139, 286, 4881, 318, 6342, 13]
    assert tokenizer.eos_id == 50256 and tokenizer.vocab_size == 50257
    assert tokenizer.decode([15496, 995]) == "Hello world"
    # user text containing the special token is plain text, never the end-of-text id
    assert 50256 not in tokenizer.encode("a <|endoftext|> b")


def test_ranks_blob_roundtrip(tokenizer):
    again = Tokenizer.from_ranks_blob(tokenizer.ranks_blob())
    text = "Ünïcödé 🙂 and code: def f(x): return x**2"
    assert again.encode(text) == tokenizer.encode(text)
    assert again.fingerprint() == tokenizer.fingerprint()


def test_streaming_detokenizer_whole_characters(tokenizer):
    text = "Emoji 🙂🎉 and 日本語 mixed with ñ."
    ids = tokenizer.encode(text)
    # some token must split a multi-byte character, or this test proves nothing
    assert any(not _is_utf8(tokenizer.token_bytes(i)) for i in ids)
    det = tokenizer.detokenizer()
    deltas = [det.add(i) for i in ids] + [det.flush()]
    assert "".join(deltas) == text
    for d in deltas:
        assert "\ufffd" not in d


def test_flush_yields_replacement_for_incomplete_bytes(tokenizer):
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1
    det = tokenizer.detokenizer()
    out = "".join(det.add(i) for i in ids[:-1])
    assert out == ""  # held back: the character is not complete
    assert "\ufffd" in det.flush()


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False

"""Hugging Face tokenizers and chat templates (imported checkpoints): embedded in the model file, streamed
byte-exactly, rendered with Jinja2 as transformers does."""

from __future__ import annotations

import pytest
import torch

from tinyloop.chat import Chat, ChatTemplateError, render_plain, render_template
from tinyloop.config import preset
from tinyloop.engine import Engine, SamplingParams
from tinyloop.errors import ValidationError
from tinyloop.model import build_model
from tinyloop.modelfile.loader import load_model, write_model
from tinyloop.tokenizer import HFTokenizer, TokenizerError

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = ("The quick brown fox jumps over the lazy dog. Naïve café déjà vu — 東京 and 🙂 emoji. " * 20)


def byte_level_json(specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>")) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    return tok.to_str()


@pytest.fixture(scope="module")
def hf_tok() -> HFTokenizer:
    return HFTokenizer(byte_level_json(), eos_ids=[0, 2], eos_token="<|endoftext|>", chat_template=CHATML)


def test_byte_level_tokens_stream_whole_characters(hf_tok):
    ids = hf_tok.encode("déjà 東京 🙂!")
    assert hf_tok.decode(ids) == "déjà 東京 🙂!"
    assert b"".join(hf_tok.token_bytes(i) for i in ids) == "déjà 東京 🙂!".encode()
    det = hf_tok.detokenizer()
    pieces = [det.add(i) for i in ids] + [det.flush()]
    assert "".join(pieces) == "déjà 東京 🙂!" and "\ufffd" not in "".join(pieces)
    assert hf_tok.encode("<|im_end|>") == [2]  # special-token text is its id, as transformers encodes it
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        hf_tok.token_bytes(hf_tok.vocab_size)


def test_bad_tokenizer_inputs_are_refused():
    with pytest.raises(TokenizerError, match="cannot be read"):
        HFTokenizer("{not json", eos_ids=[0], eos_token="x")
    with pytest.raises(TokenizerError, match="eos ids"):
        HFTokenizer(byte_level_json(), eos_ids=[10_000], eos_token="x")


def test_chat_templates_render_as_transformers_does():
    chat = Chat([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}])
    assert render_template(CHATML, chat) == ("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi"
                                             "<|im_end|>\n<|im_start|>assistant\n")
    # transformers' {% generation %} block (Huginn's template) renders its body
    gen = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    assert render_template(gen, chat) == "[Be terse.][Hi]"
    refuse = "{{ raise_exception('no system messages') }}"
    with pytest.raises(ChatTemplateError, match="no system messages"):
        render_template(refuse, chat)
    assert render_template("{{ messages | tojson }}", Chat([{"role": "user", "content": "東京"}])) == \
        '[{"role": "user", "content": "東京"}]'
    assert render_plain(chat) == "System: Be terse.\nUser: Hi\nAssistant:"


def test_model_file_embeds_the_tokenizer_and_engine_uses_it(tmp_path, hf_tok):
    cfg = preset("tiny").replace(vocab_size=hf_tok.vocab_size, eos_token_id=0, eos_token_ids=(2,))
    path = write_model(tmp_path / "m.tinyloop", build_model(cfg), tokenizer=hf_tok)
    loaded = load_model(path)
    tok = loaded.tokenizer
    assert isinstance(tok, HFTokenizer) and tok.chat_template == CHATML and tok.eos_ids == [0, 2]
    assert tok.encode("café 🙂") == hf_tok.encode("café 🙂")
    engine = Engine.load(path)
    chat = Chat([{"role": "user", "content": "Hi"}])
    ids = engine.encode_prompt(chat)
    assert ids == hf_tok.encode(render_template(CHATML, chat), add_special_tokens=False)
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1  # the template's specials are single ids
    assert engine.eos_ids == {0, 2}
    out = engine.generate(ids, SamplingParams(max_tokens=6, loops=2))
    assert out.text == tok.decode(out.token_ids)
    logits = engine.logits(ids, loops=2)
    assert logits.dtype == torch.float32 and logits.shape == (len(ids), cfg.vocab_size)
    with pytest.raises(ValidationError, match="loops"):
        engine.logits(ids, loops=0)

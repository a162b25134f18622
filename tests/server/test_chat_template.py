"""A model file with a Hugging Face tokenizer and chat template (an imported checkpoint, issue 15): the chat
routes and /tokenize render the conversation with the model's own template, special tokens as ids, and
stop on every EOS id the file lists."""

from __future__ import annotations

import httpx
import pytest

from .conftest import ServerThread, wait_loaded
from test_hf_tokenizer import CHATML, byte_level_json
from tinyloop.chat import Chat, render_template
from tinyloop.config import preset
from tinyloop.model import build_model
from tinyloop.modelfile.loader import write_model
from tinyloop.server.settings import Settings
from tinyloop.tokenizer import HFTokenizer


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    tok = HFTokenizer(byte_level_json(), eos_ids=[0, 2], eos_token="<|endoftext|>", chat_template=CHATML)
    cfg = preset("tiny").replace(vocab_size=tok.vocab_size, eos_token_id=0, eos_token_ids=(2,))
    path = write_model(tmp_path_factory.mktemp("chat") / "chat.tinyloop", build_model(cfg), tokenizer=tok)
    with ServerThread(Settings(model_path=path)) as srv:
        wait_loaded(srv.url)
        yield srv, tok


def test_chat_routes_use_the_models_template(chat_server):
    srv, tok = chat_server
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "café 🙂"}]
    want = tok.encode(render_template(CHATML, Chat(messages)), add_special_tokens=False)
    r = httpx.post(f"{srv.url}/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == want and want.count(1) == 3  # three <|im_start|> specials, as single ids
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": "tinyloop", "messages": messages, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(want)
    r = httpx.post(f"{srv.url}/tokenize", json={"text": "<|im_end|>"})
    assert r.json()["tokens"] == [2]

"""GPT-2 byte-level BPE (tiktoken underneath, fully offline) and a streaming detokenizer.

The BPE ranks ship in `assets/gpt2/` (MIT, OpenAI; see the README there) and are also embedded in every
`.tinyloop` file, so a model file is all a server needs.
"""

from __future__ import annotations

import base64
import codecs
import hashlib
import json
from importlib import resources
from typing import Iterable

import tiktoken
import tiktoken.load

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"


class TokenizerError(ValueError):
    pass


class Tokenizer:
    def __init__(self, ranks: dict[bytes, int], *, pattern: str = GPT2_PATTERN, eos_token: str = EOT,
                 eos_id: int | None = None):
        self.eos_id = len(ranks) if eos_id is None else eos_id
        self.eos_token = eos_token
        self.pattern = pattern
        self._ranks = ranks
        self._enc = tiktoken.Encoding("tinyloop-gpt2", pat_str=pattern, mergeable_ranks=ranks,
                                      special_tokens={eos_token: self.eos_id})
        self.vocab_size = self._enc.n_vocab

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def gpt2(cls) -> "Tokenizer":
        """The vendored GPT-2 files."""
        base = resources.files("tinyloop") / "assets" / "gpt2"
        with resources.as_file(base / "vocab.bpe") as bpe, resources.as_file(base / "encoder.json") as enc:
            ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(str(bpe), str(enc))
        return cls(ranks)

    def ranks_blob(self) -> bytes:
        """The ranks in tiktoken's text format (`base64(token) rank` per line): what model files embed."""
        lines = (base64.b64encode(tok) + b" " + str(rank).encode() for tok, rank in
                 sorted(self._ranks.items(), key=lambda kv: kv[1]))
        return b"\n".join(lines) + b"\n"

    @classmethod
    def from_ranks_blob(cls, blob: bytes, *, pattern: str = GPT2_PATTERN, eos_token: str = EOT,
                        eos_id: int | None = None) -> "Tokenizer":
        ranks: dict[bytes, int] = {}
        try:
            for line in blob.splitlines():
                if line:
                    tok, rank = line.split()
                    ranks[base64.b64decode(tok)] = int(rank)
        except Exception as exc:  # noqa: BLE001 - any parse failure means a corrupt blob
            raise TokenizerError(f"embedded tokenizer is corrupt: {exc}") from exc
        return cls(ranks, pattern=pattern, eos_token=eos_token, eos_id=eos_id)

    def fingerprint(self) -> str:
        return hashlib.sha256(self.ranks_blob()).hexdigest()

    # -- use ------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Plain text to ids. `<|endoftext|>` inside user text is encoded as ordinary text."""
        return self._enc.encode(text, disallowed_special=())

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts)

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        return self._enc.decode_single_token_bytes(token_id)

    def decode(self, ids: Iterable[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def detokenizer(self) -> "StreamingDetokenizer":
        return StreamingDetokenizer(self)


class StreamingDetokenizer:
    """Turns token ids into text deltas made of whole UTF-8 characters only.

    Incomplete multi-byte sequences are held until they complete; `flush()` returns whatever is held,
    with U+FFFD for bytes that never completed (the native stream's `token_id: -1` event).
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        return self._dec.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character that stands for each byte -> the byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (byte-level BPE or SentencePiece-style byte fallback), run by the
    `tokenizers` library, with the interface of `Tokenizer`: encode, decode, token_bytes, vocab_size,
    eos ids, a streaming detokenizer. `chat_template` is the checkpoint's Jinja template (see `chat.py`).

    Plain text is encoded as transformers encodes it (`add_special_tokens=True`: the tokenizer's own
    post-processor, if any, adds BOS; special-token strings in the text become their ids); a rendered chat
    template is encoded without the post-processor, as `apply_chat_template` does.
    """

    kind = "hf-tokenizers"

    def __init__(self, json_text: str, *, eos_ids: list[int], eos_token: str, chat_template: str | None = None,
                 bos_token: str | None = None):
        from tokenizers import Tokenizer as _HF

        try:
            self._tok = _HF.from_str(json_text)
            spec = json.loads(json_text)
        except Exception as exc:  # noqa: BLE001 - the library's errors name nothing useful to a user
            raise TokenizerError(f"tokenizer.json cannot be read: {exc}") from None
        self.json_text = json_text
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        if not eos_ids or any(not 0 <= i < self.vocab_size for i in eos_ids):
            raise TokenizerError(f"eos ids {eos_ids} are not in the vocabulary (size {self.vocab_size})")
        self.eos_ids = list(eos_ids)
        self.eos_id = self.eos_ids[0]
        self.eos_token = eos_token
        self.bos_token = bos_token
        self.chat_template = chat_template
        self._bytes = self._token_byte_table(spec)

    def _token_byte_table(self, spec: dict) -> list[bytes]:
        """The bytes each id stands for, made once: byte-level tokens map their alphabet back to bytes,
        `<0xNN>` byte-fallback tokens are that byte, U+2581 (SentencePiece's space) is a space, and added
        tokens (special or not) are their text."""
        alphabet = _byte_level_alphabet()
        added = {t["id"]: t["content"] for t in spec.get("added_tokens") or []}
        byte_level = "ByteLevel" in json.dumps(spec.get("decoder") or {})
        table = []
        for i in range(self.vocab_size):
            tok = self._tok.id_to_token(i)
            if i in added or tok is None:
                table.append((added.get(i) or tok or "").encode("utf-8"))
            elif byte_level and all(c in alphabet for c in tok):
                table.append(bytes(alphabet[c] for c in tok))
            elif len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                table.append(bytes([int(tok[3:5], 16)]))
            else:
                table.append(tok.replace("\u2581", " ").encode("utf-8"))
        return table

    def pad_vocab(self, n: int) -> None:
        """Extend to a model's padded vocabulary (e.g. padded to a multiple of 64): the padding ids,
        which no text encodes to, decode to nothing."""
        if n > self.vocab_size:
            self._bytes += [b""] * (n - self.vocab_size)
            self.vocab_size = n

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        return self._bytes[token_id]

    def decode(self, ids: Iterable[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def detokenizer(self) -> "StreamingDetokenizer":
        return StreamingDetokenizer(self)

    def fingerprint(self) -> str:
        return hashlib.sha256(self.json_text.encode("utf-8")).hexdigest()

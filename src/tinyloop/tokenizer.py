"""GPT-2 byte-level BPE (tiktoken underneath, fully offline) and a streaming detokenizer.

The BPE ranks ship in `assets/gpt2/` (MIT, OpenAI; see the README there) and are also embedded in every
`.tinyloop` file, so a model file is all a server needs.
"""

from __future__ import annotations

import base64
import codecs
import hashlib
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

"""TinyLoop's own format: the shipped model (`assets/models/`) and every model `tinyloop train` writes.
Its shapes are `config.PRESETS`; nothing converts into it (its files are written directly), so the entry
has no config or tensor mapping. Its tokenizer is GPT-2's (`assets/gpt2`) unless a file embeds another."""

from __future__ import annotations

from . import Family

FAMILY = Family(name="tinyloop", summary="TinyLoop's own format: the shipped model and `tinyloop train`'s")

"""Names of pulled models and where their files live (json and pathlib only: no torch, no network).

A pulled model is named `hf:ORG/NAME[@REVISION][:int4]` wherever a model path goes. Its file is
`$TINYLOOP_HOME/models/ORG--NAME[@REVISION][--int4].tinyloop` (`$TINYLOOP_HOME` defaults to
`~/.cache/tinyloop`); the header's provenance records the repository, the commit it was converted from
and the converter's version.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

PREFIX = "hf:"
ENV_HOME = "TINYLOOP_HOME"
QUANTS = ("int4",)
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_REF = re.compile(rf"^(?P<org>{_PART})/(?P<name>{_PART})(?:@(?P<rev>[A-Za-z0-9][A-Za-z0-9._/-]{{0,127}}))?"
                  rf"(?::(?P<quant>[a-z0-9]+))?$")


class RefError(ValueError):
    """A model name that is not `ORG/NAME[@REVISION][:int4]`; the message shows the form."""


@dataclass(frozen=True)
class HubRef:
    repo_id: str                 # ORG/NAME
    revision: str | None = None  # a branch, tag or commit; None: the repository's default branch
    quant: str | None = None     # None: the checkpoint's weights converted (bf16); "int4": RTN int4

    @property
    def name(self) -> str:
        """The canonical `hf:` name."""
        return (PREFIX + self.repo_id + (f"@{self.revision}" if self.revision else "")
                + (f":{self.quant}" if self.quant else ""))

    @property
    def file_name(self) -> str:
        stem = self.repo_id.replace("/", "--") + (f"@{self.revision.replace('/', '_')}" if self.revision else "")
        return stem + (f"--{self.quant}" if self.quant else "") + ".tinyloop"


def is_hub_ref(model: object) -> bool:
    return isinstance(model, str) and model.startswith(PREFIX)


def parse_ref(text: str) -> HubRef:
    """`ORG/NAME[@REVISION][:int4]`, with or without the `hf:` prefix."""
    body = text[len(PREFIX):] if text.startswith(PREFIX) else text
    m = _REF.match(body)
    if not m or ".." in body:
        raise RefError(f"{text!r} is not a Hugging Face model name: give ORG/NAME[@REVISION][:int4], "
                       "e.g. ByteDance/Ouro-1.4B or hf:ByteDance/Ouro-1.4B@main:int4")
    quant = m.group("quant")
    if quant is not None and quant not in QUANTS:
        raise RefError(f"{text!r}: unknown quantization {quant!r} (choose one of {list(QUANTS)}, or none for "
                       "the checkpoint's own weights)")
    return HubRef(f"{m.group('org')}/{m.group('name')}", m.group("rev"), quant)


def store_home() -> Path:
    return Path(os.environ.get(ENV_HOME) or Path.home() / ".cache" / "tinyloop")


def models_dir() -> Path:
    return store_home() / "models"


def store_path(ref: HubRef) -> Path:
    return models_dir() / ref.file_name

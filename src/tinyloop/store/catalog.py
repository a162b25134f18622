"""`tinyloop list` and `tinyloop rm`: the models in the store, read from their headers (no torch)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import ModelFileError
from ..modelfile.header import model_info, read_header
from .refs import HubRef, models_dir, parse_ref, store_path


@dataclass
class StoreEntry:
    name: str          # what to pass wherever a model path goes (hf:ORG/NAME[@REV][:int4])
    path: str
    family: str
    size_bytes: int
    quant: str         # bf16, fp16, int4, ...
    source: str        # ORG/NAME@commit
    problem: str | None = None  # set when the file cannot be read (then the other fields are partial)

    def to_dict(self) -> dict:
        return asdict(self)


def entry(path: Path) -> StoreEntry:
    size = path.stat().st_size
    try:
        header, index = read_header(path)
    except ModelFileError as exc:
        return StoreEntry(name=path.name, path=str(path), family="?", size_bytes=size, quant="?", source="?",
                          problem=exc.problem)
    prov = header.get("provenance") or {}
    origin = prov.get("source_provenance") or prov  # a quantized file: the converted file's provenance
    hub = origin.get("hub") or {}
    name = hub.get("name") or str(path)
    source = f"{hub['repo_id']}@{hub.get('commit', '?')}" if hub.get("repo_id") else prov.get("tool", "?")
    return StoreEntry(name=name, path=str(path), family=origin.get("family", "tinyloop"), size_bytes=size,
                      quant=model_info(header, index)["quant"], source=source)


def list_store() -> list[StoreEntry]:
    folder = models_dir()
    if not folder.is_dir():
        return []
    return [entry(p) for p in sorted(folder.glob("*.tinyloop"))]


def remove(name: str) -> Path:
    """Delete a pulled model's file (`hf:ORG/NAME[@REV][:int4]` or ORG/NAME...). Raises FileNotFoundError
    naming what the store holds. The downloaded snapshot stays in the Hugging Face cache."""
    ref: HubRef = parse_ref(name)
    path = store_path(ref)
    if not path.exists():
        held = ", ".join(e.name for e in list_store()) or "nothing"
        raise FileNotFoundError(f"{ref.name} is not in the store ({models_dir()}); it holds: {held}")
    path.unlink()
    return path

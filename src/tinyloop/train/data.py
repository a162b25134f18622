"""Training data: text files -> one memory-mapped uint16 token array per split.

Each input file is split by characters: the last `val_fraction` of it (cut at a line break) is
validation text that training never sees. Token arrays are cached under `cache_dir`, keyed by the
files' contents and the split, so a resumed or repeated run tokenizes nothing.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..tokenizer import Tokenizer


def read_text(path: Path) -> str:
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    return raw.decode("utf-8", errors="replace")


def split_text(text: str, val_fraction: float) -> tuple[str, str]:
    cut = int(len(text) * (1.0 - val_fraction))
    nl = text.rfind("\n", 0, cut)
    cut = nl + 1 if nl > 0 else cut
    return text[:cut], text[cut:]


@dataclass
class TokenData:
    train: np.ndarray  # uint16 memmap
    val: np.ndarray
    manifest: dict

    def batch(self, split: str, batch: int, seq: int, rng: np.random.Generator) -> np.ndarray:
        """(batch, seq + 1) windows at random offsets: inputs [:, :-1], targets [:, 1:]."""
        arr = self.train if split == "train" else self.val
        starts = rng.integers(0, len(arr) - seq - 1, size=batch)
        return np.stack([np.asarray(arr[s:s + seq + 1], dtype=np.int64) for s in starts])


def prepare(files: list[str | Path], cache_dir: str | Path, tokenizer: Tokenizer,
            val_fraction: float = 0.01) -> TokenData:
    files = [Path(f) for f in files]
    if not files:
        raise ValueError("no training files given")
    h = hashlib.sha256(f"v1 {val_fraction} {tokenizer.fingerprint()}".encode())
    for f in files:
        h.update(f.name.encode())
        h.update(hashlib.sha256(f.read_bytes()).digest())
    key = h.hexdigest()[:16]
    cache = Path(cache_dir) / key
    manifest_path = cache / "manifest.json"
    if not manifest_path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        per_file = []
        parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
        eot = np.array([tokenizer.eos_id], dtype=np.uint16)
        for f in files:
            train_text, val_text = split_text(read_text(f), val_fraction)
            row = {"file": f.name, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
            for split, text in (("train", train_text), ("val", val_text)):
                ids = np.array(tokenizer.encode(text), dtype=np.uint16)
                parts[split] += [ids, eot]
                row[f"{split}_tokens"] = int(len(ids))
            per_file.append(row)
        for split in ("train", "val"):
            np.concatenate(parts[split]).tofile(cache / f"{split}.bin")
        manifest = {"files": per_file, "val_fraction": val_fraction,
                    "split": f"last {val_fraction:.0%} of each file (cut at a line break) is validation",
                    "train_tokens": sum(r["train_tokens"] for r in per_file),
                    "val_tokens": sum(r["val_tokens"] for r in per_file)}
        manifest_path.write_text(json.dumps(manifest, indent=1))
    manifest = json.loads(manifest_path.read_text())
    train = np.memmap(cache / "train.bin", dtype=np.uint16, mode="r")
    val = np.memmap(cache / "val.bin", dtype=np.uint16, mode="r")
    return TokenData(train=train, val=val, manifest=manifest)

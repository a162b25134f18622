"""Training data: text files -> one memory-mapped uint16 token array per split.

Each input file is split by characters: the last `val_fraction` of it (cut at a line break) is
validation text that training never sees. Token arrays are cached under `cache_dir`, keyed by the
files' contents and the split, so a resumed or repeated run tokenizes nothing. `read_calibration`
draws token windows from the training part (GPTQ calibration, draft-exit training) or the held-out part.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..quant.packing import QuantError
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


def read_calibration(paths: str | Path | list[str | Path], tokenizer: Tokenizer, n_tokens: int, seq_len: int,
                     seed: int = 0, val_fraction: float = 0.0, held_out: bool = False) -> torch.Tensor:
    """(n_tokens // seq_len, seq_len) token windows at seeded random offsets of text files (.txt or .txt.gz).

    Windows are spread evenly over the files. With `val_fraction` > 0 only the part of each file that
    `tinyloop train` trains on is read (its last `val_fraction`, cut at a line break, is left out), so a
    model calibrated this way is still scored on text it never saw; `held_out=True` reads that last part
    instead (evaluation windows).
    """
    paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    if not paths:
        raise QuantError("no calibration file given")
    if not 0.0 <= val_fraction < 1.0 or (held_out and val_fraction == 0.0):
        raise QuantError(f"calibration val_fraction must be in [0, 1) (> 0 for held-out windows), got {val_fraction}")
    n_seq = max(1, n_tokens // seq_len)
    g = torch.Generator().manual_seed(seed)
    windows = []
    for i, path in enumerate(paths):
        if not path.exists():
            raise QuantError(f"calibration file {path} does not exist")
        text = read_text(path)
        if val_fraction > 0:
            text = split_text(text, val_fraction)[1 if held_out else 0]
        ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
        if len(ids) < seq_len + 1:
            raise QuantError(f"calibration file {path} has {len(ids)} tokens; need at least {seq_len + 1}")
        n_here = n_seq // len(paths) + (1 if i < n_seq % len(paths) else 0)
        starts = torch.randint(0, len(ids) - seq_len, (n_here,), generator=g)
        windows += [ids[s:s + seq_len] for s in starts.tolist()]
    return torch.stack(windows)  # (N, T)


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

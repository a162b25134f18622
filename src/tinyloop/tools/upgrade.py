"""`tinyloop upgrade FILE [-o OUT]`: rewrite a model file of an older format in the current one.

A version 1 file stores q/k/v and gate/up under separate names, so every load fuses them in memory (a
private copy of nearly every weight, announced by a one-line notice). Upgrading writes the same tensors in
the run-time layout (`modelfile.layout`, format version 2): each part at its rows of the fused tensor, streamed
from the mapped input, bytes unchanged. The result replaces FILE (or goes to OUT) atomically: a temporary
file beside it, then a rename, so a failure leaves the original as it was. The header is kept, with the
upgrade recorded in its provenance.

The refusals (a missing file, a file that is not a `.tinyloop` one, a file already in the current layout)
read only the header, without importing torch.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from ..errors import ModelFileError
from ..modelfile.header import FORMAT_VERSION, read_header
from ..modelfile.layout import FUSED_VERSION
from ..version import __version__


def upgrade(src: str | Path, out: str | Path | None = None) -> Path:
    """Rewrite the model file `src` in the current layout, to `out` (default: over `src`). Raises
    ModelFileError naming the problem (nothing is written then)."""
    src = Path(src)
    out = src if out is None else Path(out)
    header, index = read_header(src)
    version = header["format_version"]
    if version >= FUSED_VERSION:
        raise ModelFileError(src, f"already has the current layout (format version {version}): nothing to upgrade")
    import torch

    from ..modelfile.loader import TORCH_DTYPES_BY_NAME, check_header, expected_tensors, map_tensors, read_tokenizer
    from ..modelfile.writer import ModelFileWriter

    cfg = check_header(src, header, index)  # a corrupt file is refused before anything is written
    tensors = map_tensors(src, index)
    blob = tensors.pop(header["tokenizer"]["tensor"]).numpy().tobytes()
    read_tokenizer(src, header, blob, cfg)  # its checksum
    new = {**header, "format_version": FORMAT_VERSION,
           "provenance": {**header.get("provenance", {}),
                          "upgraded": {"from_format_version": version, "tool_version": __version__,
                                       "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}}}
    specs = {k: (shape, TORCH_DTYPES_BY_NAME[dt])
             for k, (shape, dt) in expected_tensors(cfg, header["weights"], FORMAT_VERSION).items()}
    with torch.inference_mode(), ModelFileWriter(out, specs, new, blob) as writer:
        for name, t in tensors.items():
            writer.add(name, t)
    return out


def _upgrade(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    try:
        out = upgrade(args.file, args.output)
    except ModelFileError as exc:
        print(f"tinyloop: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} in format version {FORMAT_VERSION} ({out.stat().st_size / 2**20:.1f} MiB, "
          f"{time.perf_counter() - t0:.1f} s): it now loads without copying its weights")
    return 0


def add_command(sub) -> None:
    up = sub.add_parser("upgrade", help="rewrite a model file of an older TinyLoop in the current layout",
                        description="Rewrites FILE (format version 1: loaded with a copy of its weights) in "
                        "the current format, whose tensors the engine uses where they lie in the mapped file. "
                        "Atomic: FILE is replaced only once the new file is complete.")
    up.add_argument("file", help="the .tinyloop file to upgrade")
    up.add_argument("-o", "--output", help="write the upgraded file here instead of replacing FILE")
    up.set_defaults(func=_upgrade)

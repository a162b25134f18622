"""Progress bars for long commands (`tinyloop eval`, the benchmarks): tqdm on stderr, shown only when
stderr is a terminal and the user did not ask for `--quiet`, so logs and pipes stay clean."""

from __future__ import annotations

import sys


def progress(total: int | None = None, desc: str = "", unit: str = "it", quiet: bool = False, **kw):
    """A tqdm bar on stderr; disabled (every call a no-op) when quiet or stderr is not a terminal."""
    from tqdm import tqdm

    shown = not quiet and sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False,
                disable=not shown, **kw)

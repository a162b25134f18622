"""The host a benchmark ran on, as its JSON records it: the CPU's model name (`lscpu`'s "Model name") and cores."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def host() -> str:
    return f"{cpu_name()}, {os.cpu_count()} cores"

"""`tinyloop ps`: the models a running server serves, as `ollama ps` shows them: state, memory, keep_alive,
requests running and waiting (read from its GET /v1/models)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any


def fetch_models(url: str, api_key: str | None = None, timeout: float = 10.0) -> list[dict[str, Any]]:
    request = urllib.request.Request(url.rstrip("/") + "/v1/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())["data"]


def _mib(n: int | None) -> str:
    if not n:
        return "-"
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def _until(status: dict[str, Any]) -> str:
    if status.get("state") != "loaded":
        return "-"
    if status.get("pinned"):
        return "forever (pinned)"
    if status.get("unloading_when_idle"):
        return "when idle (making room)"
    left = status.get("expires_in_s")
    if left is None and status.get("replicas") is not None:   # Ray Serve: its deployment scales to zero
        return f"about {status.get('keep_alive')} after the last request"
    if left is None:
        return "until room is needed" if status.get("running", 0) == 0 or status.get("keep_alive") is None \
            else f"{status['keep_alive']} after the last request"
    return f"{left:.0f}s" if left < 120 else f"{left / 60:.0f}m"


def table(models: list[dict[str, Any]]) -> str:
    rows = [("NAME", "STATE", "MEMORY", "UNTIL", "RUNNING", "WAITING")]
    for card in models:
        st = card.get("tinyloop") or {}
        state = st.get("state", "loaded")
        if state == "failed" and st.get("error"):
            state = f"failed: {st['error']}"
        memory = st.get("memory_bytes") or (f"~{_mib(st.get('memory_estimate_bytes'))}"
                                            if st.get("memory_estimate_bytes") else 0)
        rows.append((card["id"], state, memory if isinstance(memory, str) else _mib(memory), _until(st),
                     str(st.get("running", 0)), str(st.get("waiting", 0))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows)


def run(url: str, as_json: bool = False) -> int:
    import sys

    try:
        models = fetch_models(url, os.environ.get("TINYLOOP_API_KEY", "").split(",")[0].strip() or None)
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        why = getattr(exc, "reason", None) or exc
        print(f"tinyloop: error: cannot read {url}/v1/models: {why} (is `tinyloop serve` running there? "
              "--url)", file=sys.stderr)
        return 1
    print(json.dumps(models, indent=2) if as_json else table(models))
    return 0

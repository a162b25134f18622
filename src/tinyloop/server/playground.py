"""The playground: a page at `/` to talk to the model from a browser.

Plain HTML, CSS and JavaScript in `static/` (no build step, no CDN: it works on a machine without network).
The page calls this server's own `/api/v0` routes, the OpenAI-compatible ones plus the looped model's knobs,
exactly as any client would, with the API key the user types in when the server needs one. The page's
own files carry no model data, so they are served without a key (`PATHS`, used by the auth gate), and so is
`/favicon.ico`, which browsers ask every server for.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

STATIC = Path(__file__).with_name("static")
FILES = {  # URL path -> (file in static/, media type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/playground.js": ("playground.js", "text/javascript; charset=utf-8"),
    "/static/playground.css": ("playground.css", "text/css; charset=utf-8"),
    "/favicon.ico": ("favicon.ico", "image/x-icon"),   # a loop (32x32); browsers ask for it on every page
}
PATHS = frozenset(FILES)

router = APIRouter()


def _route(name: str, media_type: str):
    cache = "max-age=86400" if name == "favicon.ico" else "no-cache"

    async def serve_file() -> Response:
        return Response((STATIC / name).read_bytes(), media_type=media_type, headers={"Cache-Control": cache})

    return serve_file


for _path, (_name, _media) in FILES.items():
    router.add_api_route(_path, _route(_name, _media), methods=["GET"], include_in_schema=False)

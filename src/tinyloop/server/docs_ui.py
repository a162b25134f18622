"""The interactive API page at /docs: Swagger UI served from this server, not from a CDN, so that it
works on a machine without network.

The assets come from the `swagger-ui-bundle-v2` package (Swagger UI 5, Apache-2.0; the `swagger_ui_bundle`
module, maintained by the connexion project). Swagger UI 5 is needed because FastAPI writes OpenAPI 3.1.
The asset files hold no model data, so they are served without an API key (`PATHS`, used by the auth gate),
like the playground's.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import Response

ASSETS = "/docs/assets"
FILES = {  # file name -> media type
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon-32x32.png": "image/png",
}
PATHS = frozenset(f"{ASSETS}/{name}" for name in FILES)

router = APIRouter()


def asset_dir():
    from swagger_ui_bundle import swagger_ui_path

    return swagger_ui_path


@router.get("/docs", include_in_schema=False)
async def swagger_ui() -> Response:
    return get_swagger_ui_html(openapi_url="/openapi.json", title="TinyLoop - API",
                               swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
                               swagger_css_url=f"{ASSETS}/swagger-ui.css",
                               swagger_favicon_url=f"{ASSETS}/favicon-32x32.png",
                               oauth2_redirect_url="/docs/oauth2-redirect")


@router.get("/docs/oauth2-redirect", include_in_schema=False)
async def swagger_ui_redirect() -> Response:
    return get_swagger_ui_oauth2_redirect_html()


def _asset(name: str, media_type: str):
    async def serve_asset() -> Response:
        data = (asset_dir() / name).read_bytes()
        return Response(data, media_type=media_type, headers={"Cache-Control": "public, max-age=86400"})

    return serve_asset


for _name, _media in FILES.items():
    router.add_api_route(f"{ASSETS}/{_name}", _asset(_name, _media), methods=["GET"], include_in_schema=False)

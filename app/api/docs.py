"""The OpenAPI docs at `/docs`: Swagger UI served from this server, never from a CDN.

Corral runs where there is no internet, and FastAPI's own `/docs` loads Swagger UI from
cdn.jsdelivr.net: a blank page offline. Here the page references only this server's paths; its script
and style come from `node_modules/swagger-ui-dist` (package.json, installed by `npm ci`, which
`make install` runs). Without them `/docs` is a 500 page saying so, not a blank page. There is no
`/redoc`: the ReDoc bundle pulls React and a telemetry package into the install.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse

from app.web.views import NODE_MODULES

SWAGGER_UI = NODE_MODULES / "swagger-ui-dist"
ASSETS = {  # served name -> media type; the files of swagger-ui-dist the page loads
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
}
ASSETS_PATH = "/docs/assets"
NOT_INSTALLED = "Swagger UI is not installed: run `make install` (it runs `npm ci`) and restart the server."


def mount_docs(app: FastAPI, swagger_ui: Path = SWAGGER_UI) -> None:
    """Add `/docs` and its assets (from `swagger_ui`) to `app`, made with `docs_url=None`."""
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        if not all((swagger_ui / name).is_file() for name in ASSETS):
            body = f"<!doctype html><title>Corral: API docs unavailable</title><p>{NOT_INSTALLED}</p>"
            return HTMLResponse(body, status_code=500)
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{app.title} - API docs",
            swagger_js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_PATH}/swagger-ui.css",
            swagger_favicon_url="/static/favicon.svg",
        )

    @app.get(ASSETS_PATH + "/{name}", include_in_schema=False)
    async def docs_asset(name: str) -> Response:
        path = swagger_ui / name
        if name not in ASSETS or not path.is_file():
            said = NOT_INSTALLED if name in ASSETS else "unknown"
            return Response(f"{name}: {said}", status_code=404, media_type="text/plain")
        return FileResponse(path, media_type=ASSETS[name], headers={"Cache-Control": "max-age=3600"})

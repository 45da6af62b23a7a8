"""`/docs` works offline: Swagger UI from this server's own paths, or a page saying how to install it."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from api_support import make_settings
from fastapi import FastAPI

from app.api.app import create_app
from app.api.docs import mount_docs


def make_client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


def referenced_urls(page: str) -> list[str]:
    """Every address the page loads: scripts, styles, icons and the schema Swagger UI fetches."""
    return re.findall(r'(?:src|href)="([^"]+)"', page) + re.findall(r"url: '([^']+)'", page)


async def test_docs_load_only_this_servers_files(tmp_path: Path) -> None:
    app = create_app(make_settings(tmp_path, f"sqlite:///{tmp_path / 'corral.db'}"))
    async with make_client(app) as client:
        page = await client.get("/docs")
        assert page.status_code == 200
        assert "text/html" in page.headers["content-type"]
        assert not re.search(r"https?://", page.text), "the page names another host"
        urls = referenced_urls(page.text)
        assert {"/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css", "/openapi.json"} <= set(
            urls
        )
        for url in urls:
            answer = await client.get(url)
            assert answer.status_code == 200, url
            assert answer.content, url
        assert (
            (await client.get("/docs/assets/swagger-ui.css")).headers["content-type"].startswith("text/css")
        )
        assert (await client.get("/redoc")).status_code == 404  # off: its bundle is not installed
        assert (
            await client.get("/docs/assets/index.html")
        ).status_code == 404  # only the files the page uses


async def test_docs_without_swagger_ui_installed_say_to_run_make_install(tmp_path: Path) -> None:
    app = FastAPI(docs_url=None, redoc_url=None)
    mount_docs(app, swagger_ui=tmp_path / "missing")
    async with make_client(app) as client:
        page = await client.get("/docs")
        asset = await client.get("/docs/assets/swagger-ui-bundle.js")
    assert page.status_code == 500
    assert "run `make install`" in page.text
    assert asset.status_code == 404
    assert "run `make install`" in asset.text

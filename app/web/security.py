"""Who may look and who may act, and CSRF protection for the dashboard's forms.

- Viewing is open when no view token is set; otherwise it needs the view token or the operator token.
- Acting (launch, publish, policy, stop, loading a replay) needs the operator token.
- A token comes from `Authorization: Bearer …` or from the `corral_token` cookie that the sign-in form
  sets (HttpOnly, SameSite=Strict). Tokens are compared in constant time and never put in URLs.
- CSRF: a double-submit token. Every page sets a random `corral_csrf` cookie (SameSite=Strict) and
  writes the same value into its forms (hidden field `csrf_token`) and into the `X-CSRF-Token` header
  of htmx requests. A state-changing request is refused unless the submitted value equals the cookie.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

TOKEN_COOKIE = "corral_token"
CSRF_COOKIE = "corral_csrf"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"


@dataclass(frozen=True)
class AccessConfig:
    operator_token: str
    view_token: str | None = None


def _same(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and hmac.compare_digest(a.encode(), b.encode())


def request_token(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return request.cookies.get(TOKEN_COOKIE)


def is_operator(request: Request, access: AccessConfig) -> bool:
    return _same(request_token(request), access.operator_token)


def can_view(request: Request, access: AccessConfig) -> bool:
    if access.view_token is None:
        return True
    token = request_token(request)
    return _same(token, access.view_token) or _same(token, access.operator_token)


def csrf_token(request: Request) -> str:
    """The request's CSRF token: the cookie's, or a fresh one (the response must set it)."""
    existing = request.cookies.get(CSRF_COOKIE)
    if existing and 20 <= len(existing) <= 100:
        return existing
    return secrets.token_urlsafe(32)


def set_csrf_cookie(response: Response, request: Request, token: str) -> None:
    if request.cookies.get(CSRF_COOKIE) != token:
        response.set_cookie(
            CSRF_COOKIE, token, httponly=True, samesite="strict", secure=request.url.scheme == "https"
        )


def csrf_ok(request: Request, submitted: str | None) -> bool:
    cookie = request.cookies.get(CSRF_COOKIE)
    header = request.headers.get(CSRF_HEADER)
    return _same(cookie, submitted) or _same(cookie, header)


def set_token_cookie(response: Response, request: Request, token: str) -> None:
    response.set_cookie(
        TOKEN_COOKIE, token, httponly=True, samesite="strict", secure=request.url.scheme == "https"
    )

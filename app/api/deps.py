"""What the API's routes share: the run manager from the app, bearer-token checks, answers for errors.

Tokens: operator actions (create, publish, policy, pause, resume, stop, ack, delete) need the operator
token as `Authorization: Bearer <token>`; reads need the view token when one is configured (or the
operator's). Tokens are compared in constant time. `X-Corral-Actor` names who acted, for the audit
trail: its bytes are read as UTF-8 (HTTP hands header values over as latin-1), and a name that is not
UTF-8 is a 422.
"""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request, status

from app.service.handle import RunHandle
from app.service.manager import ENDED_STATES, RunManager
from app.settings import Settings


def get_manager(request: Request) -> RunManager:
    manager: RunManager = request.app.state.manager
    return manager


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _matches(token: str | None, expected: str | None) -> bool:
    """Whether the header's token is `expected`. Compared as bytes: the header's as sent (the server
    decoded them as latin-1), the setting's as UTF-8; a str with a non-ASCII character made
    `compare_digest` raise, and a token such as "tök" was a 500 with a traceback, not a 403."""
    if token is None or expected is None:
        return False
    return secrets.compare_digest(token.encode("latin-1", "replace"), expected.encode())


def require_operator(
    settings: Annotated[Settings, Depends(get_settings)],
    authorization: Annotated[str | None, Header()] = None,
    x_corral_actor: Annotated[str | None, Header(max_length=64)] = None,
) -> str:
    """The acting operator's name (for the audit trail), once the operator token checks out."""
    token = _bearer(authorization)
    if token is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "this action needs the operator token: Authorization: Bearer <token>",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not _matches(token, settings.operator_token):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "the token given is not the operator token")
    return _utf8_header("X-Corral-Actor", x_corral_actor) or "operator"


def _utf8_header(name: str, value: str | None) -> str | None:
    """A header's value as the UTF-8 its bytes spell (the server decoded them as latin-1)."""
    if value is None:
        return None
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        raise HTTPException(422, f"{name}: not valid UTF-8") from None


def require_viewer(
    settings: Annotated[Settings, Depends(get_settings)],
    authorization: Annotated[str | None, Header()] = None,
) -> None:
    if settings.view_token is None:
        return
    token = _bearer(authorization)
    if not (_matches(token, settings.view_token) or _matches(token, settings.operator_token)):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "reads need the view token: Authorization: Bearer <token>",
            headers={"WWW-Authenticate": "Bearer"},
        )


def live_handle(manager: RunManager, run_id: str) -> RunHandle:
    """The run executing in this server; 404 for an unknown run, 409 for one that is not executing:
    for a run that has ended (before a restart, say), "has ended (<state>)", as the run itself answers
    once it has ended."""
    handle = manager.get(run_id)
    if handle is not None:
        return handle
    refuse_while_resuming(manager, run_id)
    record = manager.store.get_run(run_id)
    if record is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id!r}")
    raise HTTPException(status.HTTP_409_CONFLICT, not_executing(run_id, record.state))


RESUMING_RETRY_AFTER_S = 5


def refuse_while_resuming(manager: RunManager, run_id: str) -> None:
    """503 with a Retry-After for a run of the previous server not yet resumed here (its stored stream
    is being replayed): it will take commands and hand out batches in a moment, and a trainer told
    "not executing" (409) would stop asking."""
    if run_id in manager.resuming:
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            f"run {run_id!r} is being resumed after a restart; try again in a few seconds",
            headers={"Retry-After": str(RESUMING_RETRY_AFTER_S)},
        )


def not_executing(run_id: str, state: str, ended: str = "") -> str:
    """Why a stored run that is not executing here takes no command."""
    if state in ENDED_STATES:
        return f"run {run_id!r} has ended ({state}){ended}"
    return f"run {run_id!r} is not executing in this server"


Manager = Annotated[RunManager, Depends(get_manager)]
Operator = Annotated[str, Depends(require_operator)]
Viewer = Annotated[None, Depends(require_viewer)]

"""`SGLangEngine`: the `Engine` port over an SGLang server's native control routes.

Routes and bodies (sglang srt/entrypoints/http_server.py and managers/io_struct.py):

- generate: `POST /v1/completions`, the OpenAI shape as for vLLM (docs/engines.md).
- pause(mode): `POST /pause_generation {"mode": "abort" | "in_place" | "retract"}`
  → `{"message": ..., "status": "ok"}`.
- resume: `POST /continue_generation {}` → `{"message": ..., "status": "ok"}`.
- publish_weights: `POST /update_weights_from_disk {"model_path": dir, "weight_version": str}`
  → `{"success": bool, "message": str, "num_paused_requests": int}`; HTTP 400 when the load fails.
- weight_version: `GET /get_weight_version` → `{"weight_version": str | null}` (newer SGLang also reports
  it in `/model_info`).
- reset_prefix_cache: `POST /flush_cache` → plain text.
- health: `GET /health` → empty 200.

Mode mapping: `keep` → `in_place` (requests stay in the running batch with their KV cache and continue
after `/continue_generation`, like vLLM's keep); `abort` → `abort`. SGLang has no `wait` mode, so
`pause(WAIT)` raises `ValueError` rather than silently doing something else.

Invariants: the same as `VLLMEngine` (typed errors naming URL and route, no retries, the known version
moves only after a successful load, a turn reports the version known when it was sent). A 200 answer
with `"success": false` is an `EngineRequestError` too: the load did not happen.
"""

from __future__ import annotations

from app.engines.base import PauseMode, TurnRequest, TurnResult
from app.engines.errors import EngineRequestError
from app.engines.vllm import HTTPEngineClient, completion_body, finished_choice, get_field

_PAUSE_MODES = {PauseMode.ABORT: "abort", PauseMode.KEEP: "in_place"}


class SGLangEngine(HTTPEngineClient):
    """An `Engine` behind an SGLang server (`python -m sglang.launch_server`)."""

    async def generate(self, request: TurnRequest) -> TurnResult:
        route = "/v1/completions"
        sent_version = self._known_version
        answer = await self._http.request_json("POST", route, json=completion_body(self.model, request))
        choice0, tokens = finished_choice(self._http, route, answer)
        text: str = get_field(self._http, route, choice0, "text", str)
        chosen = None
        if request.candidates:
            # SGLang has no candidate scoring; report which candidate, if any, it reproduced.
            chosen = next((i for i, c in enumerate(request.candidates) if c.strip() == text.strip()), None)
        return TurnResult(
            text=text,
            weight_version=sent_version,
            tokens=tokens,
            choice=chosen,
        )

    async def pause(self, mode: PauseMode) -> None:
        mode = PauseMode(mode)
        if mode not in _PAUSE_MODES:
            raise ValueError(f"engine {self.name} ({self._http.base_url}): SGLang has no pause mode {mode!r}")
        await self._http.request(
            "POST", "/pause_generation", json={"mode": _PAUSE_MODES[mode]}, timeout_s=self._control_timeout_s
        )

    async def resume(self) -> None:
        await self._http.request("POST", "/continue_generation", json={}, timeout_s=self._control_timeout_s)

    async def publish_weights(self, version: int, path: str | None) -> None:
        route = "/update_weights_from_disk"
        if path is None:
            raise ValueError(f"engine {self.name} ({self._http.base_url}): needs a checkpoint path")
        answer = await self._http.request_json(
            "POST",
            route,
            json={"model_path": path, "weight_version": str(version)},
            timeout_s=self._control_timeout_s,
        )
        if get_field(self._http, route, answer, "success", bool) is not True:
            raise EngineRequestError(self._http.base_url, route, 200, str(answer.get("message", answer)))
        self._known_version = version

    async def weight_version(self) -> int:
        """`GET /get_weight_version`; a null version falls back to the client's known version."""
        return await self._http.read_version("/get_weight_version", self._known_version)

    async def reset_prefix_cache(self) -> None:
        await self._http.request("POST", "/flush_cache", timeout_s=self._control_timeout_s)

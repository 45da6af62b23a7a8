"""Contract tests: `VLLMEngine` against a real stub vLLM server (stub_vllm.py) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from stub_vllm import RunningStub, free_port

from app.engines.base import Engine, PauseMode, TurnRequest
from app.engines.errors import (
    EngineError,
    EngineProtocolError,
    EngineRequestError,
    EngineServerError,
    EngineTimeout,
    EngineUnavailable,
    TurnAborted,
)
from app.engines.sglang import SGLangEngine
from app.engines.vllm import HTTPTransport, VLLMEngine


def make_engine(stub: RunningStub, **overrides: object) -> VLLMEngine:
    kwargs: dict[str, object] = {"name": "e0", "base_url": stub.url, "model": "stub-model", "timeout_s": 5.0}
    kwargs.update(overrides)
    return VLLMEngine(**kwargs)  # type: ignore[arg-type]


async def wait_generation_started(stub: RunningStub) -> None:
    assert await asyncio.to_thread(stub.state.generation_started.wait, 5.0), "no generation started"


def make_checkpoint(root: Path, name: str = "step-1") -> str:
    ckpt = root / name
    ckpt.mkdir()
    save_file({"w": torch.zeros(2, 2)}, str(ckpt / "model.safetensors"))
    return str(ckpt)


def test_vllm_engine_satisfies_engine_port(stub: RunningStub) -> None:
    engine: Engine = make_engine(stub)
    assert engine.name == "e0"


async def test_generate_posts_completion_and_reads_usage(stub: RunningStub) -> None:
    async with make_engine(stub) as engine:
        result = await engine.generate(TurnRequest(prompt="one two three four five", max_tokens=3))
    assert result.text == "one two three"
    assert result.tokens == 3
    assert result.weight_version == 0
    assert result.choice is None
    assert stub.state.calls == ["/v1/completions"]


async def test_generate_with_candidates_uses_corral_extension(stub: RunningStub) -> None:
    stub.state.corral_extension = True
    async with make_engine(stub) as engine:
        result = await engine.generate(TurnRequest(prompt="abcd", candidates=("ls", "cat x", "pwd")))
    assert result.choice == len("abcd") % 3
    assert result.text == ("ls", "cat x", "pwd")[result.choice]
    assert result.logprob == pytest.approx(-0.5)


async def test_generate_with_candidates_without_extension_matches_text(stub: RunningStub) -> None:
    async with make_engine(stub) as engine:
        result = await engine.generate(TurnRequest(prompt="abc", candidates=("a", "b", "c")))
    assert result.choice == 0
    assert result.logprob is None


async def test_chat_reads_message_content(stub: RunningStub) -> None:
    async with make_engine(stub) as engine:
        result = await engine.chat([{"role": "user", "content": "hello there"}], max_tokens=8)
    assert result.text == "hello there"
    assert result.tokens == 2


async def test_pause_resume_is_paused(stub: RunningStub) -> None:
    async with make_engine(stub) as engine:
        assert await engine.is_paused() is False
        await engine.pause(PauseMode.KEEP)
        assert await engine.is_paused() is True
        assert stub.state.pause_mode == "keep"
        await engine.resume()
        assert await engine.is_paused() is False


async def test_publish_weights_runs_disk_sequence_once_initialised(stub: RunningStub, tmp_path: Path) -> None:
    async with make_engine(stub) as engine:
        await engine.publish_weights(1, make_checkpoint(tmp_path, "step-1"))
        await engine.publish_weights(2, make_checkpoint(tmp_path, "step-2"))
        assert engine.known_version == 2
        assert await engine.weight_version() == 2
    assert stub.state.calls == [
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/weight_info",
    ]
    assert stub.state.loaded_paths == [str(tmp_path / "step-1"), str(tmp_path / "step-2")]
    assert stub.state.weight_version == "2"


async def test_generate_reports_version_known_at_send(stub: RunningStub, tmp_path: Path) -> None:
    async with make_engine(stub, initial_version=4) as engine:
        assert (await engine.generate(TurnRequest(prompt="x"))).weight_version == 4
        await engine.publish_weights(5, make_checkpoint(tmp_path))
        assert (await engine.generate(TurnRequest(prompt="x"))).weight_version == 5


async def test_weight_version_null_falls_back_to_known_version(stub: RunningStub) -> None:
    async with make_engine(stub, initial_version=3) as engine:
        assert stub.state.weight_version is None
        assert await engine.weight_version() == 3


@pytest.mark.parametrize("reported", ["step-100", "٣", "３", "-3", "1" * 5000, 2.0, True])
async def test_weight_version_non_integer_is_protocol_error(stub: RunningStub, reported: object) -> None:
    """Only ASCII digits (or a JSON integer) are a version: `isdecimal` took '٣' and '３' as 3."""
    stub.state.weight_version = reported
    async with make_engine(stub) as engine:
        with pytest.raises(EngineProtocolError, match="/weight_info"):
            await engine.weight_version()


async def test_publish_weights_rejects_missing_or_relative_path(stub: RunningStub) -> None:
    async with make_engine(stub) as engine:
        with pytest.raises(ValueError, match="needs a checkpoint path"):
            await engine.publish_weights(1, None)
        with pytest.raises(ValueError, match="not absolute"):
            await engine.publish_weights(1, "relative/dir")
    assert stub.state.calls == []


async def test_failed_update_leaves_known_version_and_allows_retry(stub: RunningStub, tmp_path: Path) -> None:
    async with make_engine(stub) as engine:
        with pytest.raises(EngineServerError, match="/update_weights") as info:
            await engine.publish_weights(1, str(tmp_path / "missing"))
        assert info.value.status == 500
        assert engine.known_version == 0
        await engine.publish_weights(1, make_checkpoint(tmp_path))
        assert engine.known_version == 1


async def test_update_outside_session_is_409(stub: RunningStub, tmp_path: Path) -> None:
    # A session left open (e.g. by another client) makes the next start a 409, as in vLLM.
    stub.state.transfer_initialized = True
    stub.state.updating = True
    async with make_engine(stub) as engine:
        with pytest.raises(EngineRequestError, match="/start_weight_update") as info:
            await engine.publish_weights(1, make_checkpoint(tmp_path))
    assert info.value.status == 409
    assert "already in progress" in info.value.body


async def test_reset_prefix_cache_and_health(stub: RunningStub) -> None:
    async with make_engine(stub) as engine:
        await engine.reset_prefix_cache()
        assert stub.state.prefix_cache_resets == 1
        assert await engine.health() is True
        stub.state.healthy = False
        assert await engine.health() is False


async def test_4xx_raises_request_error_naming_url_and_route(stub: RunningStub) -> None:
    stub.state.fail_next("/resume", 400, '{"error": "bad"}')
    async with make_engine(stub) as engine:
        with pytest.raises(EngineRequestError) as info:
            await engine.resume()
    err = info.value
    assert err.status == 400
    assert err.body == '{"error": "bad"}'
    assert stub.url in str(err)
    assert "/resume" in str(err)


async def test_unknown_model_is_request_error(stub: RunningStub) -> None:
    async with make_engine(stub, model="other") as engine:
        with pytest.raises(EngineRequestError, match="does not exist") as info:
            await engine.generate(TurnRequest(prompt="x"))
    assert info.value.status == 404


async def test_5xx_raises_server_error(stub: RunningStub) -> None:
    stub.state.fail_next("/v1/completions", 503, "overloaded")
    async with make_engine(stub) as engine:
        with pytest.raises(EngineServerError, match="/v1/completions") as info:
            await engine.generate(TurnRequest(prompt="x"))
    assert info.value.status == 503
    assert info.value.body == "overloaded"


async def test_timeout_raises_engine_timeout(stub: RunningStub) -> None:
    stub.state.delay_next("/v1/completions", 1.0)
    async with make_engine(stub, timeout_s=0.2) as engine:
        with pytest.raises(EngineTimeout, match=r"/v1/completions: timed out"):
            await engine.generate(TurnRequest(prompt="x"))


async def test_control_timeout_applies_to_pause(stub: RunningStub) -> None:
    stub.state.delay_next("/pause", 1.0)
    async with make_engine(stub, timeout_s=5.0, control_timeout_s=0.2) as engine:
        with pytest.raises(EngineTimeout, match="/pause"):
            await engine.pause(PauseMode.WAIT)


async def test_connection_refused_raises_unavailable_and_health_is_false() -> None:
    port = free_port()  # bound then released: nothing listens there
    engine = VLLMEngine("dead", f"http://127.0.0.1:{port}", "m", timeout_s=2.0)
    try:
        with pytest.raises(EngineUnavailable, match=f"127.0.0.1:{port} /v1/completions"):
            await engine.generate(TurnRequest(prompt="x"))
        with pytest.raises(EngineUnavailable):
            await engine.pause(PauseMode.ABORT)
        assert await engine.health() is False
    finally:
        await engine.aclose()


async def test_connection_dropped_raises_unavailable() -> None:
    # A server that accepts and closes without answering.
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    engine = VLLMEngine("drop", f"http://127.0.0.1:{port}", "m", timeout_s=2.0)
    try:
        with pytest.raises(EngineUnavailable, match="/is_paused"):
            await engine.is_paused()
    finally:
        await engine.aclose()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/completions", "{not json"),
        ("/v1/completions", "[1, 2]"),
        ("/v1/completions", '{"choices": []}'),
        ("/v1/completions", '{"choices": [{"text": "x"}]}'),
        ("/v1/completions", '{"choices": [{"text": 3}], "usage": {"completion_tokens": 1}}'),
        ("/v1/completions", '{"choices": [{"text": "x", "corral": 5}], "usage": {"completion_tokens": 1}}'),
        ("/is_paused", '{"paused": true}'),
        ("/is_paused", '{"is_paused": "yes"}'),
        ("/weight_info", "{}"),
    ],
)
async def test_malformed_answer_raises_protocol_error(stub: RunningStub, route: str, body: str) -> None:
    stub.state.fail_next(route, 200, body)
    async with make_engine(stub) as engine:
        call = {
            "/v1/completions": lambda: engine.generate(TurnRequest(prompt="x")),
            "/is_paused": engine.is_paused,
            "/weight_info": engine.weight_version,
        }[route]
        with pytest.raises(EngineProtocolError, match=route):
            await call()


async def test_corral_choice_out_of_range_is_protocol_error(stub: RunningStub) -> None:
    stub.state.fail_next(
        "/v1/completions",
        200,
        '{"choices": [{"text": "a", "corral": {"choice": 7, "logprob": -1.0, "weight_version": 0}}],'
        ' "usage": {"completion_tokens": 1}}',
    )
    async with make_engine(stub) as engine:
        with pytest.raises(EngineProtocolError, match="outside the 2 candidates"):
            await engine.generate(TurnRequest(prompt="x", candidates=("a", "b")))


async def test_every_error_is_an_engine_error() -> None:
    for cls in (EngineRequestError, EngineServerError, EngineTimeout, EngineUnavailable, EngineProtocolError):
        assert issubclass(cls, EngineError)


async def test_pause_keep_holds_turn_until_resume_and_reports_older_version(
    stub: RunningStub, tmp_path: Path
) -> None:
    stub.state.gen_delay_s = 0.3
    stub.state.corral_extension = True
    async with make_engine(stub) as engine:
        turn = asyncio.create_task(engine.generate(TurnRequest(prompt="go", candidates=("a", "b"))))
        await wait_generation_started(stub)
        await engine.pause(PauseMode.KEEP)
        await asyncio.sleep(0.6)  # twice the generation time: a frozen turn must not finish
        assert not turn.done()
        await engine.publish_weights(1, make_checkpoint(tmp_path))
        await engine.resume()
        result = await asyncio.wait_for(turn, timeout=5)
    # The turn started under version 0, so it reports 0 though it finished under 1.
    assert result.weight_version == 0
    assert result.choice == len("go") % 2


async def test_server_reported_version_lower_than_known_wins(stub: RunningStub) -> None:
    stub.state.fail_next(
        "/v1/completions",
        200,
        '{"choices": [{"text": "a", "corral": {"choice": 0, "logprob": -1.0, "weight_version": "2"}}],'
        ' "usage": {"completion_tokens": 1}}',
    )
    async with make_engine(stub, initial_version=5) as engine:
        result = await engine.generate(TurnRequest(prompt="x", candidates=("a",)))
    assert result.weight_version == 2


async def test_top_level_corral_version_applies_to_plain_and_chat_turns(stub: RunningStub) -> None:
    answer = '"usage": {"completion_tokens": 1}, "corral": {"weight_version": 1}}'
    stub.state.fail_next("/v1/completions", 200, '{"choices": [{"text": "a"}], ' + answer)
    stub.state.fail_next(
        "/v1/chat/completions", 200, '{"choices": [{"message": {"content": "a"}}], ' + answer
    )
    async with make_engine(stub, initial_version=3) as engine:
        assert (await engine.generate(TurnRequest(prompt="x"))).weight_version == 1
        assert (await engine.chat([{"role": "user", "content": "x"}])).weight_version == 1


async def test_pause_wait_lets_inflight_turn_finish(stub: RunningStub) -> None:
    stub.state.gen_delay_s = 0.2
    async with make_engine(stub) as engine:
        turn = asyncio.create_task(engine.generate(TurnRequest(prompt="a b")))
        await wait_generation_started(stub)
        await engine.pause(PauseMode.WAIT)
        # /pause returned after the turn finished on the server (its answer may still be in transit).
        assert stub.state.inflight == 0
        assert (await asyncio.wait_for(turn, timeout=5)).text == "a b"
        await engine.resume()


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_a_turn_the_pause_aborts_is_an_error_not_a_turn(stub: RunningStub, route: str) -> None:
    """vLLM answers an aborted request 200 with `finish_reason: "abort"` and the text so far: it was
    taken as the turn, a truncated one, into the trajectory a trainer learns from."""
    stub.state.gen_delay_s = 2.0
    async with make_engine(stub) as engine:
        if route == "chat":
            turn = asyncio.create_task(engine.chat([{"role": "user", "content": "a b"}]))
        else:
            turn = asyncio.create_task(engine.generate(TurnRequest(prompt="a b")))
        await wait_generation_started(stub)
        await engine.pause(PauseMode.ABORT)
        with pytest.raises(TurnAborted) as aborted:
            await asyncio.wait_for(turn, timeout=1)
        await engine.resume()
    assert f"engine {stub.url} /v1/" in str(aborted.value)
    assert "aborted after 0 tokens" in str(aborted.value)


def test_free_port_is_not_listening() -> None:
    port = free_port()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


# --- SGLangEngine against the same stub (which also serves SGLang's routes) ---


async def test_sglang_pause_publish_resume_and_version(stub: RunningStub, tmp_path: Path) -> None:
    async with SGLangEngine("s0", stub.url, "stub-model", timeout_s=5.0) as engine:
        port: Engine = engine
        assert port.name == "s0"
        assert (await engine.generate(TurnRequest(prompt="a b c", max_tokens=2))).text == "a b"
        await engine.pause(PauseMode.KEEP)
        assert stub.state.pause_mode == "keep"
        await engine.publish_weights(3, make_checkpoint(tmp_path))
        await engine.resume()
        assert stub.state.paused is False
        assert await engine.weight_version() == 3
        await engine.reset_prefix_cache()
        assert await engine.health() is True
        with pytest.raises(ValueError, match="no pause mode"):
            await engine.pause(PauseMode.WAIT)
    assert stub.state.calls == [
        "/v1/completions",
        "/pause_generation",
        "/update_weights_from_disk",
        "/continue_generation",
        "/get_weight_version",
        "/flush_cache",
        "/health",
    ]


async def test_sglang_failed_load_raises_and_keeps_version(stub: RunningStub, tmp_path: Path) -> None:
    async with SGLangEngine("s0", stub.url, "stub-model", timeout_s=5.0) as engine:
        with pytest.raises(EngineRequestError, match="/update_weights_from_disk"):
            await engine.publish_weights(1, str(tmp_path / "missing"))
        stub.state.fail_next("/update_weights_from_disk", 200, '{"success": false, "message": "oom"}')
        with pytest.raises(EngineRequestError, match="oom"):
            await engine.publish_weights(1, make_checkpoint(tmp_path))
        assert engine.known_version == 0


async def test_a_kept_alive_connection_the_server_closed_unanswered_is_retried_on_a_new_one() -> None:
    """The server answers the first request on a connection and keeps it alive, then closes it when
    the next request arrives, unanswered: what uvicorn's keep-alive timeout does to a request sent
    just as it expires. That must not read as a dead engine (the runtime restarted healthy engines)."""
    import asyncio

    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        try:
            await reader.readuntil(b"\r\n\r\n")  # requests here have no body
            body = b'{"is_paused": false}'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
            writer.write(b"content-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            await reader.readuntil(b"\r\n\r\n")  # the next request on it is not answered
        except asyncio.IncompleteReadError:
            pass  # the client closed it
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = HTTPTransport(f"http://127.0.0.1:{port}", timeout_s=5)
    try:
        for _ in range(3):
            answer = await transport.request_json("GET", "/is_paused")
            assert answer == {"is_paused": False}
        assert connections == 3  # the second and third requests each went again, on a new connection
    finally:
        await transport.aclose()
        server.close()
        await server.wait_closed()

"""The HTTP front end over in-memory streams: raw HTTP in, h11-parsed answers out."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import h11
import pytest
import trio
import trio.testing

from epd_actors.core.router import open_router
from epd_actors.errors import (
    InvalidRequest,
    NoHealthyWorker,
    Overloaded,
    RemoteWorkerError,
    RequestCancelled,
    StageTimeout,
    WorkerDisconnected,
)
from epd_actors.frontends.http import (
    HttpServer,
    HttpSettings,
    RouterHttpApp,
    error_response,
)
from epd_actors.handoff import HandoffReceiver, HandoffSender, open_handoff
from epd_actors.protocol import Usage
from epd_actors.request import (
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    GenerationEvent,
    GenerationRequest,
    RequestTimings,
    UsageEvent,
)
from epd_actors.testing import SimFleet, build_sim_fleet, sim_config
from epd_actors.transport.nowait import MemoryNowaitStream, memory_nowait_pair

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

EPD = {"encode": 1, "prefill": 1, "decode": 1}
SETTINGS = HttpSettings(linger_s=0.5)
TIMINGS = RequestTimings(0.001, {"decode": 0.002}, 0.001, 0.003, {"decode": ("d0",)})
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


# ---------------------------------------------------------------- harness


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    informational: list[int] = field(default_factory=list)

    def json(self) -> dict[str, object]:
        value = json.loads(self.body)
        assert isinstance(value, dict)
        return value

    def error(self) -> dict[str, object]:
        error = self.json()["error"]
        assert isinstance(error, dict)
        return error


class Client:
    """Speaks HTTP/1.1 to the server through h11 (or raw bytes) on one stream."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    def build(
        self,
        method: str,
        target: str,
        *,
        json_body: object = None,
        body: bytes | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> bytes:
        fields = [("host", "test"), *headers]
        if json_body is not None:
            body = json.dumps(json_body).encode()
            fields.append(("content-type", "application/json"))
        if body is not None:
            fields.append(("content-length", str(len(body))))
        data = self.h11.send(h11.Request(method=method, target=target, headers=fields))
        if body:
            data += self.h11.send(h11.Data(data=body))
        return data + self.h11.send(h11.EndOfMessage())

    async def send(self, method: str, target: str, **options: object) -> None:
        await self.stream.send_all(self.build(method, target, **options))  # type: ignore[arg-type]

    async def pretend_raw(self, data: bytes) -> None:
        """Send raw bytes; the h11 client believes it sent a GET (to parse the answer)."""
        self.h11.send(h11.Request(method="GET", target="/", headers=[("host", "test")]))
        self.h11.send(h11.EndOfMessage())
        await self.stream.send_all(data)

    async def event(self) -> h11.Event:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                assert not isinstance(event, type)
                return event
            self.h11.receive_data(await self.stream.receive_some(65536))

    async def head(self) -> Reply:
        informational = []
        while True:
            event = await self.event()
            if isinstance(event, h11.InformationalResponse):
                informational.append(event.status_code)
                continue
            assert isinstance(event, h11.Response), event
            headers = {k.decode(): v.decode() for k, v in event.headers}
            return Reply(event.status_code, headers, b"", informational)

    async def rest(self, reply: Reply) -> Reply:
        chunks = []
        while True:
            event = await self.event()
            if isinstance(event, h11.EndOfMessage):
                break
            assert isinstance(event, h11.Data), event
            chunks.append(bytes(event.data))
        reply.body = b"".join(chunks)
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
        return reply

    async def response(self) -> Reply:
        return await self.rest(await self.head())

    async def request(self, method: str, target: str, **options: object) -> Reply:
        await self.send(method, target, **options)
        return await self.response()

    async def at_eof(self) -> bool:
        return await self.stream.receive_some(65536) == b""


@asynccontextmanager
async def connected(
    app: object,
    settings: HttpSettings = SETTINGS,
    pair: Callable[[], tuple[trio.abc.Stream, trio.abc.Stream]] = trio.testing.memory_stream_pair,
) -> AsyncIterator[Client]:
    client_stream, server_stream = pair()
    server = HttpServer(app, settings)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.handle_connection, server_stream)
        yield Client(client_stream)
        await client_stream.aclose()


class ScriptedApp:
    """An HttpApp whose generations the test drives by hand (or from a script)."""

    admin: Callable[[str, str, object], Awaitable[tuple[int, object]]] | None = None

    def __init__(self, script: list[GenerationEvent] | None = None) -> None:
        self.script = script
        self.requests: list[GenerationRequest] = []
        self.feed: HandoffSender[GenerationEvent] | None = None
        self.started = trio.Event()
        self.left = trio.Event()
        self.observed: list[tuple[str, int]] = []

    @asynccontextmanager
    async def generate(
        self, request: GenerationRequest
    ) -> AsyncIterator[HandoffReceiver[GenerationEvent]]:
        self.requests.append(request)
        send, receive = open_handoff[GenerationEvent](32)
        for event in self.script or ():
            send.send_nowait(event)
        self.feed = send
        self.started.set()
        try:
            with receive:
                yield receive
        finally:
            self.left.set()

    def models(self) -> list[str]:
        return ["m"]

    def serves(self, model: str) -> bool:
        return model in self.models()

    def health(self) -> tuple[int, dict[str, object]]:
        return 200, {"status": "ok"}

    def metrics(self) -> str:
        return "epd_up 1\n"

    def observe_http(self, route: str, status: int) -> None:
        self.observed.append((route, status))


def done(reason: str = "stop", tokens: int = 2) -> DoneEvent:
    return DoneEvent(reason, Usage(3, tokens), TIMINGS)


def delta(text: str, token: int = 1) -> DeltaEvent:
    return DeltaEvent(text, (token,))


@asynccontextmanager
async def sim_app(
    workers: dict[str, int] = EPD, **knobs: object
) -> AsyncIterator[tuple[SimFleet, RouterHttpApp]]:
    fleet = build_sim_fleet(workers, config=sim_config(**knobs))
    async with open_router(fleet.router_config(), backend_factory=fleet.backend_factory) as router:
        await router.wait_ready()
        yield fleet, RouterHttpApp(router)


# ---------------------------------------------------------------- success paths


async def test_chat_over_a_simulated_fleet_with_headers() -> None:
    async with sim_app() as (fleet, app), connected(app) as client:
        body = {**CHAT, "model": "sim-model"}
        reply = await client.request(
            "POST", "/v1/chat/completions", json_body=body, headers=(("x-request-id", "abc-1"),)
        )
    assert reply.status == 200
    assert reply.headers["x-request-id"] == "abc-1"
    assert "decode=" in reply.headers["x-epd-timings"]
    data = reply.json()
    assert data["id"] == "chatcmpl-abc-1"
    assert data["object"] == "chat.completion"
    assert data["usage"] == {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}
    [choice] = data["choices"]  # type: ignore[misc]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"]
    assert fleet.total("generate_requests", "decode") == 1


async def test_keep_alive_and_pipelining_on_one_connection() -> None:
    app = ScriptedApp([delta("ok"), UsageEvent(Usage(3, 1)), done()])
    async with connected(app) as client:
        first = await client.request("GET", "/v1/models")
        # two requests in one write: answered in order on the same connection
        pipelined = client.build("GET", "/health")
        await client.stream.send_all(pipelined)
        second = await client.response()
        third = await client.request(
            "POST", "/v1/completions", json_body={"model": "m", "prompt": "x"}
        )
    assert first.json()["data"] == [
        {"id": "m", "object": "model", "created": 0, "owned_by": "epd_actors"}
    ]
    assert second.json() == {"status": "ok"}
    assert third.json()["choices"][0]["text"] == "ok"  # type: ignore[index]
    assert [status for _, status in app.observed] == [200, 200, 200]


async def test_metrics_and_health_of_a_router() -> None:
    async with sim_app() as (fleet, app), connected(app) as client:
        metrics = await client.request("GET", "/metrics")
        healthy = await client.request("GET", "/health")
        fleet.backends["decode-0"].disconnect()
        sick = await client.request("GET", "/health")
    assert metrics.status == 200
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert healthy.status == 200
    assert healthy.json()["pools"]["decode"]["usable"] == 1  # type: ignore[index]
    assert sick.status == 503
    assert sick.json()["status"] == "unavailable"
    worker = sick.json()["pools"]["decode"]["workers"][0]  # type: ignore[index]
    assert worker["id"] == "decode-0"
    assert worker["connected"] is False


async def test_expect_100_continue_is_answered_before_the_body() -> None:
    app = ScriptedApp([delta("ok"), done()])
    async with connected(app) as client:
        body = json.dumps(CHAT).encode()
        head = client.build(
            "POST",
            "/v1/chat/completions",
            body=body,
            headers=(("content-type", "application/json"), ("expect", "100-continue")),
        )
        await client.stream.send_all(head[: -len(body)])
        informational = await client.event()
        await client.stream.send_all(body)
        reply = await client.response()
    assert isinstance(informational, h11.InformationalResponse)
    assert informational.status_code == 100
    assert reply.status == 200


@pytest.mark.parametrize(
    ("given", "echoed"),
    [("abc.DEF_1:2-3", True), ("bad id", False), ("x" * 129, False)],
    ids=["valid", "space", "too-long"],
)
async def test_request_id_is_echoed_only_when_valid(given: str, echoed: bool) -> None:
    app = ScriptedApp([done()])
    async with connected(app) as client:
        reply = await client.request(
            "POST", "/v1/chat/completions", json_body=CHAT, headers=(("x-request-id", given),)
        )
    assert (reply.headers["x-request-id"] == given) is echoed
    assert app.requests[0].request_id == reply.headers["x-request-id"]


async def test_session_header_becomes_the_session_key() -> None:
    app = ScriptedApp([done()])
    async with connected(app) as client:
        await client.request(
            "POST",
            "/v1/chat/completions",
            json_body={**CHAT, "user": "body-user"},
            headers=(("x-session-id", "s-42"),),
        )
    assert app.requests[0].session_key == "s-42"


async def test_priority_header() -> None:
    app = ScriptedApp([done()])
    async with connected(app) as client:
        await client.request(
            "POST", "/v1/chat/completions", json_body=CHAT, headers=(("x-epd-priority", "High"),)
        )
        refused = await client.request(
            "POST", "/v1/chat/completions", json_body=CHAT, headers=(("x-epd-priority", "vip"),)
        )
    assert app.requests[0].priority == "high"
    assert refused.status == 400
    assert refused.json()["error"]["param"] == "x-epd-priority"


# ---------------------------------------------------------------- refusals


async def test_unknown_path_is_404_and_wrong_method_is_405_with_allow() -> None:
    async with connected(ScriptedApp()) as client:
        missing = await client.request("GET", "/nope")
        wrong = await client.request("GET", "/v1/chat/completions")
        still_alive = await client.request("GET", "/health")
    assert missing.status == 404
    assert missing.error()["type"] == "not_found_error"
    assert wrong.status == 405
    assert wrong.headers["allow"] == "POST, OPTIONS"
    assert still_alive.status == 200


@pytest.mark.parametrize(
    ("authorization", "status"),
    [(None, 401), ("Bearer wrong", 401), ("Basic k2", 401), ("Bearer k2", 200)],
    ids=["missing", "wrong-key", "wrong-scheme", "second-key"],
)
async def test_api_keys(authorization: str | None, status: int) -> None:
    settings = HttpSettings(api_keys=("k1", "k2"), linger_s=0.5)
    headers = () if authorization is None else (("authorization", authorization),)
    async with connected(ScriptedApp([done()]), settings) as client:
        reply = await client.request(
            "POST", "/v1/chat/completions", json_body=CHAT, headers=headers
        )
        health = await client.request("GET", "/health") if status == 200 else None
    assert reply.status == status
    if status == 401:
        assert reply.error()["type"] == "authentication_error"
        assert reply.error()["code"] == "invalid_api_key"
    else:
        assert health is not None  # /health needs no key
        assert health.status == 200


async def test_wrong_content_type_is_415() -> None:
    async with connected(ScriptedApp()) as client:
        reply = await client.request(
            "POST",
            "/v1/chat/completions",
            body=b"model=m",
            headers=(("content-type", "application/x-www-form-urlencoded"),),
        )
    assert reply.status == 415


async def test_bad_json_is_400_and_the_connection_stays_usable() -> None:
    async with connected(ScriptedApp()) as client:
        reply = await client.request(
            "POST",
            "/v1/chat/completions",
            body=b'{"model": ',
            headers=(("content-type", "application/json"),),
        )
        again = await client.request("GET", "/health")
    assert reply.status == 400
    assert reply.error()["code"] == "invalid_json"
    assert again.status == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**CHAT, "temperature": "hot"}, "temperature"),
        ({**CHAT, "n": 2}, "n"),
        ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0].image_url"),
        ({"messages": CHAT["messages"]}, "model"),
        ([1, 2], None),
    ],
    ids=["temperature", "n", "image_url", "model", "not-an-object"],
)  # fmt: skip
async def test_bad_fields_are_400_naming_the_field(body: object, param: str | None) -> None:
    async with connected(ScriptedApp()) as client:
        reply = await client.request("POST", "/v1/chat/completions", json_body=body)
    assert reply.status == 400
    assert reply.error()["type"] == "invalid_request_error"
    assert reply.error()["param"] == param


async def test_unknown_model_is_404() -> None:
    async with connected(ScriptedApp()) as client:
        reply = await client.request(
            "POST", "/v1/chat/completions", json_body={**CHAT, "model": "other"}
        )
    assert reply.status == 404
    assert reply.error()["code"] == "model_not_found"


SIM_CHAT = {**CHAT, "model": "sim-model"}
SIM_COMPLETION = {"model": "sim-model", "prompt": "hi", "max_tokens": 4}
LONE = "\ud800"  # json.dumps writes it as the escape a client would send

SURROGATE_BODIES = [
    pytest.param(
        "/v1/chat/completions",
        {**SIM_CHAT, "messages": [{"role": "user", "content": f"a{LONE}b"}]},
        "messages[0].content",
        id="content",
    ),
    pytest.param(
        "/v1/chat/completions",
        {
            **SIM_CHAT,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": LONE}],
                }
            ],
        },
        "messages[0].content[1].text",
        id="text-part",
    ),
    pytest.param("/v1/chat/completions", {**SIM_CHAT, "stop": [LONE]}, "stop[0]", id="stop"),
    pytest.param("/v1/completions", {**SIM_COMPLETION, "prompt": LONE}, "prompt", id="prompt"),
    pytest.param("/v1/chat/completions", {**SIM_CHAT, "user": LONE}, "user", id="user"),
    pytest.param("/v1/chat/completions", {**SIM_CHAT, "model": LONE}, "model", id="model"),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_BODIES)
async def test_a_lone_surrogate_anywhere_is_400_naming_the_field(
    path: str, body: dict[str, object], param: str
) -> None:
    async with sim_app() as (fleet, app), connected(app) as client:
        reply = await client.request("POST", path, json_body=body)
        again = await client.request("GET", "/health")
    assert reply.status == 400
    assert reply.error()["type"] == "invalid_request_error"
    assert reply.error()["param"] == param
    assert again.status == 200  # a refused body leaves the connection usable
    assert fleet.total("generate_requests", "decode") == 0


@pytest.mark.parametrize(
    "raw",
    [b'"\\uDBFF"', b'"\xed\xa0\x80"'],
    ids=["upper-case-escape", "utf8-encoded-surrogate"],
)
async def test_a_lone_surrogate_in_the_raw_bytes_is_400(raw: bytes) -> None:
    body = json.dumps(SIM_CHAT).encode().replace(b'"hi"', raw)
    async with sim_app() as (_, app), connected(app) as client:
        reply = await client.request(
            "POST",
            "/v1/chat/completions",
            body=body,
            headers=(("content-type", "application/json"),),
        )
    assert reply.status == 400
    assert reply.error()["param"] == "messages[0].content"


async def test_a_surrogate_pair_is_an_ordinary_character() -> None:
    body = {
        **SIM_CHAT,
        "messages": [{"role": "user", "content": "\U0001f600"}],
        "stop": ["\U0001f600"],
    }
    async with sim_app() as (fleet, app), connected(app) as client:
        raw = json.dumps(body).encode()
        assert b"\\ud83d\\ude00" in raw  # sent as a pair of escapes
        reply = await client.request(
            "POST",
            "/v1/chat/completions",
            body=raw,
            headers=(("content-type", "application/json"),),
        )
    assert reply.status == 200
    assert fleet.total("generate_requests", "decode") == 1


async def test_declared_oversized_body_is_413_without_reading_it() -> None:
    settings = HttpSettings(max_body_bytes=1000, linger_s=0.5)
    async with connected(ScriptedApp(), settings) as client:
        await client.stream.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\n"
            b"content-type: application/json\r\ncontent-length: 1000000\r\n\r\n"
        )
        client.h11.send(h11.Request(method="POST", target="/", headers=[("host", "t")]))
        reply = await client.head()
        reply = await client.rest(reply)
        assert await client.at_eof()
    assert reply.status == 413
    assert reply.headers["connection"] == "close"


async def test_chunked_body_over_the_limit_is_413() -> None:
    settings = HttpSettings(max_body_bytes=1000, linger_s=0.5)
    async with connected(ScriptedApp(), settings) as client:
        request = h11.Request(
            method="POST",
            target="/v1/chat/completions",
            headers=[
                ("host", "t"),
                ("content-type", "application/json"),
                ("transfer-encoding", "chunked"),
            ],
        )
        await client.stream.send_all(client.h11.send(request))
        await client.stream.send_all(client.h11.send(h11.Data(data=b" " * 1500)))
        reply = await client.response()
    assert reply.status == 413


async def test_oversized_head_is_431() -> None:
    async with connected(ScriptedApp()) as client:
        await client.pretend_raw(b"GET /health HTTP/1.1\r\nx-big: " + b"a" * 20000)
        reply = await client.response()
    assert reply.status == 431


async def test_malformed_request_line_is_400() -> None:
    async with connected(ScriptedApp()) as client:
        await client.pretend_raw(b"NOT HTTP\r\n\r\n")
        reply = await client.response()
        assert await client.at_eof()
    assert reply.status == 400


async def test_idle_connection_is_closed_after_the_keep_alive_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    settings = HttpSettings(keep_alive_timeout_s=7.0, linger_s=0.5)
    async with connected(ScriptedApp(), settings) as client:
        start = trio.current_time()
        await client.request("GET", "/health")
        assert await client.at_eof()
        assert trio.current_time() - start == 7.0


@pytest.mark.parametrize(
    "later",
    [
        (),
        # More of the body in time for a timeout per piece: the timeout bounds the whole body.
        ((2.0, b'"a"'),),
    ],
)
async def test_slow_body_is_408(
    autojump_clock: trio.testing.MockClock, later: tuple[tuple[float, bytes], ...]
) -> None:
    settings = HttpSettings(body_timeout_s=3.0, linger_s=0.5)
    async with connected(ScriptedApp(), settings) as client:
        start = trio.current_time()
        await client.stream.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\n"
            b"content-type: application/json\r\ncontent-length: 10\r\n\r\n{"
        )
        for after_s, piece in later:
            await trio.sleep(after_s)
            await client.stream.send_all(piece)
        client.h11.send(h11.Request(method="POST", target="/", headers=[("host", "t")]))
        reply = await client.head()
        assert trio.current_time() - start == pytest.approx(3.0)
    assert reply.status == 408


async def test_connections_beyond_the_limit_get_503() -> None:
    settings = HttpSettings(max_connections=1, linger_s=0.5)
    server = HttpServer(ScriptedApp(), settings)  # type: ignore[arg-type]
    first_client, first_server = trio.testing.memory_stream_pair()
    second_client, second_server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.handle_connection, first_server)
        await trio.testing.wait_all_tasks_blocked()
        await server.handle_connection(second_server)
        answer = await second_client.receive_some(65536)
        assert answer.startswith(b"HTTP/1.1 503 ")
        await first_client.aclose()
    assert server.connections == 0


async def test_admin_routes_need_a_hook_and_an_admin_key() -> None:
    calls: list[tuple[str, str, object]] = []

    async def admin(method: str, path: str, body: object) -> tuple[int, object]:
        calls.append((method, path, body))
        return 200, {"done": True}

    app = ScriptedApp()
    settings = HttpSettings(admin_keys=("root",), linger_s=0.5)
    async with connected(app, settings) as client:
        no_hook = await client.request("GET", "/admin/workers")
    app.admin = admin
    async with connected(app, settings) as client:
        no_key = await client.request("GET", "/admin/workers")
    async with connected(app, settings) as client:
        ok = await client.request(
            "POST",
            "/admin/workers",
            json_body={"id": "d1"},
            headers=(("authorization", "Bearer root"),),
        )
    assert (no_hook.status, no_key.status, ok.status) == (404, 401, 200)
    assert calls == [("POST", "/admin/workers", {"id": "d1"})]


# ---------------------------------------------------------------- error mapping


@pytest.mark.parametrize(
    ("error", "status", "retry_after"),
    [
        (InvalidRequest("bad", param="x"), 400, None),
        (Overloaded("busy", retry_after=2.5), 429, "3"),
        (NoHealthyWorker("none"), 503, "1"),
        (StageTimeout("slow", phase="first_token"), 504, None),
        (RemoteWorkerError("engine_error", "boom", retryable=False), 502, None),
        (RemoteWorkerError("invalid_request", "too long", retryable=False), 400, None),
        (WorkerDisconnected("gone"), 502, None),
    ],
    ids=["invalid", "overloaded", "no-healthy", "timeout", "remote", "remote-400", "worker"],
)
async def test_generation_errors_map_to_statuses(
    error: Exception, status: int, retry_after: str | None
) -> None:
    app = ScriptedApp([ErrorEvent(error, TIMINGS)])  # type: ignore[arg-type]
    async with connected(app) as client:
        reply = await client.request("POST", "/v1/chat/completions", json_body=CHAT)
    assert reply.status == status
    assert reply.headers.get("retry-after") == retry_after
    assert reply.error()["message"] == str(error)
    assert reply.headers["x-epd-timings"] == TIMINGS.header_value()


def test_cancelled_requests_get_no_answer() -> None:
    assert error_response(RequestCancelled("left")) is None


async def test_a_bug_in_the_app_is_a_500_and_closes_only_that_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken(ScriptedApp):
        def models(self) -> list[str]:
            raise ZeroDivisionError("bug")

    async with connected(Broken()) as client:
        reply = await client.request("GET", "/v1/models")
        assert await client.at_eof()
    assert reply.status == 500
    assert "unexpected error" in caplog.text


# ---------------------------------------------------------------- streaming


async def stream_reply(app: ScriptedApp, body: dict[str, object], **options: object) -> Reply:
    async with connected(app, **options) as client:  # type: ignore[arg-type]
        return await client.request(
            "POST",
            "/v1/chat/completions",
            json_body={**body, "stream": True},
            headers=(("x-request-id", "r1"),),
        )


async def test_sse_format_exactly() -> None:
    app = ScriptedApp([delta("Hel", 1), delta('lo "x"\n', 2), UsageEvent(Usage(3, 2)), done()])
    off = HttpSettings(linger_s=0.5, stream_coalescing="off")  # one event per delta
    reply = await stream_reply(
        app, {**CHAT, "stream_options": {"include_usage": True}}, settings=off
    )
    assert reply.status == 200
    assert reply.headers["content-type"] == "text/event-stream"
    assert reply.headers["cache-control"] == "no-cache"
    text = reply.body.decode()
    created = text.split('"created":', 1)[1].split(",", 1)[0]
    head = (
        'data: {"id":"chatcmpl-r1","object":"chat.completion.chunk",'
        f'"created":{created},"model":"m",'
    )
    choice = '"choices":[{"index":0,'
    tail = '"logprobs":null,"finish_reason":null}]}\n\n'
    assert text == (
        f'{head}{choice}"delta":{{"role":"assistant","content":""}},{tail}'
        f'{head}{choice}"delta":{{"content":"Hel"}},{tail}'
        f'{head}{choice}"delta":{{"content":"lo \\"x\\"\\n"}},{tail}'
        f'{head}{choice}"delta":{{}},"logprobs":null,"finish_reason":"stop"}}]}}\n\n'
        f'{head}"choices":[],"usage":{{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}}}\n\n'
        f": timings {TIMINGS.header_value()}\n\n"
        "data: [DONE]\n\n"
    )  # fmt: skip
    for line in text.splitlines():
        if line.startswith("data: {"):
            json.loads(line[len("data: ") :])


async def test_completion_stream_without_usage() -> None:
    app = ScriptedApp([delta("a"), done("length")])
    async with connected(app) as client:
        reply = await client.request(
            "POST", "/v1/completions", json_body={"model": "m", "prompt": "p", "stream": True}
        )
    events = [
        json.loads(line[6:])
        for line in reply.body.decode().splitlines()
        if line.startswith("data: {")
    ]
    assert [e["choices"][0]["text"] for e in events] == ["a", ""]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert events[0]["object"] == "text_completion"
    assert reply.body.endswith(b"data: [DONE]\n\n")


async def test_queued_events_are_coalesced_into_one_write() -> None:
    app = ScriptedApp()
    async with connected(app, pair=trio.testing.lockstep_stream_pair) as client:
        await client.send("POST", "/v1/chat/completions", json_body={**CHAT, "stream": True})
        await app.started.wait()
        assert app.feed is not None
        for word in ("a", "b", "c"):
            app.feed.send_nowait(delta(word))
        # lockstep: one receive is exactly one server write
        first_write = await client.stream.receive_some(1 << 20)
        app.feed.send_nowait(delta("d"))
        second_write = await client.stream.receive_some(1 << 20)
        app.feed.send_nowait(UsageEvent(Usage(1, 4)))
        app.feed.send_nowait(done())
        last_write = await client.stream.receive_some(1 << 20)
    assert first_write.startswith(b"HTTP/1.1 200 OK\r\n")
    assert first_write.count(b"data: ") == 2  # role chunk + a, b, c merged (ready)
    assert b'"content":"abc"' in first_write
    assert second_write.count(b"data: ") == 1
    assert last_write.count(b"data: ") == 2  # finish chunk + [DONE]
    assert last_write.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")


async def test_a_direct_delta_the_socket_cannot_take_now_is_written_before_the_next() -> None:
    """A delta sent while the response's task waits is rendered at once; a stream
    that takes nothing without waiting (a memory stream) refuses it, so it is
    queued to wake the response's task, which writes its chunk once, in order."""
    app = ScriptedApp()
    async with connected(app) as client:
        await client.send("POST", "/v1/chat/completions", json_body={**CHAT, "stream": True})
        await app.started.wait()
        assert app.feed is not None
        app.feed.send_nowait(delta("a"))  # the head is not out yet: queued
        await trio.testing.wait_all_tasks_blocked()
        app.feed.send_nowait(delta("b"))  # rendered, nothing written, queued to wake
        await trio.testing.wait_all_tasks_blocked()  # "b" is out, and nothing else came
        app.feed.send_nowait(delta("c"))
        app.feed.send_nowait(done())
        reply = await client.response()
    contents = [
        json.loads(line[6:])["choices"][0]["delta"].get("content")
        for line in reply.body.decode().splitlines()
        if line.startswith("data: {")
    ]
    assert contents == ["", "a", "b", "c", None]


async def test_deltas_are_written_by_the_task_that_sends_them_on_a_socket_like_stream() -> None:
    """On the socket's twin the production path runs: a delta sent while the
    response's task waits is on the client's side before that task runs."""
    app = ScriptedApp()
    async with connected(app, pair=memory_nowait_pair) as client:
        await client.send("POST", "/v1/chat/completions", json_body={**CHAT, "stream": True})
        await app.started.wait()
        assert app.feed is not None
        app.feed.send_nowait(delta("a"))
        await trio.testing.wait_all_tasks_blocked()
        head = await client.stream.receive_some(1 << 20)
        assert b'"content":"a"' in head
        app.feed.send_nowait(delta("b"))  # written here, in this task
        assert isinstance(client.stream, MemoryNowaitStream)
        assert b'"content":"b"' in client.stream.unread()
        await client.stream.receive_some(1 << 20)
        app.feed.send_nowait(delta("c"))
        app.feed.send_nowait(done())
        rest = await client.stream.receive_some(1 << 20)
        while not rest.endswith(b"0\r\n\r\n"):
            rest += await client.stream.receive_some(1 << 20)
    assert b'"content":"c"' in rest
    assert rest.count(b"data: [DONE]") == 1


async def test_failure_mid_stream_ends_with_an_error_event_and_keeps_the_connection() -> None:
    """The connection used to close after the error event: headers already out, the
    client could not know, and a request it sent next on that connection got no
    answer at all (httpx: "Server disconnected without sending a response")."""
    error = RemoteWorkerError("engine_error", "decoder died", retryable=False)
    app = ScriptedApp([delta("partial"), ErrorEvent(error, TIMINGS)])
    async with connected(app) as client:
        reply = await client.request(
            "POST", "/v1/chat/completions", json_body={**CHAT, "stream": True}
        )
        assert "connection" not in reply.headers
        # The next request on the same connection, sent at once, is answered.
        after = await client.request("GET", "/v1/models")
    text = reply.body.decode()
    assert reply.status == 200
    assert "[DONE]" not in text
    assert text.endswith(
        'event: error\ndata: {"error":{"message":"engine_error: decoder died",'
        '"type":"upstream_error","param":null,"code":"engine_error"}}\n\n'
    )
    assert '"content":"partial"' in text
    assert after.status == 200
    assert after.json()["data"][0]["id"] == "m"


async def test_failure_before_the_first_event_is_a_plain_error_status() -> None:
    app = ScriptedApp([ErrorEvent(Overloaded("full"), TIMINGS)])
    reply = await stream_reply(app, CHAT)
    assert reply.status == 429
    assert reply.headers["content-type"] == "application/json"


async def test_client_leaving_mid_stream_aborts_the_workers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with sim_app(output_token_s=1.0) as (fleet, app):
        async with connected(app) as client:
            body = {**CHAT, "model": "sim-model", "max_tokens": 1000, "stream": True}
            await client.send("POST", "/v1/chat/completions", json_body=body)
            head = await client.head()
            chunk = await client.event()
            assert isinstance(chunk, h11.Data)
        # leaving `connected` closed the client's stream and waited for the handler
        assert head.status == 200
        assert fleet.total("aborts", "decode") == 1
        assert fleet.total("in_flight") == 0
        assert fleet.total("tokens_generated") < 1000


async def test_client_leaving_before_a_unary_answer_cancels_the_request() -> None:
    app = ScriptedApp()
    async with connected(app) as client:
        await client.send("POST", "/v1/chat/completions", json_body=CHAT)
        await app.started.wait()
    assert app.left.is_set()
    assert app.feed is not None
    with pytest.raises(trio.BrokenResourceError):
        app.feed.send_nowait(delta("late"))


async def test_a_client_that_stops_reading_is_dropped_after_the_write_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = ScriptedApp()
    settings = HttpSettings(write_timeout_s=4.0, linger_s=0.5)
    async with connected(app, settings, pair=trio.testing.lockstep_stream_pair) as client:
        await client.send("POST", "/v1/chat/completions", json_body={**CHAT, "stream": True})
        await app.started.wait()
        start = trio.current_time()
        assert app.feed is not None
        app.feed.send_nowait(delta("never read"))
        await app.left.wait()  # the write timed out: the request was cancelled
        assert trio.current_time() - start == 4.0


async def test_admin_post_with_a_null_body() -> None:
    async def admin(method: str, path: str, body: object) -> tuple[int, object]:
        return 202, {"body": body}

    app = ScriptedApp()
    app.admin = admin
    settings = HttpSettings(admin_keys=("root",), linger_s=0.5)
    async with connected(app, settings) as client:
        reply = await client.request(
            "POST",
            "/admin/drain",
            body=b"null",
            headers=(("authorization", "Bearer root"), ("content-type", "application/json")),
        )
        again = await client.request("GET", "/health")
    assert (reply.status, reply.json(), again.status) == (202, {"body": None}, 200)

"""The ``openai_http`` backend against the simulator serving vLLM's HTTP contract.

The simulated workers run in the test's own nursery behind
:class:`~epd_actors.simulator.openai_server.SimOpenAIServer` on 127.0.0.1, port 0
(real loopback sockets: the backend is an httpx client).  Every rule of the
contract is asserted from the worker's side, through the request log each
simulated server keeps (``server.log``, also served at ``GET /debug/requests``).
These tests use the real clock (sockets and ``autojump_clock`` do not mix); the
simulator's latencies are milliseconds and every test runs under ``fail_after``.
"""

from __future__ import annotations

import base64
import hashlib
import re
import socket
import subprocess
import sys
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import httpx
import pytest
import trio
import trio.testing

from epd_actors.addresses import check_http_url
from epd_actors.backends.native.backend import NativeBackend
from epd_actors.backends.openai_http.backend import (
    OpenAIHttpBackend,
    OpenAIHttpBackendFactory,
    OpenAIHttpDeltaStream,
    OpenAIHttpSettings,
)
from epd_actors.backends.openai_http.contract import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    DeltaParser,
    ReplyError,
    StreamFailed,
    openai_request,
    prefill_body,
    remote_decode_params,
)
from epd_actors.core.config import PoolConfig, RouterConfig, WorkerEndpoint
from epd_actors.core.router import (
    DefaultBackendFactory,
    default_backend_factory,
    open_router,
    worker_requirement,
)
from epd_actors.errors import (
    ConfigError,
    InvalidRequest,
    NoHealthyWorker,
    RemoteWorkerError,
    WorkerDisconnected,
)
from epd_actors.frontends.http_app import RouterHttpApp
from epd_actors.http.sse import SseDecoder, SseEvent
from epd_actors.openai.fields import FieldPolicy
from epd_actors.openai.media import MediaLimits
from epd_actors.openai.schema import parse_chat_completion
from epd_actors.program.config_file import parse_config
from epd_actors.protocol import (
    ChatMessage,
    EncodeRequest,
    ErrorCode,
    GenerateRequest,
    MediaItem,
    PrefillRequest,
    Prompt,
    Role,
    SamplingParams,
    Usage,
)
from epd_actors.request import DeltaEvent, DoneEvent, ErrorEvent, GenerationRequest
from epd_actors.simulator.engine import SimConfig, SimEngine
from epd_actors.simulator.openai_server import SimOpenAIServer, serve_openai
from epd_actors.simulator.store import SimStores, create_sim_stores

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Mapping

    from epd_actors.core.router import Router
    from epd_actors.request import GenerationEvent

GUARD_S = 10.0  # real seconds: a hung test fails instead of hanging the run
MODEL = "sim-model"
FAST = OpenAIHttpSettings(
    health_interval_s=0.02,
    health_timeout_s=1.0,
    connect_timeout_s=1.0,
    read_timeout_s=5.0,
)
SIX_FIELDS = remote_decode_params()
QUICK = SimConfig(encode_item_s=0.0, prefill_token_s=0.0, first_token_s=0.0, output_token_s=0.0)
"""The simulator without latencies (tests that need pacing pass their own config)."""


# ---------------------------------------------------------------- a simulated HTTP fleet


@dataclass
class SimHttpFleet:
    """Simulated vLLM servers by worker id (``<stage>-<n>``), sharing in-memory stores."""

    stores: SimStores
    servers: dict[str, SimOpenAIServer] = field(default_factory=dict)
    scopes: dict[str, trio.CancelScope] = field(default_factory=dict)

    def engine(self, worker_id: str) -> SimEngine:
        engine = self.servers[worker_id].engine
        assert isinstance(engine, SimEngine)
        return engine

    def log(self, worker_id: str) -> list[dict[str, object]]:
        return self.servers[worker_id].log.snapshot()

    def stage_log(self, stage: str) -> list[dict[str, object]]:
        return [e for w, s in self.servers.items() if w.startswith(stage) for e in s.log.snapshot()]

    def stop(self, worker_id: str) -> None:
        """Take a server off the network (connections refused from now on)."""
        self.scopes[worker_id].cancel(reason="test stops the worker")

    def config(
        self,
        *,
        policies: Mapping[str, str] | None = None,
        extra: Mapping[str, tuple[WorkerEndpoint, ...]] | None = None,
    ) -> RouterConfig:
        pools = []
        for stage in ("encode", "prefill", "decode", "pd"):
            endpoints = tuple(
                WorkerEndpoint(worker_id, server.url, "openai_http")
                for worker_id, server in self.servers.items()
                if worker_id.rsplit("-", 1)[0] == stage
            ) + (extra or {}).get(stage, ())
            if endpoints:
                pools.append(PoolConfig(stage, endpoints, policy=(policies or {}).get(stage)))
        return RouterConfig(tuple(pools), model=MODEL)


async def _serve_one(
    server: SimOpenAIServer,
    *,
    task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
) -> None:
    with trio.CancelScope() as scope:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_openai, server, listeners)
            task_status.started(scope)


@asynccontextmanager
async def sim_http_fleet(
    workers: Mapping[str, int],
    *,
    configs: Mapping[str, SimConfig] | None = None,
    roles: Mapping[str, Role] | None = None,
    models: Mapping[str, str] | None = None,
    stores: SimStores | None = None,
) -> AsyncIterator[SimHttpFleet]:
    """Start simulated servers (``{"encode": 2, ...}``; ``configs`` by worker id or stage).

    ``roles`` and ``models`` (by worker id) make a server run another role than
    its pool's, or serve another model than the router's; ``stores``: the
    stores they share (default: new in-memory ones).
    """
    fleet = SimHttpFleet(stores or create_sim_stores())
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            for stage, count in workers.items():
                for index in range(count):
                    worker_id = f"{stage}-{index}"
                    chosen = (configs or {}).get(worker_id) or (configs or {}).get(stage)
                    engine = SimEngine(
                        (roles or {}).get(worker_id, Role(stage)),
                        worker_id=worker_id,
                        config=chosen or QUICK,
                        ec_store=fleet.stores.ec,
                        kv_store=fleet.stores.kv,
                        model=(models or {}).get(worker_id, MODEL),
                    )
                    server = SimOpenAIServer(engine, worker_id=worker_id)
                    fleet.servers[worker_id] = server
                    fleet.scopes[worker_id] = await nursery.start(_serve_one, server)
            yield fleet
            nursery.cancel_scope.cancel(reason="fleet closed")


@asynccontextmanager
async def fleet_router(
    fleet: SimHttpFleet,
    *,
    settings: OpenAIHttpSettings = FAST,
    policies: Mapping[str, str] | None = None,
    extra: Mapping[str, tuple[WorkerEndpoint, ...]] | None = None,
    wait: bool = True,
    config: RouterConfig | None = None,
) -> AsyncIterator[Router]:
    config = config or fleet.config(policies=policies, extra=extra)
    factory = DefaultBackendFactory(openai_http=settings)
    async with open_router(config, backend_factory=factory) as router:
        if wait:
            await router.wait_ready()
        yield router


@asynccontextmanager
async def running_backend(
    fleet: SimHttpFleet, worker_id: str, factory: OpenAIHttpBackendFactory
) -> AsyncIterator[OpenAIHttpBackend]:
    config = fleet.config()
    pool, endpoint = next(
        (p, w) for p in config.pools for w in p.workers if w.worker_id == worker_id
    )
    backend = factory.build(
        endpoint.worker_id, endpoint.address, model=config.model, stage=pool.stage
    )
    backend.expect(worker_requirement(pool.stage, config.model))  # as its pool would
    async with trio.open_nursery() as nursery:
        await nursery.start(backend.run)
        await backend.wait_ready()
        yield backend
        nursery.cancel_scope.cancel(reason="test done")


def image(n: int) -> MediaItem:
    """A distinct fake PNG (the simulator never decodes images)."""
    return MediaItem.from_bytes(b"\x89PNG\r\n\x1a\n" + f"image {n}".encode() * 8, "image/png")


def chat(
    *media: MediaItem, text: str = "describe the picture", **sampling: object
) -> GenerationRequest:
    parts: tuple[str | int, ...] = (*range(len(media)), text)
    params = SamplingParams(**{"max_tokens": 6, "temperature": 0.0, **sampling})  # type: ignore[arg-type]
    return GenerationRequest(
        Prompt(messages=(ChatMessage("user", parts),)), media=media, sampling=params
    )


async def collect(router: Router, request: GenerationRequest) -> list[GenerationEvent]:
    events: list[GenerationEvent] = []
    async with router.generate(request) as stream:
        async for event in stream:
            events.append(event)
    return events


def text_of(events: list[GenerationEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, DeltaEvent))


def final(events: list[GenerationEvent]) -> DoneEvent | ErrorEvent:
    last = events[-1]
    assert isinstance(last, DoneEvent | ErrorEvent)
    return last


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------- the conversion and the rules


def test_openai_request_rebuilds_a_chat_body_with_inline_media() -> None:
    picture = image(1)
    wav = MediaItem.from_bytes(b"RIFF....WAVEfmt ", "audio/wav")
    prompt = Prompt(
        messages=(
            ChatMessage("system", ("be brief",)),
            ChatMessage("user", (0, "and", 1)),
            ChatMessage("assistant", ()),
        )
    )
    sampling = SamplingParams(
        max_tokens=9, temperature=0.5, top_k=4, stop=("x",), seed=7, min_tokens=2, logprobs=3
    )
    path, body = openai_request(prompt, (picture, wav), sampling, model="m")
    assert path == CHAT_PATH
    assert body["messages"] == [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {
                    "type": "image_url",
                    "image_url": {
                        "url": "data:image/png;base64," + base64.b64encode(picture.data).decode()
                    },
                },
                {"type": "text", "text": "and"},
                {
                    "type": "input_audio",
                    "input_audio": {"data": base64.b64encode(wav.data).decode(), "format": "wav"},
                },
            ],
        },
        {"role": "assistant", "content": None},
    ]
    assert {k: body[k] for k in body if k not in ("messages",)} == {
        "model": "m",
        "max_tokens": 9,
        "temperature": 0.5,
        "top_k": 4,
        "stop": ["x"],
        "seed": 7,
        "min_tokens": 2,
        "logprobs": True,
        "top_logprobs": 3,
        "return_token_ids": True,
    }


def test_openai_request_uses_completions_for_text_and_token_ids() -> None:
    path, body = openai_request(Prompt(text="hi"), (), SamplingParams(logprobs=2), model="m")
    assert (path, body["prompt"], body["logprobs"]) == (COMPLETIONS_PATH, "hi", 2)
    path, body = openai_request(
        Prompt(token_ids=(5, 6)), (), SamplingParams(), model="m", return_token_ids=False
    )
    assert (path, body["prompt"], "return_token_ids" in body) == (COMPLETIONS_PATH, [5, 6], False)
    with pytest.raises(InvalidRequest, match="chat prompt"):
        openai_request(Prompt(text="hi"), (image(1),), SamplingParams(), model="m")


def test_an_echo_request_asks_for_no_token_ids_and_refuses_logprobs() -> None:
    """vLLM streams an echoed prompt's text only without ``return_token_ids``."""
    path, body = openai_request(
        Prompt(text="hi"), (), SamplingParams(), model="m", options={"echo": True}
    )
    assert (path, body["echo"], "return_token_ids" in body) == (COMPLETIONS_PATH, True, False)
    _, body = openai_request(Prompt(text="hi"), (), SamplingParams(), model="m")
    assert body["return_token_ids"] is True
    with pytest.raises(InvalidRequest, match="echo cannot be combined with logprobs") as info:
        openai_request(
            Prompt(text="hi"), (), SamplingParams(logprobs=1), model="m", options={"echo": True}
        )
    assert info.value.param == "echo"


def test_the_rebuilt_body_parses_back_to_the_same_request() -> None:
    """What P and D receive must describe the same prompt (the KV digest depends on it)."""
    request = chat(image(1), image(2), text="compare them", max_tokens=5, stop=("!",), seed=3)
    _, body = openai_request(request.prompt, request.media, request.sampling, model=MODEL)
    policy = FieldPolicy(accept_transfer_fields=True)  # return_token_ids: the router's own
    parsed = parse_chat_completion(body, request_id="r", limits=MediaLimits(), policy=policy)
    assert parsed.prompt == request.prompt
    assert parsed.media == request.media
    assert parsed.sampling == request.sampling


def test_prefill_body_applies_every_p_rule_to_any_original() -> None:
    original = {
        "model": "m",
        "messages": [],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 50,
        "max_completion_tokens": 50,
        "min_tokens": 10,
        "temperature": 0.0,
    }
    body = prefill_body(original, {"abc": {"producer": "e"}})
    assert body == {
        "model": "m",
        "messages": [],
        "stream": False,
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "temperature": 0.0,
        "kv_transfer_params": SIX_FIELDS,
        "ec_transfer_params": {"abc": {"producer": "e"}},
    }
    assert original["max_tokens"] == 50  # the original is left alone
    assert "max_completion_tokens" not in prefill_body({"max_tokens": 3})


STREAM = (
    b": comment\r\n"
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\r\n\r\n'
    b'data: {"choices":[{"index":0,"delta":{"content":"Hel"},"token_ids":[1],'
    b'"logprobs":{"content":[{"logprob":-0.5}]},"finish_reason":null}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{"content":"lo"},"token_ids":[2],'
    b'"logprobs":{"content":[{"logprob":-0.25}]},"finish_reason":"length"}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":2}}\n\n'
    b"data: [DONE]\n\n"
)


@pytest.mark.parametrize("step", [1, 7, len(STREAM)], ids=["byte-at-a-time", "7-bytes", "whole"])
def test_sse_stream_becomes_deltas_with_one_terminal(step: int) -> None:
    decoder, parser = SseDecoder(1024), DeltaParser("r", chat=True)
    deltas = []
    for start in range(0, len(STREAM), step):
        parser.feed(decoder.feed(STREAM[start : start + step]))
        delta = parser.take()
        if delta is not None:
            deltas.append(delta)
    assert "".join(d.text for d in deltas) == "Hello"
    assert [t for d in deltas for t in d.token_ids] == [1, 2]
    assert [lp for d in deltas for lp in d.logprobs or ()] == [-0.5, -0.25]
    terminal = deltas[-1]
    assert (terminal.finish_reason, terminal.usage) == ("length", Usage(4, 2))
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert parser.take() is None
    if step == len(STREAM):
        assert len(deltas) == 1  # one network read, one delta


def test_sse_fields_the_decoder_reads_and_skips() -> None:
    decoder = SseDecoder(1024)
    events = decoder.feed(
        b"retry: 10\nid: 7\n: note\nevent: error\ndata: first\ndata\ndata:last\r\n\r\n\n\ndata: {}"
    )
    assert events == [SseEvent("error", "first\n\nlast")]  # blank lines alone end nothing
    assert decoder.feed(b"\n\n") == [SseEvent("", "{}")]
    with pytest.raises(ReplyError, match="UTF-8"):
        SseDecoder(1024).feed(b"data: \xff\n\n")


@pytest.mark.parametrize(
    ("data", "text"),
    [
        (b' {"choices":[{"text":"a"}]}', "a"),  # leading whitespace: json.loads' path
        (b'{"choices":[{"text":"b"}]} \t', "b"),  # trailing whitespace is allowed
    ],
)
def test_stream_chunks_parse_as_json_loads_would(data: bytes, text: str) -> None:
    parser = DeltaParser("r", chat=False)
    parser.feed(SseDecoder(1024).feed(b"data: " + data + b"\n\n"))
    delta = parser.take()
    assert delta is not None
    assert delta.text == text


@pytest.mark.parametrize("data", [b'{"choices":[]} x', b'{"choices":', b"[1]", b"nope"])
def test_a_stream_chunk_that_is_not_one_json_object_is_refused(data: bytes) -> None:
    parser = DeltaParser("r", chat=False)
    with pytest.raises(ReplyError, match="JSON"):
        parser.feed(SseDecoder(1024).feed(b"data: " + data + b"\n\n"))


def test_sse_errors_and_limits() -> None:
    parser = DeltaParser("r", chat=False)
    with pytest.raises(StreamFailed, match="boom"):
        parser.feed(SseDecoder(1024).feed(b'data: {"error":{"message":"boom"}}\n\n'))
    with pytest.raises(ValueError, match="exceeds"):
        SseDecoder(16).feed(b"data: " + b"x" * 64)
    ended = DeltaParser("r", chat=False)
    ended.feed(
        SseDecoder(1024).feed(b'data: {"choices":[{"text":"a","finish_reason":"stop"}]}\n\n')
    )
    early = ended.take()  # the text goes on; the finish waits for the usage chunk
    assert early is not None
    assert (early.text, early.finish_reason) == ("a", None)
    assert ended.take() is None
    terminal = ended.end_of_stream()  # EOF without usage or [DONE] still ends the stream
    assert terminal is not None
    assert (terminal.finish_reason, terminal.usage) == ("stop", None)
    assert ended.end_of_stream() is None


def test_config_accepts_http_urls_for_openai_http_only() -> None:
    for good in ("http://10.0.0.1:8000", "https://vllm.example/prefix", "http://[::1]:8000"):
        check_http_url(good, key="k")
    for bad in ("tcp://h:1", "http://", "http://h:99999", "http://u:p@h:1", "http://h:1/?q=1"):
        with pytest.raises(ConfigError, match="k"):
            check_http_url(bad, key="k")
    worker = WorkerEndpoint("p0", "http://127.0.0.1:8000", "openai_http")
    config = RouterConfig((PoolConfig("pd", (worker,)),))
    assert isinstance(default_backend_factory(worker, config), OpenAIHttpBackend)
    with pytest.raises(ConfigError, match=r"pools\.pd\.workers\[0\]\.address"):
        RouterConfig((PoolConfig("pd", (WorkerEndpoint("p0", "http://h:1"),)),))
    with pytest.raises(ConfigError, match="'late'"):  # added at run time, never validated
        DefaultBackendFactory()(WorkerEndpoint("late", "tcp://h:1", "openai_http"), config)
    native = WorkerEndpoint("n0", "tcp://127.0.0.1:9000")
    assert isinstance(DefaultBackendFactory()(native, config), NativeBackend)


# ---------------------------------------------------------------- the contract, worker side


async def test_encode_sends_one_item_without_text_per_call() -> None:
    async with sim_http_fleet({"encode": 1}) as fleet:
        factory = OpenAIHttpBackendFactory(FAST)
        async with running_backend(fleet, "encode-0", factory) as backend:
            first, second = image(1), image(2)
            result = await backend.run_stage(EncodeRequest("req-1", (first, second)))
        records = fleet.log("encode-0")
        assert len(records) == 2
        for record in records:
            assert record["media_parts"] == ["image_url"]
            assert record["text_parts"] == 0
            assert (record["max_tokens"], record["stream"]) == (1, False)
            assert record["status"] == 200
        ids = sorted(str(r["x_request_id"]) for r in records)
        assert re.fullmatch(r"req-1:0:[0-9a-f]{6}", ids[0])
        assert re.fullmatch(r"req-1:1:[0-9a-f]{6}", ids[1])
        # E's entries exist, keyed by the SHA-256 of the decoded bytes.
        for item in (first, second):
            digest = hashlib.sha256(item.data).hexdigest()
            entry = fleet.stores.ec.get(digest)
            assert entry is not None
            assert entry.producer == "encode-0"
            assert result.ec_transfer_params is not None
            assert digest in result.ec_transfer_params


async def test_epd_request_follows_the_contract_at_every_stage() -> None:
    async with sim_http_fleet({"encode": 1, "prefill": 1, "decode": 1}) as fleet:
        async with fleet_router(fleet) as router:
            request = chat(image(1), min_tokens=2, max_tokens=6)
            events = await collect(router, request)
        done = final(events)
        assert isinstance(done, DoneEvent), done
        assert done.usage.completion_tokens == 6
        (e,), (p,), (d,) = (fleet.log(w) for w in ("encode-0", "prefill-0", "decode-0"))
        # The id the workers see: the request's own, plus the router's unique suffix.
        rid = str(p["x_request_id"])
        assert rid.startswith(request.request_id)
        # E: one item, no text, one token, not streamed, <id>:<item>:<suffix>.
        assert (e["media_parts"], e["text_parts"], e["max_tokens"], e["stream"]) == (
            ["image_url"],
            0,
            1,
            False,
        )
        assert re.fullmatch(re.escape(rid) + r":0:[0-9a-f]{6}", str(e["x_request_id"]))
        # P: six-field remote decode, not streamed, one token, no stream_options,
        # no min_tokens, E's params merged, the request's own id.
        assert p["kv_transfer_params"] == SIX_FIELDS
        assert (p["stream"], p["max_tokens"], p["x_request_id"]) == (False, 1, rid)
        assert "stream_options" not in p["keys"]
        assert "min_tokens" not in p["keys"]
        digest = hashlib.sha256(image(1).data).hexdigest()
        assert p["ec_transfer_params"] == {digest: {"producer": "encode-0"}}
        # D: P's params, streamed with usage, the original sampling, the same id.
        kv = d["kv_transfer_params"]
        assert isinstance(kv, dict)
        assert kv["do_remote_prefill"] is True
        assert kv["remote_engine_id"] == "prefill-0"
        assert kv["remote_port"] > 0
        assert (d["stream"], d["stream_options"], d["x_request_id"]) == (
            True,
            {"include_usage": True},
            rid,
        )
        assert (d["max_tokens"], d["min_tokens"]) == (6, 2)
        # The data dependencies held: P read E's entry, D consumed P's handle.
        prefill, decode = (
            fleet.engine("prefill-0").statistics(),
            fleet.engine("decode-0").statistics(),
        )
        assert (prefill.ec_entries_read, prefill.recomputed_items) == (1, 0)
        assert (prefill.kv_handles_created, decode.kv_handles_consumed) == (1, 1)
        assert prefill.kv_handles_outstanding == 0


async def test_text_request_skips_encode_and_uses_completions() -> None:
    async with sim_http_fleet({"encode": 1, "prefill": 1, "decode": 1}) as fleet:
        async with fleet_router(fleet) as router:
            request = GenerationRequest(
                Prompt(text="tell me a story"), sampling=SamplingParams(max_tokens=4)
            )
            done = final(await collect(router, request))
        assert isinstance(done, DoneEvent)
        assert fleet.log("encode-0") == []
        (p,), (d,) = fleet.log("prefill-0"), fleet.log("decode-0")
        assert p["path"] == d["path"] == COMPLETIONS_PATH
        assert p["kv_transfer_params"] == SIX_FIELDS
        assert p["stream"] is False


async def test_e_pd_topology_gives_the_same_output_as_e_p_d() -> None:
    request = chat(image(3), image(4), max_tokens=8)
    async with sim_http_fleet({"encode": 2, "pd": 1}) as fleet:
        async with fleet_router(fleet) as router:
            pd_events = await collect(router, request)
            text_only = final(await collect(router, GenerationRequest(Prompt(text="no image"))))
        assert isinstance(text_only, DoneEvent)
        pd, text_pd = fleet.log("pd-0")
        assert (text_pd["path"], text_pd["kv_transfer_params"]) == (COMPLETIONS_PATH, None)
        assert len(fleet.stage_log("encode")) == 2  # the text request skipped E
        assert (pd["stream"], pd["stream_options"]) == (True, {"include_usage": True})
        assert pd["kv_transfer_params"] is None
        assert isinstance(pd["ec_transfer_params"], dict)
        assert len(pd["ec_transfer_params"]) == 2
        assert fleet.engine("pd-0").statistics().recomputed_items == 0
    async with (
        sim_http_fleet({"encode": 1, "prefill": 1, "decode": 1}) as fleet,
        fleet_router(fleet) as router,
    ):
        epd_events = await collect(router, request)
    assert isinstance(final(pd_events), DoneEvent)
    assert isinstance(final(epd_events), DoneEvent)
    assert text_of(pd_events) == text_of(epd_events) != ""


async def test_encoder_fan_out_rotates_across_requests() -> None:
    """Round robin: two items per request over three encoders, never restarting at encode-0."""
    async with sim_http_fleet({"encode": 3, "pd": 1}) as fleet:
        async with fleet_router(fleet, policies={"encode": "round_robin"}) as router:
            requests = [chat(image(2 * n), image(2 * n + 1), max_tokens=1) for n in range(12)]
            for request in requests:
                assert isinstance(final(await collect(router, request)), DoneEvent)
        owners: dict[str, set[str]] = {}
        for worker_id in ("encode-0", "encode-1", "encode-2"):
            for record in fleet.log(worker_id):
                rid = str(record["x_request_id"]).split(":")[0]
                owners.setdefault(rid.rsplit(".", 1)[0], set()).add(worker_id)
    rotation = [{"encode-0", "encode-1"}, {"encode-2", "encode-0"}, {"encode-1", "encode-2"}]
    assert [owners[r.request_id] for r in requests] == rotation * 4
    counts = Counter(w for workers in owners.values() for w in workers)
    assert counts == {"encode-0": 8, "encode-1": 8, "encode-2": 8}


async def test_encoder_fan_out_by_content_hash_spreads_and_sticks() -> None:
    """The default policy: many distinct images spread; a repeated image returns to its encoder."""
    encoders = ("encode-0", "encode-1", "encode-2")
    async with sim_http_fleet({"encode": 3, "pd": 1}) as fleet:
        async with fleet_router(fleet) as router:
            for n in range(30):
                done = final(await collect(router, chat(image(100 + n), max_tokens=1)))
                assert isinstance(done, DoneEvent)
            counts = {w: len(fleet.log(w)) for w in encoders}
            assert sum(counts.values()) == 30
            assert min(counts.values()) >= 5, counts  # 10 each on average
            again = image(100)
            entry = fleet.stores.ec.get(hashlib.sha256(again.data).hexdigest())
            assert entry is not None
            await collect(router, chat(again, max_tokens=1))
        grew = [w for w in encoders if len(fleet.log(w)) > counts[w]]
        assert grew == [entry.producer]


# ---------------------------------------------------------------- errors


async def test_a_4xx_fails_the_request_without_retrying() -> None:
    """No encoder configured: strict P refuses the image (400); another P would refuse too."""
    async with sim_http_fleet({"prefill": 2, "decode": 1}) as fleet:
        async with fleet_router(fleet) as router:
            done = final(await collect(router, chat(image(5))))
        assert isinstance(done, ErrorEvent)
        error = done.error
        assert isinstance(error, RemoteWorkerError)
        # The code the worker gave is kept (as over the native protocol), so
        # a router that reused an encoder output knows to encode it again.
        assert (error.code, error.retryable) == (ErrorCode.MISSING_ENCODER_CACHE, False)
        assert "encoder-cache" in error.detail
        assert "400" in error.detail
        assert len(fleet.stage_log("prefill")) == 1
        assert fleet.stage_log("decode") == []


async def test_a_5xx_is_retried_on_another_worker() -> None:
    configs = {"prefill-0": SimConfig(prefill_error_rate=1.0)}
    async with sim_http_fleet({"prefill": 2, "decode": 1}, configs=configs) as fleet:
        async with fleet_router(fleet, policies={"prefill": "round_robin"}) as router:
            done = final(await collect(router, GenerationRequest(Prompt(text="retry me"))))
        assert isinstance(done, DoneEvent), done
        assert [r["status"] for r in fleet.log("prefill-0")] == [500]
        assert [r["status"] for r in fleet.log("prefill-1")] == [200]
        assert done.timings.workers["prefill"] == ("prefill-1",)


async def test_a_timeout_is_retried_and_the_slow_worker_sees_the_abort() -> None:
    configs = {"prefill-0": SimConfig(stall_s=float("inf"))}
    settings = OpenAIHttpSettings(health_interval_s=0.02, read_timeout_s=0.3)
    async with sim_http_fleet({"prefill": 2, "decode": 1}, configs=configs) as fleet:
        async with fleet_router(
            fleet, settings=settings, policies={"prefill": "round_robin"}
        ) as router:
            done = final(await collect(router, GenerationRequest(Prompt(text="slow"))))
            assert isinstance(done, DoneEvent), done
            assert done.timings.workers["prefill"] == ("prefill-1",)
            await fleet.servers["prefill-0"].log.wait_for(
                lambda log: bool(log) and log[0]["disconnected"] is True
            )
        assert fleet.engine("prefill-0").statistics().aborts == 1


async def test_a_worker_that_is_down_is_never_chosen() -> None:
    dead = WorkerEndpoint("decode-dead", f"http://127.0.0.1:{closed_port()}", "openai_http")
    async with sim_http_fleet({"prefill": 1, "decode": 1}) as fleet:
        async with fleet_router(
            fleet, extra={"decode": (dead,)}, policies={"decode": "round_robin"}
        ) as router:
            for n in range(4):
                done = final(await collect(router, GenerationRequest(Prompt(text=f"hi {n}"))))
                assert isinstance(done, DoneEvent), done
            status = router.backends["decode-dead"].status()
        assert (status.connected, status.ready) == (False, False)
        assert len(fleet.log("decode-0")) == 4


async def test_a_server_of_another_model_is_refused_until_it_serves_the_router_s() -> None:
    async with sim_http_fleet({"pd": 2}, models={"pd-1": "other-model"}) as fleet:
        async with fleet_router(fleet, policies={"pd": "round_robin"}) as router:
            other = router.backends["pd-1"]
            await other.wait_connected()  # the probe that connected it read /v1/models too
            for n in range(4):  # round robin would send pd-1 every other one
                done = final(await collect(router, GenerationRequest(Prompt(text=f"hi {n}"))))
                assert isinstance(done, DoneEvent), done
            assert (len(fleet.log("pd-0")), fleet.log("pd-1")) == (4, [])
            status = other.status()
            assert (status.ready, status.refusals) == (False, 1)
            assert status.refused == "it serves model 'other-model', the router serves 'sim-model'"
            health = RouterHttpApp(router).health()[1]
            assert health["pools"]["pd"]["workers"][1]["refused"] == status.refused  # type: ignore[index]

            fleet.engine("pd-1").model = MODEL  # the server now serves the router's model
            await other.wait_ready()
            assert other.status().refused is None
            for n in range(4, 8):
                done = final(await collect(router, GenerationRequest(Prompt(text=f"hi {n}"))))
                assert isinstance(done, DoneEvent), done
        assert len(fleet.log("pd-1")) == 2


async def test_a_server_that_answers_unsupported_stage_is_refused_and_the_request_moves_on() -> (
    None
):
    roles = {"decode-1": Role.PREFILL}  # started with the wrong role
    async with sim_http_fleet({"prefill": 1, "decode": 2}, roles=roles) as fleet:
        async with fleet_router(fleet, policies={"decode": "round_robin"}) as router:
            for n in range(4):  # the second request is the first for decode-1
                done = final(await collect(router, GenerationRequest(Prompt(text=f"hi {n}"))))
                assert isinstance(done, DoneEvent), done
            status = router.backends["decode-1"].status()
        assert status.refused is not None
        assert "answered a generate request with unsupported_stage" in status.refused
        assert [r["outcome"] for r in fleet.log("decode-1")] == [ErrorCode.UNSUPPORTED_STAGE]
        assert len(fleet.log("decode-0")) == 4


async def test_no_healthy_decoder_fails_fast() -> None:
    dead = WorkerEndpoint("decode-dead", f"http://127.0.0.1:{closed_port()}", "openai_http")
    async with sim_http_fleet({"prefill": 1}) as fleet:
        async with fleet_router(fleet, extra={"decode": (dead,)}, wait=False) as router:
            await router.backends["prefill-0"].wait_ready()
            done = final(await collect(router, GenerationRequest(Prompt(text="anyone?"))))
        assert isinstance(done, ErrorEvent)
        assert isinstance(done.error, NoHealthyWorker)


async def test_a_worker_that_dies_between_probes_is_retried_elsewhere() -> None:
    slow_probes = OpenAIHttpSettings(health_interval_s=30.0, connect_timeout_s=1.0)
    async with (
        sim_http_fleet({"prefill": 1, "decode": 2}) as fleet,
        fleet_router(fleet, settings=slow_probes, policies={"decode": "round_robin"}) as router,
    ):
        for backend in router.backends.values():
            await backend.wait_ready()
        fleet.stop("decode-0")  # round robin's first choice, still "ready" for 30 s
        await trio.testing.wait_all_tasks_blocked()  # its connections are closed by now
        done = final(await collect(router, GenerationRequest(Prompt(text="still there?"))))
        assert isinstance(done, DoneEvent), done
        assert done.timings.workers["decode"] == ("decode-1",)
        assert router.backends["decode-0"].status().ready is False  # taken down at once


async def test_leaving_a_stream_early_aborts_it_on_the_worker() -> None:
    configs = {"decode": SimConfig(output_token_s=0.005)}
    async with (
        sim_http_fleet({"prefill": 1, "decode": 1}, configs=configs) as fleet,
        fleet_router(fleet) as router,
    ):
        request = GenerationRequest(
            Prompt(text="a long one"), sampling=SamplingParams(max_tokens=2000)
        )
        seen = 0
        async with router.generate(request) as events:
            async for event in events:
                seen += isinstance(event, DeltaEvent)
                if seen == 3:
                    break
        server = fleet.servers["decode-0"]
        await server.log.wait_for(lambda log: bool(log) and log[0]["disconnected"] is True)
        stats = fleet.engine("decode-0").statistics()
        assert stats.aborts == 1
        assert stats.tokens_generated < 2000
        assert router.backends["decode-0"].status().aborts_sent == 1


# ---------------------------------------------------------------- release, health, models


async def test_release_expire_leaves_the_blocks_to_the_lease() -> None:
    async with sim_http_fleet({"prefill": 1, "decode": 1}) as fleet:
        factory = OpenAIHttpBackendFactory(FAST)
        async with running_backend(fleet, "prefill-0", factory) as prefill:
            result = await prefill.run_stage(PrefillRequest("r-expire", Prompt(text="orphan")))
            assert result.kv_transfer_params is not None
            assert await prefill.release(result.kv_transfer_params) is False
            assert prefill.statistics().releases_expired == 1
        assert fleet.engine("prefill-0").statistics().kv_handles_outstanding == 1
        assert fleet.log("decode-0") == []


async def test_release_consume_has_a_decoder_pull_undelivered_blocks() -> None:
    settings = OpenAIHttpSettings(health_interval_s=0.02, release_policy="consume")
    async with sim_http_fleet({"prefill": 1, "decode": 1}) as fleet:
        factory = OpenAIHttpBackendFactory(settings)
        async with (
            running_backend(fleet, "prefill-0", factory) as prefill,
            running_backend(fleet, "decode-0", factory),
        ):
            orphan = await prefill.run_stage(PrefillRequest("r-orphan", Prompt(text="orphan")))
            kv = orphan.kv_transfer_params
            assert kv is not None
            assert await prefill.release(kv) is True
            assert await prefill.release(kv) is False  # nothing left to consume
            (consume,) = fleet.log("decode-0")
            assert consume["kv_transfer_params"] == kv
            assert (consume["stream"], consume["max_tokens"], consume["x_request_id"]) == (
                False,
                1,
                "r-orphan",
            )
            # A hand-off a decoder already accepted is vLLM's to free, not ours.
            taken = await prefill.run_stage(PrefillRequest("r-taken", Prompt(text="taken")))
            assert taken.kv_transfer_params is not None
            decoder = factory.ledger.pick_consumer()
            assert isinstance(decoder, OpenAIHttpBackend)
            generate = GenerateRequest(
                "r-taken", Prompt(text="taken"), kv_transfer_params=taken.kv_transfer_params
            )
            async with decoder.open_stream(generate) as stream:
                await stream.receive()
            assert await prefill.release(taken.kv_transfer_params) is False
            assert prefill.statistics().releases_consumed == 1
        assert len(fleet.log("decode-0")) == 2
        assert fleet.engine("prefill-0").statistics().kv_handles_outstanding == 0


async def test_health_follows_the_engine_and_models_pass_through() -> None:
    settings = OpenAIHttpSettings(health_interval_s=0.02, failures_to_down=2)
    async with sim_http_fleet({"pd": 1}, configs={"pd": SimConfig(crash_on_request=1)}) as fleet:
        factory = OpenAIHttpBackendFactory(settings)
        async with running_backend(fleet, "pd-0", factory) as backend:
            models = await backend.models()
            assert [m["id"] for m in models["data"]] == [MODEL]  # type: ignore[index, union-attr]
            with pytest.raises(RemoteWorkerError) as caught:
                async with backend.open_stream(GenerateRequest("boom", Prompt(text="x"))):
                    pass
            assert caught.value.retryable
            assert "500" in caught.value.detail
            with trio.fail_after(2):
                # Probe-driven on the real clock; the backend exposes no "went down" event.
                while backend.status().ready:  # noqa: ASYNC110 -- /health now answers 503
                    await trio.sleep(0.02)
            assert backend.status().connected is True
            stats = backend.statistics()
            assert stats.probe_failures >= 2
            assert stats.request_failures == 1
        async with httpx.AsyncClient(base_url=fleet.servers["pd-0"].url) as client:
            debug = (await client.get("/debug/requests")).json()
            health = await client.get("/health")
        assert [r["outcome"] for r in debug["requests"]] == ["internal"]
        assert health.status_code == 503


async def test_an_unknown_kv_handle_keeps_its_code() -> None:
    """Not ``invalid_request``: the decode actor blames the prefill worker for it."""
    async with sim_http_fleet({"decode": 1}) as fleet:
        factory = OpenAIHttpBackendFactory(FAST)
        async with running_backend(fleet, "decode-0", factory) as decoder:
            bogus = {**SIX_FIELDS, "do_remote_prefill": True, "sim_kv_handle": "feedface"}
            request = GenerateRequest("r-bogus", Prompt(text="x"), kv_transfer_params=bogus)
            with pytest.raises(RemoteWorkerError) as caught:
                async with decoder.open_stream(request):
                    pass
        assert (caught.value.code, caught.value.retryable) == (ErrorCode.UNKNOWN_KV_HANDLE, False)
        assert "unknown" in caught.value.detail


async def test_a_backend_that_is_not_running_is_disconnected() -> None:
    backend = OpenAIHttpBackend("p", "http://127.0.0.1:1", model=MODEL, settings=FAST)
    with pytest.raises(WorkerDisconnected, match="not running"):
        await backend.run_stage(PrefillRequest("r", Prompt(text="x")))
    assert backend.status().ready is False


@pytest.mark.processes
def test_the_worker_cli_serves_the_openai_api() -> None:
    command = [
        sys.executable,
        "-m",
        "epd_actors",
        "worker",
        "--engine",
        "sim",
        "--serve-openai",
        "--role",
        "pd",
        "--worker-id",
        "pd-cli",
        "--listen",
        "tcp://127.0.0.1:0",
    ]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline()
            match = re.search(r"serving the OpenAI HTTP API on (http://\S+)", line)
            assert match, line
            url = match.group(1)
            body = {"model": MODEL, "prompt": "hello there", "max_tokens": 3}
            with httpx.Client(base_url=url, timeout=10) as client:
                assert client.get("/health").status_code == 200
                answer = client.post("/v1/completions", json=body, headers={"x-request-id": "c1"})
                debug = client.get("/debug/requests").json()
            assert answer.status_code == 200
            assert answer.json()["usage"]["completion_tokens"] == 3
            assert answer.headers["x-request-id"] == "c1"
            assert debug["requests"][0]["x_request_id"] == "c1"
        finally:
            process.terminate()
            process.wait(timeout=10)


@pytest.mark.parametrize("reading", [True, False], ids=["reading", "not-reading"])
async def test_a_stream_fails_soon_after_its_worker_goes_down(reading: bool) -> None:
    """A server may keep a dead engine's stream open (vLLM does on shutdown).

    The stream fails whether it was waiting for bytes when the probes took the
    worker down or is read only afterwards.
    """
    settings = OpenAIHttpSettings(health_interval_s=0.02, failures_to_down=2)
    configs = {"pd": SimConfig(stall_after_tokens=2, output_token_s=0.001)}
    async with sim_http_fleet({"pd": 1}, configs=configs) as fleet:
        factory = OpenAIHttpBackendFactory(settings)
        async with running_backend(fleet, "pd-0", factory) as backend:
            request = GenerateRequest(
                "wedged", Prompt(text="x"), sampling=SamplingParams(max_tokens=50)
            )
            with trio.fail_after(5):
                async with backend.open_stream(request) as stream:
                    assert (await stream.receive()).text
                    fleet.engine("pd-0").wedge()
                    # Probe-driven on the real clock; the backend exposes no "went down" event.
                    while not reading and backend.status().ready:  # noqa: ASYNC110
                        await trio.sleep(0.01)
                    with pytest.raises(WorkerDisconnected, match="went down"):
                        await read_to_the_end(stream)
            assert not backend.status().ready
            assert backend.statistics().in_flight == 0


@pytest.mark.parametrize("stage", ["prefill", "decode"])
async def test_requests_waiting_on_a_stalled_worker_move_as_soon_as_it_is_down(
    stage: str,
) -> None:
    """A stalled server (``SIGSTOP``) answers nothing, not even a response head.

    Once the probes take it down, a request still waiting for its answer moves
    to the other worker at once, not after its read timeout (60 s here) or the
    stage's deadline.  The guard fails the test long before either.
    """
    settings = OpenAIHttpSettings(health_interval_s=0.02, failures_to_down=2, read_timeout_s=60.0)
    stalled = f"{stage}-0"
    configs = {stalled: replace(QUICK, stall_s=float("inf"))}
    async with sim_http_fleet({"prefill": 2, "decode": 2}, configs=configs) as fleet:
        async with fleet_router(
            fleet, settings=settings, policies={stage: "round_robin"}
        ) as router:

            async def wedge_once_it_arrived() -> None:
                await fleet.servers[stalled].log.wait_for(bool)
                fleet.engine(stalled).wedge()  # /health answers 503 from now on

            with trio.fail_after(3):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(wedge_once_it_arrived)
                    done = final(await collect(router, GenerationRequest(Prompt(text="hello"))))
                await fleet.servers[stalled].log.wait_for(
                    lambda log: log[0]["disconnected"] is True
                )
            assert router.backends[stalled].status().ready is False
        assert isinstance(done, DoneEvent), done
        assert done.timings.workers[stage] == (f"{stage}-1",)
        assert [e["x_request_id"] for e in fleet.log(f"{stage}-1")] == [
            e["x_request_id"] for e in fleet.log(stalled)
        ]


async def read_to_the_end(stream: OpenAIHttpDeltaStream) -> None:
    while True:
        await stream.receive()


def test_a_vllm_refusal_keeps_the_field_it_blames() -> None:
    from epd_actors.backends.openai_http.contract import error_param
    from epd_actors.openai.errors import error_response

    body = (
        b'{"object": "error", "message": "max_tokens is too large", "type": "BadRequestError",'
        b' "param": null, "code": 400, "error": {"message": "max_tokens is too large",'
        b' "param": "max_tokens"}}'
    )
    assert error_param(body) == "max_tokens"
    assert error_param(b'{"object": "error", "message": "m", "param": "top_p"}') == "top_p"
    assert error_param(b"<html>bad gateway</html>") is None
    refusal = RemoteWorkerError(
        ErrorCode.INVALID_REQUEST, "too large", retryable=False, param="max_tokens"
    )
    answer = error_response(refusal)
    assert answer is not None
    assert answer.status == 400
    assert answer.body["error"]["param"] == "max_tokens"  # type: ignore[index]


@pytest.mark.parametrize("name", ["relay_engine_text", "shared_stream_reader"])
def test_a_boolean_setting_of_the_openai_http_table(name: str) -> None:
    """On by default, off when the file says false, a config error when not a boolean."""
    worker = {"id": "pd0", "address": "http://127.0.0.1:9000", "backend": "openai_http"}
    pool = {"pools": {"pd": {"workers": [worker]}}}
    assert getattr(parse_config(dict(pool), environ={}).router.openai_http, name)
    off = parse_config({**pool, "openai_http": {name: False}}, environ={})
    assert not getattr(off.router.openai_http, name)
    with pytest.raises(ConfigError, match=name):
        parse_config({**pool, "openai_http": {name: "yes"}}, environ={})

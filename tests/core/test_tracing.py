"""OpenTelemetry request traces: span tree, retries, cancellation, W3C traceparent propagation."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING

import pytest
import trio
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from epd_actors.core.router import open_router
from epd_actors.core.tracing import TracingConfig, open_tracing, trace_headers
from epd_actors.errors import ConfigError
from epd_actors.frontends.http import RouterHttpApp
from epd_actors.program.config_file import parse_config
from epd_actors.request import DeltaEvent, DoneEvent, ErrorEvent, GenerationRequest
from epd_actors.testing import build_sim_fleet, sim_config
from epd_actors.trace_context import CURRENT_TRACEPARENT
from tests.backends.test_openai_http_backend import chat as http_chat
from tests.backends.test_openai_http_backend import fleet_router, sim_http_fleet
from tests.backends.test_openai_http_backend import image as http_image
from tests.core.test_supervisor import chat, final, image, run_one
from tests.frontends.test_http_frontend import CHAT, connected

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


def memory_tracing(**config: object) -> tuple[object, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing = open_tracing(
        TracingConfig(enabled=True, **config),  # type: ignore[arg-type]
        processor=SimpleSpanProcessor(exporter),
    )
    assert tracing is not None
    return tracing, exporter


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return sorted(
        (span for span in spans if span.name == name),
        key=lambda span: span.attributes["epd.attempt"] if span.attributes else 0,  # type: ignore[index,return-value]
    )


def root_of(spans: tuple[ReadableSpan, ...]) -> ReadableSpan:
    (root,) = [span for span in spans if span.name == "epd.request"]
    return root


def assert_children(root: ReadableSpan, spans: tuple[ReadableSpan, ...]) -> None:
    assert root.context is not None
    for span in spans:
        if span is root:
            continue
        assert span.parent is not None
        assert span.parent.span_id == root.context.span_id
        assert span.context is not None
        assert span.context.trace_id == root.context.trace_id


async def test_an_epd_request_is_one_trace_with_a_span_per_stage_attempt() -> None:
    tracing, exporter = memory_tracing()
    fleet = build_sim_fleet({"encode": 2, "prefill": 1, "decode": 1})
    _, events = await run_one(fleet, chat(image("a"), image("b")), tracing=tracing)
    assert isinstance(final(events), DoneEvent)
    spans = exporter.get_finished_spans()
    assert sorted(span.name for span in spans) == [
        "epd.decode",
        "epd.encode",
        "epd.encode",
        "epd.prefill",
        "epd.request",
    ]
    root = root_of(spans)
    assert root.parent is None
    assert root.kind is SpanKind.SERVER
    assert_children(root, spans)
    assert root.status.status_code is StatusCode.OK
    attributes = dict(root.attributes or {})
    assert attributes["epd.request_id"] == "r1"
    assert attributes["epd.outcome"] == "ok"
    assert attributes["epd.completion_tokens"] == 5
    assert attributes["epd.retries"] == 0
    assert attributes["epd.workers.prefill"] == ("prefill-0",)
    assert float(attributes["epd.time_to_first_token_s"]) >= 0.0  # type: ignore[arg-type]
    encodes = [span for span in spans if span.name == "epd.encode"]
    assert sorted(span.attributes["epd.item"] for span in encodes) == [0, 1]  # type: ignore[index,type-var]
    assert sorted(span.attributes["epd.worker_id"] for span in encodes) == [  # type: ignore[index,type-var]
        "encode-0",
        "encode-1",
    ]
    (decode,) = by_name(spans, "epd.decode")
    decoded = dict(decode.attributes or {})
    assert decoded["epd.worker_id"] == "decode-0"
    assert decoded["epd.attempt"] == 1
    assert decoded["epd.outcome"] == "ok"
    assert decoded["epd.output_started"] is True
    assert decoded["epd.time_to_first_token_s"] == attributes["epd.time_to_first_token_s"]
    (prefill,) = by_name(spans, "epd.prefill")
    assert prefill.kind is SpanKind.CLIENT
    assert prefill.attributes is not None
    assert prefill.attributes["epd.output_started"] is False
    assert "epd.time_to_first_token_s" not in prefill.attributes


@pytest.mark.parametrize(
    ("stage", "knob"), [("prefill", "prefill_error_rate"), ("decode", "generate_error_rate")]
)
async def test_a_retry_shows_two_attempt_spans(stage: str, knob: str) -> None:
    tracing, exporter = memory_tracing()
    fleet = build_sim_fleet({"prefill": 2, "decode": 2})
    fleet.engines[f"{stage}-0"].config = sim_config(**{knob: 1.0})
    _, events = await run_one(fleet, chat(), tracing=tracing)
    assert isinstance(final(events), DoneEvent)
    spans = exporter.get_finished_spans()
    first, second = by_name(spans, f"epd.{stage}")
    assert (
        dict(first.attributes or {}).items()
        >= {
            "epd.attempt": 1,
            "epd.worker_id": f"{stage}-0",
            "epd.outcome": "RemoteWorkerError",
        }.items()
    )
    assert first.status.status_code is StatusCode.ERROR
    assert [event.name for event in first.events] == ["exception"]
    assert (
        dict(second.attributes or {}).items()
        >= {
            "epd.attempt": 2,
            "epd.worker_id": f"{stage}-1",
            "epd.outcome": "ok",
        }.items()
    )
    root = root_of(spans)
    assert_children(root, spans)
    assert root.attributes is not None
    assert root.attributes["epd.retries"] == 1
    assert root.status.status_code is StatusCode.OK


async def test_a_failed_request_ends_its_span_with_the_error() -> None:
    tracing, exporter = memory_tracing()
    fleet = build_sim_fleet({"pd": 1}, config=sim_config(generate_error_rate=1.0))
    _, events = await run_one(fleet, chat(), tracing=tracing)
    assert isinstance(final(events), ErrorEvent)
    spans = exporter.get_finished_spans()
    root = root_of(spans)
    assert root.status.status_code is StatusCode.ERROR
    assert root.attributes is not None
    assert root.attributes["epd.outcome"] == "RemoteWorkerError"
    (attempt,) = by_name(spans, "epd.pd")
    assert attempt.status.status_code is StatusCode.ERROR


async def test_a_cancelled_request_ends_its_spans_cancelled(autojump_clock: object) -> None:
    tracing, exporter = memory_tracing()
    slow = sim_config(first_token_s=0.001, output_token_s=1.0)
    fleet = build_sim_fleet({"prefill": 1, "decode": 1}, config=slow)
    from epd_actors.core.supervisor import Supervisor

    supervisor = Supervisor(fleet.pools, tracing=tracing)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        async with supervisor.generate(chat(max_tokens=50)) as events:
            async for event in events:
                if isinstance(event, DeltaEvent):
                    break  # the caller leaves mid-stream
        await supervisor.wait_idle()
        nursery.cancel_scope.cancel()
    spans = exporter.get_finished_spans()
    root = root_of(spans)
    assert root.attributes is not None
    assert root.attributes["epd.outcome"] == "cancelled"
    assert root.status.status_code is StatusCode.ERROR
    assert root.status.description == "cancelled"
    (decode,) = by_name(spans, "epd.decode")
    assert decode.attributes is not None
    assert decode.attributes["epd.outcome"] == "cancelled"
    assert decode.attributes["epd.output_started"] is True
    assert decode.status.status_code is StatusCode.ERROR
    (prefill,) = by_name(spans, "epd.prefill")
    assert prefill.status.status_code is StatusCode.OK
    assert_children(root, spans)


async def test_the_clients_traceparent_is_the_roots_parent() -> None:
    tracing, exporter = memory_tracing()
    fleet = build_sim_fleet({"pd": 1})
    request = GenerationRequest(chat().prompt, sampling=chat().sampling, traceparent=TRACEPARENT)
    _, events = await run_one(fleet, request, tracing=tracing)
    assert isinstance(final(events), DoneEvent)
    root = root_of(exporter.get_finished_spans())
    assert root.parent is not None
    assert format(root.parent.span_id, "016x") == CLIENT_SPAN
    assert root.context is not None
    assert format(root.context.trace_id, "032x") == CLIENT_TRACE


async def test_a_malformed_traceparent_starts_a_new_trace() -> None:
    tracing, exporter = memory_tracing()
    fleet = build_sim_fleet({"pd": 1})
    request = GenerationRequest(
        chat().prompt, sampling=chat().sampling, traceparent="00-not-a-trace-01"
    )
    _, events = await run_one(fleet, request, tracing=tracing)
    assert isinstance(final(events), DoneEvent)
    assert root_of(exporter.get_finished_spans()).parent is None


async def test_an_unsampled_client_trace_records_nothing() -> None:
    tracing, exporter = memory_tracing()
    fleet = build_sim_fleet({"pd": 1})
    request = GenerationRequest(
        chat().prompt, sampling=chat().sampling, traceparent=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"
    )
    _, events = await run_one(fleet, request, tracing=tracing)
    assert isinstance(final(events), DoneEvent)
    assert exporter.get_finished_spans() == ()


async def test_sample_ratio_zero_records_no_new_trace() -> None:
    tracing, exporter = memory_tracing(sample_ratio=0.0)
    _, events = await run_one(build_sim_fleet({"pd": 1}), chat(), tracing=tracing)
    assert isinstance(final(events), DoneEvent)
    assert exporter.get_finished_spans() == ()


async def test_the_http_front_end_takes_the_traceparent_header() -> None:
    tracing, exporter = memory_tracing()
    fleet = build_sim_fleet({"prefill": 1, "decode": 1})
    async with open_router(
        fleet.router_config(), backend_factory=fleet.backend_factory, tracing=tracing
    ) as router:
        await router.wait_ready()
        async with connected(RouterHttpApp(router)) as client:
            reply = await client.request(
                "POST",
                "/v1/chat/completions",
                json_body={**CHAT, "model": "sim-model"},
                headers=(("traceparent", TRACEPARENT),),
            )
    assert reply.status == 200
    root = root_of(exporter.get_finished_spans())
    assert root.context is not None
    assert format(root.context.trace_id, "032x") == CLIENT_TRACE


@pytest.mark.processes
async def test_each_attempt_sends_its_traceparent_to_http_workers() -> None:
    tracing, exporter = memory_tracing()
    async with sim_http_fleet({"encode": 1, "prefill": 1, "decode": 1}) as fleet:
        config = fleet.config()
        async with open_router(config, tracing=tracing) as router:
            await router.wait_ready()
            request = http_chat(http_image(1))
            async with router.generate(
                GenerationRequest(
                    request.prompt,
                    media=request.media,
                    sampling=request.sampling,
                    traceparent=TRACEPARENT,
                )
            ) as events:
                assert isinstance([event async for event in events][-1], DoneEvent)
        spans = exporter.get_finished_spans()
        for stage in ("encode", "prefill", "decode"):
            (span,) = by_name(spans, f"epd.{stage}")
            assert span.context is not None
            expected = f"00-{CLIENT_TRACE}-{span.context.span_id:016x}-01"
            assert [entry["traceparent"] for entry in fleet.stage_log(stage)] == [expected]


@pytest.mark.processes
async def test_untraced_requests_send_no_traceparent() -> None:
    async with sim_http_fleet({"pd": 1}) as fleet, fleet_router(fleet) as router:
        async with router.generate(http_chat()) as events:
            assert isinstance([event async for event in events][-1], DoneEvent)
        assert [entry["traceparent"] for entry in fleet.stage_log("pd")] == [None]


def test_trace_headers_outside_an_attempt_are_empty() -> None:
    assert trace_headers() == ()
    token = CURRENT_TRACEPARENT.set(TRACEPARENT)
    try:
        assert trace_headers() == (("traceparent", TRACEPARENT),)
    finally:
        CURRENT_TRACEPARENT.reset(token)


def test_tracing_is_off_by_default_and_configured_by_its_table() -> None:
    pools = {"pools": {"pd": {"workers": [{"id": "pd-0", "address": "tcp://127.0.0.1:9000"}]}}}
    assert parse_config(pools).router.tracing == TracingConfig()
    assert open_tracing(TracingConfig()) is None
    table = {
        "enabled": True,
        "endpoint": "http://127.0.0.1:4318/v1/traces",
        "service_name": "edge-router",
        "sample_ratio": 0.25,
    }
    config = parse_config({**pools, "tracing": table}).router.tracing
    assert config == TracingConfig(True, table["endpoint"], "edge-router", 0.25)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ({"sample_ratio": 1.5}, "sample_ratio must be between 0 and 1"),
        ({"exporter": "zipkin"}, "exporter must be one of otlp, console"),
        ({"service_name": ""}, "service_name must not be empty"),
        ({"endpoint": 3}, "tracing.endpoint"),
        ({"color": "red"}, "tracing.color"),
    ],
)
def test_bad_tracing_tables_are_refused(table: dict[str, object], match: str) -> None:
    pools = {"pools": {"pd": {"workers": [{"id": "pd-0", "address": "tcp://127.0.0.1:9000"}]}}}
    with pytest.raises(ConfigError, match=match):
        parse_config({**pools, "tracing": table})


def test_the_otlp_exporter_is_built_from_the_endpoint() -> None:
    from epd_actors.core.tracing.otel import OtelTracing

    tracing = OtelTracing(TracingConfig(True, "http://127.0.0.1:1/v1/traces"))
    tracing.shutdown()


@pytest.mark.processes
def test_a_router_without_tracing_never_imports_opentelemetry() -> None:
    script = textwrap.dedent(
        """
        import sys, trio
        from epd_actors import GenerationRequest, Prompt, SamplingParams, open_router
        from epd_actors.testing import build_sim_fleet

        async def main():
            fleet = build_sim_fleet({"pd": 1})
            config = fleet.router_config()
            few = SamplingParams(max_tokens=2)
            async with open_router(config, backend_factory=fleet.backend_factory) as router:
                request = GenerationRequest(Prompt(text="hi"), sampling=few)
                async with router.generate(request) as events:
                    [event async for event in events]
            loaded = sorted(name for name in sys.modules if name.startswith("opentelemetry"))
            assert loaded == [], loaded

        trio.run(main)
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)

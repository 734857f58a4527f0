"""A router process exports its spans to a real OTLP/HTTP receiver.

The receiver is a tiny HTTP/1.1 server on loopback port 0 in this test; it
decodes each ``POST /v1/traces`` body as the protobuf
``ExportTraceServiceRequest`` (``opentelemetry-proto``, which the OTLP
exporter depends on) and answers 200 with an empty export response.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from functools import partial
from typing import TYPE_CHECKING

import httpx
import pytest
import trio
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from epd_actors.program.deployment import WorkerSpec, open_local_workers
from epd_actors.program.worker import AUTH_TOKEN_ENV
from tests.e2e.test_deployments import Output

if TYPE_CHECKING:
    from pathlib import Path

    from opentelemetry.proto.trace.v1.trace_pb2 import Span

pytestmark = pytest.mark.processes

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TOKEN = "otlp-token"


class OtlpReceiver:
    """Collects the spans of every OTLP/HTTP export it is sent."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.paths: list[str] = []
        self.changed = trio.Event()

    async def handle(self, stream: trio.SocketStream) -> None:
        buffer = b""
        async with stream:
            while True:
                while b"\r\n\r\n" not in buffer:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    buffer += chunk
                head, buffer = buffer.split(b"\r\n\r\n", 1)
                request_line, *header_lines = head.decode("latin-1").split("\r\n")
                headers = dict(line.lower().split(": ", 1) for line in header_lines)
                length = int(headers.get("content-length", "0"))
                while len(buffer) < length:
                    chunk = await stream.receive_some(65536)
                    assert chunk, "the exporter closed mid-body"
                    buffer += chunk
                body, buffer = buffer[:length], buffer[length:]
                self.paths.append(request_line.split(" ")[1])
                export = ExportTraceServiceRequest.FromString(body)
                for resource in export.resource_spans:
                    for scope in resource.scope_spans:
                        self.spans.extend(scope.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                await stream.send_all(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\n"
                    + f"Content-Length: {len(reply)}\r\n\r\n".encode()
                    + reply
                )
                self.changed.set()
                self.changed = trio.Event()

    async def until_span(self, name: str) -> None:
        while not any(span.name == name for span in self.spans):
            await self.changed.wait()


def write_config(path: Path, worker: str, endpoint: str) -> None:
    path.write_text(f"""
model = "sim-model"
auth_token = "{TOKEN}"

[server]
http_listen = "127.0.0.1:0"

[tracing]
enabled = true
endpoint = "{endpoint}"
service_name = "otlp-test-router"

[pools.pd]
workers = [{{ id = "pd0", address = "{worker}" }}]
""")


async def test_a_router_process_exports_the_request_spans_over_otlp_http(
    tmp_path: Path,
) -> None:
    receiver = OtlpReceiver()
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            (listener,) = await nursery.start(
                partial(trio.serve_tcp, receiver.handle, 0, host="127.0.0.1")
            )
            port = listener.socket.getsockname()[1]
            specs = [WorkerSpec("pd", "pd0")]
            async with open_local_workers(specs, env={AUTH_TOKEN_ENV: TOKEN}) as workers:
                config = tmp_path / "epd.toml"
                endpoint = f"http://127.0.0.1:{port}/v1/traces"
                write_config(config, str(workers.addresses["pd0"]), endpoint)
                command = [sys.executable, "-m", "epd_actors", "serve", "--config", str(config)]
                process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE)
                try:
                    assert process.stdout is not None
                    banner = await Output(process.stdout).until("router listening on")
                    found = re.search(r"router listening on (http://\S+)", banner)
                    assert found
                    async with httpx.AsyncClient(base_url=found.group(1), timeout=30) as client:
                        reply = await client.post(
                            "/v1/chat/completions",
                            json={
                                "model": "sim-model",
                                "messages": [{"role": "user", "content": "hello"}],
                                "max_tokens": 3,
                            },
                            headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
                        )
                    assert reply.status_code == 200
                finally:
                    process.send_signal(signal.SIGTERM)  # closing the router flushes its spans
                    assert await process.wait() == 0
            await receiver.until_span("epd.request")
            nursery.cancel_scope.cancel(reason="test over")
    assert set(receiver.paths) == {"/v1/traces"}
    (root,) = [span for span in receiver.spans if span.name == "epd.request"]
    assert root.trace_id.hex() == CLIENT_TRACE
    assert root.parent_span_id.hex() == CLIENT_SPAN
    children = [span for span in receiver.spans if span is not root]
    assert children, "no attempt span arrived"
    assert {span.name for span in children} <= {"epd.decode", "epd.pd"}
    for span in children:
        assert span.trace_id == root.trace_id
        assert span.parent_span_id == root.span_id

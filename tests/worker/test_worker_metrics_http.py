"""The worker's Prometheus endpoint (``worker --metrics-listen``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import prometheus_client
import pytest
import trio
import trio.testing

from epd_actors.program.worker import AUTH_TOKEN_ENV
from epd_actors.worker import metrics_http


def registry_with_a_gauge() -> prometheus_client.CollectorRegistry:
    registry = prometheus_client.CollectorRegistry()
    gauge = prometheus_client.Gauge(
        "vllm:num_requests_running", "running", ["engine"], registry=registry
    )
    gauge.labels(engine="0").set(3)
    return registry


async def ask(request: bytes, registry: prometheus_client.CollectorRegistry) -> bytes:
    client, server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(metrics_http.registry_server(registry).handle_connection, server)
        await client.send_all(request)
        answer = b""
        with trio.fail_after(5):
            while chunk := await client.receive_some(65536):
                answer += chunk
                if b"\r\n\r\n" in answer and (
                    b"vllm:num_requests_running" in answer or b"not" in answer
                ):
                    break
    return answer


async def test_get_metrics_answers_the_registry_in_text_format() -> None:
    answer = await ask(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n", registry_with_a_gauge())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"content-type: text/plain; version=" in head.lower()
    assert b"connection: close" in head.lower()
    assert b'vllm:num_requests_running{engine="0"} 3.0' in body


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /other HTTP/1.1\r\nhost: x\r\n\r\n", b"404"),
        (b"POST /metrics HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n", b"405"),
    ],
)
async def test_other_paths_and_methods_are_refused(request_bytes: bytes, status: bytes) -> None:
    answer = await ask(request_bytes, registry_with_a_gauge())
    assert answer.startswith(b"HTTP/1.1 " + status)
    assert b"vllm:num_requests_running" not in answer


async def test_garbage_and_oversized_heads_are_refused_and_close_the_connection() -> None:
    registry = registry_with_a_gauge()
    garbage = b"\x00\x01 not http\r\n\r\n"
    oversized = b"GET /metrics HTTP/1.1\r\nx: " + b"a" * 20000
    for request, status in ((garbage, b"400"), (oversized, b"431")):
        client, server = trio.testing.memory_stream_pair()
        answer = b""
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(metrics_http.registry_server(registry).handle_connection, server)
                await client.send_all(request)
                await client.send_eof()
                while chunk := await client.receive_some(65536):
                    answer += chunk
        assert answer.startswith(b"HTTP/1.1 " + status)
        assert b"connection: close" in answer.lower()
        assert b"vllm:num_requests_running" not in answer


@pytest.mark.processes
async def test_a_worker_serves_its_metrics_next_to_the_protocol() -> None:
    command = [sys.executable, "-m", "epd_actors", "worker", "--role", "decode"]
    command += ["--metrics-listen", "tcp://127.0.0.1:0"]
    with trio.fail_after(60):
        process = await trio.lowlevel.open_process(
            command, stdout=subprocess.PIPE, env={**os.environ, AUTH_TOKEN_ENV: "t"}
        )
        assert process.stdout is not None
        output = b""
        while b"listening on " not in output:
            output += await process.stdout.receive_some(4096)
        url = output.decode().split("metrics on ", 1)[1].split()[0]
        response = await trio.to_thread.run_sync(lambda: httpx.get(url, timeout=10))
        process.send_signal(signal.SIGTERM)
        assert await process.wait() == 0
    assert response.status_code == 200
    assert "process_cpu_seconds_total" in response.text or "python_info" in response.text

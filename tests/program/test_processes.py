"""The parent of ``serve --processes``, its child protocol and its merged metrics.

Fast checks: pure functions, loopback sockets on port 0, and fake children
(``python -c`` scripts speaking the ready-line protocol of a router process).
The whole command over real router processes is in tests/e2e/test_serve_processes.py.
"""

from __future__ import annotations

import argparse
import socket
import sys
from dataclasses import replace

import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from epd_actors.core.config import PoolConfig, RouterConfig
from epd_actors.errors import ConfigError
from epd_actors.program.config_file import FileConfig, ServerConfig, parse_config
from epd_actors.program.process_child import (
    CHILD_ENV,
    READY_MARKER,
    ChildSpec,
    child_spec,
    reuse_port_socket,
    watch_parent,
)
from epd_actors.program.process_metrics import merge, scrape, serve_metrics
from epd_actors.program.processes import (
    Listen,
    ProcessStartError,
    RouterProcesses,
    child_command,
    serve_processes_overrides,
)

CHILD_EXPOSITION = b"""# HELP epd_requests_total Generation requests by outcome
# TYPE epd_requests_total counter
epd_requests_total{outcome="done"} 3.0
# HELP epd_requests_in_flight Requests being served
# TYPE epd_requests_in_flight gauge
epd_requests_in_flight 2.0
"""


def by_name(text: bytes) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def test_merge_labels_every_series_with_its_process_and_keeps_one_family() -> None:
    merged = merge({"0": CHILD_EXPOSITION, "1": CHILD_EXPOSITION, "2": None}, {"0": 0, "1": 2})
    samples = by_name(merged)
    assert samples["epd_requests_total"] == [
        ({"outcome": "done", "process": "0"}, 3.0),
        ({"outcome": "done", "process": "1"}, 3.0),
    ]
    assert samples["epd_requests_in_flight"] == [({"process": "0"}, 2.0), ({"process": "1"}, 2.0)]
    up = {labels["process"]: value for labels, value in samples["epd_router_process_up"]}
    assert up == {"0": 1.0, "1": 1.0, "2": 0.0}
    restarts = samples["epd_router_process_restarts_total"]
    assert restarts == [({"process": "0"}, 0.0), ({"process": "1"}, 2.0)]
    assert merged.count(b"# TYPE epd_requests_total counter") == 1


def test_merge_of_a_real_router_registry_round_trips() -> None:
    from epd_actors.core.metrics import RouterMetrics

    metrics = RouterMetrics()
    metrics.observe_http("/v1/completions", 200)
    merged = by_name(merge({"0": metrics.render()}))
    assert merged["epd_http_requests_total"] == [
        ({"route": "/v1/completions", "status": "200", "process": "0"}, 1.0)
    ]
    buckets = merged["epd_request_duration_seconds_bucket"]
    assert all(labels["process"] == "0" for labels, _ in buckets)


def test_child_spec_round_trips_through_the_environment() -> None:
    spec = ChildSpec(1, (("127.0.0.1", 8000),), (("::1", 8001),))
    assert child_spec({CHILD_ENV: spec.to_env()}) == spec
    assert child_spec({}) is None
    with pytest.raises(ConfigError, match=CHILD_ENV):
        child_spec({CHILD_ENV: '{"index": 0}'})
    with pytest.raises(ConfigError, match=CHILD_ENV):
        child_spec({CHILD_ENV: "not json"})


POOLS = {"pools": {"pd": {"workers": [{"id": "w", "address": "tcp://127.0.0.1:1"}]}}}


def file_server(server: dict[str, object]) -> ServerConfig:
    return parse_config({**POOLS, "server": server}, environ={}).server


def test_the_file_sets_processes_and_metrics_listen() -> None:
    server = file_server({"processes": 4, "metrics_listen": "127.0.0.1:9100"})
    assert server.processes == 4
    assert server.metrics_listen == "127.0.0.1:9100"
    assert file_server({}).processes == 1
    assert file_server({}).metrics_listen is None
    with pytest.raises(ConfigError, match=r"server\.processes: must be >= 1"):
        file_server({"processes": 0})
    with pytest.raises(ConfigError, match=r"server\.metrics_listen"):
        file_server({"metrics_listen": "nowhere"})


def serve_args(**given: object) -> argparse.Namespace:
    values: dict[str, object] = {
        "processes": None,
        "metrics_listen": None,
        "config": "epd.toml",
        "http_listen": None,
        "ws_listen": None,
        "access_log": False,
        "log_level": "INFO",
        "log_format": "json",
    }
    return argparse.Namespace(**{**values, **given})


def test_command_line_overrides_and_the_child_command() -> None:
    server = ServerConfig(processes=2)
    assert serve_processes_overrides(server, serve_args()) == server
    changed = serve_processes_overrides(server, serve_args(processes=3, metrics_listen="[::1]:0"))
    assert (changed.processes, changed.metrics_listen) == (3, "[::1]:0")
    with pytest.raises(ConfigError, match="--processes"):
        serve_processes_overrides(server, serve_args(processes=0))
    with pytest.raises(ConfigError, match="--metrics-listen"):
        serve_processes_overrides(server, serve_args(metrics_listen="x"))
    command = child_command(serve_args(ws_listen="127.0.0.1:0", access_log=True))
    assert command[:3] == [sys.executable, "-m", "epd_actors"]
    assert command[command.index("--log-format") + 1] == "json"
    assert command[command.index("--config") + 1].endswith("epd.toml")
    assert "--ws-listen" in command
    assert "--access-log" in command
    assert "--processes" not in command


def test_the_reserved_port_is_shared_by_reuse_port_sockets_only() -> None:
    listen = Listen.reserve("127.0.0.1:0", key="server.http_listen")
    try:
        assert listen.port > 0
        child = reuse_port_socket(listen.host, listen.port)
        child.close()
        plain = socket.socket()
        with pytest.raises(OSError, match="in use"):
            plain.bind(listen.address)
        plain.close()
    finally:
        listen.holder.close()


def test_a_taken_port_fails_the_reservation() -> None:
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        with pytest.raises(OSError, match="in use"):
            Listen.reserve(f"127.0.0.1:{taken.getsockname()[1]}", key="k")
    finally:
        taken.close()


async def test_watch_parent_stops_at_the_end_of_the_pipe() -> None:
    send, receive = trio.testing.memory_stream_one_way_pair()
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_parent, stop, receive)
        await send.send_all(b"anything")
        await trio.testing.wait_all_tasks_blocked()
        assert not stop.is_set()
        await send.aclose()
    assert stop.is_set()


async def test_the_metrics_endpoint_serves_what_it_renders() -> None:
    calls = 0

    async def render() -> bytes:
        nonlocal calls
        calls += 1
        return b"x 1\n"

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    address = ("127.0.0.1", listeners[0].socket.getsockname()[1])
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_metrics, listeners, render)
        assert await scrape(address) == b"x 1\n"
        assert calls == 1
        answer = b""
        async with await trio.open_tcp_stream(*address) as stream:
            await stream.send_all(b"GET /other HTTP/1.1\r\nhost: x\r\n\r\n")
            while chunk := await stream.receive_some(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 404")
        assert calls == 1
        nursery.cancel_scope.cancel()
    free = socket.create_server(("127.0.0.1", 0))
    closed = ("127.0.0.1", free.getsockname()[1])
    free.close()
    assert await scrape(closed) is None


def fake_config() -> FileConfig:
    config = FileConfig(RouterConfig((PoolConfig("pd", ()),)))
    return replace(config, server=replace(config.server, http_listen="127.0.0.1:0"))


def fake_child(script: str) -> list[str]:
    return [sys.executable, "-c", script]


READY = (
    "import json, os, sys\n"
    f"print({READY_MARKER!r}, json.dumps({{'index': 0, 'pid': os.getpid(), "
    "'private_http': '127.0.0.1:1'}), flush=True)\n"
)


async def test_a_child_that_exits_before_ready_fails_the_start_with_its_last_line() -> None:
    script = "import sys; print('bad things: no decode pool', file=sys.stderr); sys.exit(2)"
    group = RouterProcesses(fake_config(), 2, fake_child(script), announce=lambda _: None)
    group.reserve()
    try:
        with pytest.RaisesGroup(
            pytest.RaisesExc(ProcessStartError, match=r"status 2 before it was ready: bad things"),
            flatten_subgroups=True,
        ):
            async with trio.open_nursery() as nursery:
                await nursery.start(group.run)
    finally:
        group.close()
    assert all(child.process is not None for child in group.children)
    assert all(child.process.returncode is not None for child in group.children if child.process)


async def test_a_child_that_ignores_sigterm_is_killed_on_the_second_signal() -> None:
    script = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + READY
    script += "time.sleep(600)\n"
    group = RouterProcesses(fake_config(), 1, fake_child(script), announce=lambda _: None)
    group.reserve()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(group.run)
            assert group.children[0].ready
            escalate = trio.Event()
            results: list[bool] = []

            async def stop() -> None:
                results.append(await group.stop(escalate=escalate))

            async with trio.open_nursery() as stopping:
                stopping.start_soon(stop)
                await trio.sleep(0.2)
                assert group.children[0].process is not None
                assert group.children[0].process.returncode is None  # still draining
                escalate.set()
            nursery.cancel_scope.cancel()
    finally:
        group.close()
    assert group.children[0].process is not None
    assert group.children[0].process.returncode == -9
    assert results == [False]


async def test_a_ready_line_that_is_not_json_is_ignored_and_the_child_stays_unready() -> None:
    script = f"import time\nprint({READY_MARKER!r} + ' nonsense', flush=True)\n" + READY
    script += "time.sleep(600)\n"
    group = RouterProcesses(fake_config(), 1, fake_child(script), announce=lambda _: None)
    group.reserve()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(group.run)
            child = group.children[0]
            assert child.ready
            assert child.private_http == ("127.0.0.1", 1)
            nursery.cancel_scope.cancel()
    finally:
        group.close()

"""The simulator's HTTP API as an external P/D router (vllm-router) drives it.

vllm-router's P/D mode (``--vllm-pd-disaggregation``) was observed on the
wire against the simulator: at startup it probes ``GET /health`` and reads
``GET /metrics`` (vLLM's Prometheus gauges, to count data-parallel engines);
per request it sends P the client's body with ``stream: false``,
``max_tokens: 1``, ``min_tokens: 1``, no ``stream_options`` and
``kv_transfer_params`` with ``do_remote_decode: true`` and the remote fields
null, then sends D the client's body with P's ``kv_transfer_params`` copied
verbatim; both carry one ``x-request-id``.  These tests replay that exchange
against the simulated servers (real loopback sockets, real clock, every
wait under ``fail_after``).
"""

from __future__ import annotations

import json
import re

import httpx
import trio

from epd_actors.simulator.engine import SimConfig
from tests.backends.test_openai_http_backend import GUARD_S, MODEL, sim_http_fleet

REQUEST_ID = "___prefill_addr_127.0.0.1:1___decode_addr_127.0.0.1:2_0123456789abcdef"
CLIENT_BODY: dict[str, object] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hello there world"}],
    "max_tokens": 20,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def prefill_body() -> dict[str, object]:
    """What vllm-router sends P for ``CLIENT_BODY`` (the fields that matter)."""
    body = {k: v for k, v in CLIENT_BODY.items() if k != "stream_options"}
    body.update(stream=False, max_tokens=1, min_tokens=1)
    body["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return body


def unary_body() -> dict[str, object]:
    """``CLIENT_BODY`` asking for one answer rather than a stream."""
    body = {k: v for k, v in CLIENT_BODY.items() if k != "stream_options"}
    return {**body, "stream": False}


def events(stream: bytes) -> list[object]:
    return [
        json.loads(line[6:]) if line != b"data: [DONE]" else "[DONE]"
        for line in stream.split(b"\n\n")
        if line.startswith(b"data: ")
    ]


async def test_a_p_then_d_exchange_hands_the_kv_handle_over() -> None:
    headers = {"x-request-id": REQUEST_ID}
    async with sim_http_fleet({"prefill": 1, "decode": 1}) as fleet:
        prefill_url, decode_url = fleet.servers["prefill-0"].url, fleet.servers["decode-0"].url
        async with httpx.AsyncClient(timeout=GUARD_S) as client:
            answer = await client.post(
                prefill_url + "/v1/chat/completions", json=prefill_body(), headers=headers
            )
            assert answer.status_code == 200
            kv = answer.json()["kv_transfer_params"]
            assert kv["do_remote_prefill"] is True
            assert kv["remote_engine_id"] == "prefill-0"
            assert kv["remote_request_id"] == REQUEST_ID
            decoded = await client.post(
                decode_url + "/v1/chat/completions",
                json={**CLIENT_BODY, "kv_transfer_params": kv},
                headers=headers,
            )
        assert decoded.status_code == 200
        received = events(decoded.content)
        assert received[-1] == "[DONE]"
        usage = received[-2]
        assert isinstance(usage, dict)
        assert usage["usage"]["completion_tokens"] == 20
        (logged,) = fleet.log("decode-0")
        assert logged["kv_transfer_params"] == kv
        assert (logged["outcome"], logged["x_request_id"]) == ("ok", REQUEST_ID)
        (prefilled,) = fleet.log("prefill-0")
        assert (prefilled["stream"], prefilled["max_tokens"]) == (False, 1)


async def test_d_refuses_what_p_never_handed_over() -> None:
    forged = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "sim_kv_handle": "00"}
    async with sim_http_fleet({"decode": 1}) as fleet:
        url = fleet.servers["decode-0"].url + "/v1/chat/completions"
        async with httpx.AsyncClient() as client:
            refused = await client.post(url, json={**CLIENT_BODY, "kv_transfer_params": forged})
    assert refused.status_code == 400
    assert fleet.log("decode-0")[0]["outcome"] != "ok"


async def test_metrics_count_the_requests_being_served() -> None:
    slow = SimConfig(output_token_s=0.001, tokens_per_delta=1)
    gauge = re.compile(r'^vllm:num_requests_running\{engine="0",model_name="sim-model"\} (\S+)$')
    async with sim_http_fleet({"pd": 1}, configs={"pd": slow}) as fleet:
        server = fleet.servers["pd-0"]
        async with httpx.AsyncClient(base_url=server.url, timeout=GUARD_S) as client:
            idle = await client.get("/metrics")
            body = {**CLIENT_BODY, "max_tokens": 50}
            payload = json.dumps(body).encode()
            head = (
                f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
            )
            # A plain socket: the test closes it mid-stream, as a leaving client does.
            async with await trio.open_tcp_stream(server.host, server.port) as stream:
                await stream.send_all(head.encode() + payload)
                received = b""
                with trio.fail_after(GUARD_S):
                    while b"data: " not in received:
                        received += await stream.receive_some(65536)
                busy = await client.get("/metrics")
            with trio.fail_after(GUARD_S):
                while server.running:  # noqa: ASYNC110 -- the server notices the close itself
                    await trio.sleep(0.01)
            after = await client.get("/metrics")

    def running(reply: httpx.Response) -> float:
        values = [gauge.match(line) for line in reply.text.splitlines()]
        (value,) = [float(m.group(1)) for m in values if m]
        return value

    assert idle.headers["content-type"].startswith("text/plain")
    assert "vllm:num_requests_waiting{" in idle.text
    assert (running(idle), running(busy), running(after)) == (0.0, 1.0, 0.0)


async def test_metrics_count_prefix_cache_queries_and_hits_in_tokens() -> None:
    cached = SimConfig(prefix_cache_blocks=64, output_token_s=0.0)
    counter = re.compile(
        r'^vllm:prefix_cache_(queries|hits)_total\{engine="0",model_name="sim-model"\} (\S+)$'
    )
    body = {
        "model": MODEL,
        "prompt": " ".join(f"w{i}" for i in range(200)),
        "max_tokens": 2,
    }
    async with sim_http_fleet({"pd": 1}, configs={"pd": cached}) as fleet:
        url = fleet.servers["pd-0"].url
        async with httpx.AsyncClient(base_url=url, timeout=GUARD_S) as client:
            before = await client.get("/metrics")
            for _ in range(2):
                assert (await client.post("/v1/completions", json=body)).status_code == 200
            after = await client.get("/metrics")

    def values(reply: httpx.Response) -> dict[str, float]:
        found = (counter.match(line) for line in reply.text.splitlines())
        return {m.group(1): float(m.group(2)) for m in found if m}

    assert values(before) == {"queries": 0.0, "hits": 0.0}
    counted = values(after)
    # The second identical prompt finds every full block of the first cached.
    assert counted["queries"] > 0
    assert 0 < counted["hits"] < counted["queries"]
    assert counted["hits"] >= counted["queries"] / 2 - 16


async def test_metrics_have_no_prefix_cache_counters_without_a_cache() -> None:
    async with sim_http_fleet({"pd": 1}) as fleet:
        url = fleet.servers["pd-0"].url
        async with httpx.AsyncClient(base_url=url, timeout=GUARD_S) as client:
            text = (await client.get("/metrics")).text
    assert "vllm:num_requests_running{" in text
    assert "prefix_cache" not in text


async def test_fields_vllm_does_not_know_are_ignored_as_vllm_ignores_them() -> None:
    # vllm-router adds SGLang's fields to what it forwards; vLLM accepts and ignores them.
    extra = {"no_stop_trim": False, "return_hidden_states": False, "separate_reasoning": True}
    extra |= {"continue_final_message": False, "include_reasoning": True}  # vLLM's defaults
    async with sim_http_fleet({"pd": 1}) as fleet:
        url = fleet.servers["pd-0"].url + "/v1/chat/completions"
        async with httpx.AsyncClient(timeout=GUARD_S) as client:
            answer = await client.post(url, json={**unary_body(), **extra})
        assert answer.status_code == 200
        assert answer.json()["usage"]["completion_tokens"] == 20
        (logged,) = fleet.log("pd-0")
        assert set(extra) <= set(logged["keys"])


async def test_a_field_the_simulator_does_not_model_is_refused_off_its_default() -> None:
    async with sim_http_fleet({"pd": 1}) as fleet:
        url = fleet.servers["pd-0"].url + "/v1/chat/completions"
        body = {**unary_body(), "continue_final_message": True}
        async with httpx.AsyncClient(timeout=GUARD_S) as client:
            answer = await client.post(url, json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "continue_final_message"

"""E -> P -> D driven by hand through three real worker processes over loopback."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest
import trio

from epd_actors.addresses import Address, open_stream, parse_address
from epd_actors.program.deployment import WorkerSpec, open_local_workers
from epd_actors.program.worker import AUTH_TOKEN_ENV
from epd_actors.protocol import (
    PROTOCOL_VERSION,
    ChatMessage,
    Delta,
    EncodeRequest,
    ErrorCode,
    ErrorReply,
    GenerateRequest,
    Hello,
    MediaItem,
    PrefillRequest,
    Prompt,
    SamplingParams,
    StageResult,
    Welcome,
)
from epd_actors.transport.framed import FramedStream

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.processes

TOKEN = "process-test-token"


async def dial(address: Address) -> FramedStream:
    client = FramedStream(await open_stream(address), peer=str(address))
    await client.send(Hello(PROTOCOL_VERSION, TOKEN, "test"))
    assert isinstance(await client.receive(), Welcome)
    return client


def specs(store: Path) -> list[WorkerSpec]:
    shared = ("--sim-store-dir", str(store))
    return [
        WorkerSpec("encode", "e0", shared),
        WorkerSpec("prefill", "p0", shared),
        WorkerSpec("decode", "d0", shared),
    ]


async def test_encode_prefill_decode_by_hand(tmp_path: Path) -> None:
    data = b"\x89PNG fake image bytes"
    image = MediaItem("image/png", data, hashlib.sha256(data).hexdigest())
    prompt = Prompt(messages=(ChatMessage("user", ("Describe", 0)),))
    sampling = SamplingParams(max_tokens=12, temperature=0.0)
    with trio.fail_after(60):
        async with open_local_workers(specs(tmp_path), env={AUTH_TOKEN_ENV: TOKEN}) as workers:
            addresses = workers.addresses
            encoder, prefiller, decoder = [await dial(addresses[w]) for w in ("e0", "p0", "d0")]

            # P refuses an image E never encoded (strict simulator).
            await prefiller.send(PrefillRequest("r0", prompt, (image,), sampling))
            refused = await prefiller.receive()
            assert isinstance(refused, ErrorReply)
            assert refused.code == ErrorCode.MISSING_ENCODER_CACHE

            await encoder.send(EncodeRequest("r1:0", (image,)))
            encoded = await encoder.receive()
            assert isinstance(encoded, StageResult)

            await prefiller.send(
                PrefillRequest(
                    "r1", prompt, (image,), sampling, ec_transfer_params=encoded.ec_transfer_params
                )
            )
            prefilled = await prefiller.receive()
            assert isinstance(prefilled, StageResult)
            assert prefilled.kv_transfer_params is not None

            request = GenerateRequest(
                "r1", prompt, (image,), sampling, kv_transfer_params=prefilled.kv_transfer_params
            )
            await decoder.send(request)
            text, final = "", None
            while final is None:
                delta = await decoder.receive()
                assert isinstance(delta, Delta)
                text += delta.text
                if delta.finish_reason is not None:
                    final = delta
            assert final.finish_reason == "length"
            assert final.usage is not None
            assert final.usage.completion_tokens == 12
            assert final.usage.prompt_tokens == prefilled.prompt_tokens
            assert text

            # The KV handle was consumed: a second decode with it is refused.
            await decoder.send(
                GenerateRequest(
                    "r2",
                    prompt,
                    (image,),
                    sampling,
                    kv_transfer_params=prefilled.kv_transfer_params,
                )
            )
            reused = await decoder.receive()
            assert isinstance(reused, ErrorReply)
            assert reused.code == ErrorCode.UNKNOWN_KV_HANDLE
            for client in (encoder, prefiller, decoder):
                await client.aclose()
        assert [w.exits for w in workers.workers] == [[0], [0], [0]]


async def test_killed_worker_is_restarted_on_the_same_address(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with open_local_workers(
            [WorkerSpec("decode", "d0", ("--sim-store-dir", str(tmp_path)))],
            env={AUTH_TOKEN_ENV: TOKEN},
        ) as workers:
            worker = workers["d0"]
            address, first_pid = worker.address, worker.pid
            assert address is not None
            assert worker.process is not None
            worker.process.send_signal(signal.SIGKILL)
            await worker.wait_announced(2)
            assert worker.pid != first_pid
            assert worker.address == address
            client = await dial(address)
            await client.aclose()
        assert worker.exits == [-signal.SIGKILL, 0]


async def test_worker_on_a_unix_socket(tmp_path: Path) -> None:
    socket_path = tmp_path / "decode.sock"
    spec = WorkerSpec(
        "decode", "d-unix", ("--sim-store-dir", str(tmp_path)), listen=f"unix:{socket_path}"
    )
    with trio.fail_after(60):
        async with open_local_workers([spec], env={AUTH_TOKEN_ENV: TOKEN}) as workers:
            address = workers["d-unix"].address
            assert address is not None
            assert str(address) == f"unix:{socket_path}"
            client = await dial(address)
            await client.aclose()
        assert workers["d-unix"].exits == [0]


async def test_an_engine_crash_exits_3_and_says_why(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "epd_actors",
        "worker",
        "--role",
        "decode",
        "--sim-store-dir",
        str(tmp_path),
        "--sim-crash-on-request",
        "1",
    ]
    with trio.fail_after(60):
        process = await trio.lowlevel.open_process(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, AUTH_TOKEN_ENV: TOKEN},
        )
        assert process.stdout is not None
        assert process.stderr is not None
        line = b""
        while b"listening on " not in line:
            line += await process.stdout.receive_some(4096)
        address = parse_address(line.decode().split("listening on ", 1)[1].split()[0])
        client = await dial(address)
        await client.send(GenerateRequest("r", Prompt(text="hi"), kv_transfer_params={}))
        assert await process.wait() == 3
        errors = b""
        while chunk := await process.stderr.receive_some(4096):
            errors += chunk
        await client.aclose()
    message = errors.decode()
    assert "engine crashed:" in message
    assert "Exceptions from Trio nursery" not in message

"""The vLLM engine adapter and its asyncio bridge, driven with a fake AsyncLLM (no vLLM needed).

The fake is asyncio code like the real engine and runs on the bridge's loop
thread; these tests use real (short) time because two event loops are involved.
"""

from __future__ import annotations

import asyncio  # noqa: TID251 -- the fake AsyncLLM is asyncio code, as vLLM's is
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

from epd_actors.errors import ConfigError, EngineCrashed, EngineError
from epd_actors.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Aborted,
    ChatMessage,
    Delta,
    EncodeRequest,
    ErrorCode,
    GenerateRequest,
    Hello,
    MediaItem,
    PrefillRequest,
    Prompt,
    Role,
    SamplingParams,
    Welcome,
)
from epd_actors.transport.framed import FramedStream
from epd_actors.worker.engines.asyncio_bridge import (
    BridgeClosed,
    BridgeStream,
    open_asyncio_bridge,
)
from epd_actors.worker.engines.vllm import (
    REMOTE_DECODE_PARAMS,
    VllmApi,
    VllmEngine,
    open_vllm_engine,
)
from epd_actors.worker.engines.vllm_args import (
    VLLM_MISSING,
    VllmOptions,
    add_vllm_arguments,
    engine_args_for_role,
    engine_cli_args,
    vllm_options_from_args,
)
from epd_actors.worker.engines.vllm_io import render_prompt, sampling_kwargs
from epd_actors.worker.runtime import WorkerConfig, WorkerServer

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

ROOT = Path(__file__).resolve().parents[2]
GUARD_S = 5.0

# ---------------------------------------------------------------- the fake AsyncLLM


class ThreadSignal:
    """A ``trio.Event`` that any thread may set (through the Trio token)."""

    def __init__(self) -> None:
        self.event = trio.Event()
        self._token = trio.lowlevel.current_trio_token()

    def set(self) -> None:
        self._token.run_sync_soon(self.event.set)


@dataclass
class FakeParams:
    """What the adapter's sampling kwargs turn into (vLLM's SamplingParams stand-in)."""

    kwargs: dict[str, Any]


@dataclass
class FakeLogprob:
    logprob: float
    decoded_token: str | None = None


@dataclass
class FakeCompletion:
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, FakeLogprob]] | None
    finish_reason: str | None


@dataclass
class FakeOutput:
    request_id: str
    outputs: list[FakeCompletion]
    finished: bool
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None


class FakeDeadError(Exception):
    """The fake's "engine core died"."""


class FakeClientError(Exception):
    """The fake's request validation error (vLLM's VLLMClientError is no ValueError)."""


class FakeQueueFull(Exception):
    """The fake's admission refusal (vLLM's GracefulHTTPError)."""


@dataclass
class FakeTokenizer:
    chat_template: str | None = "{{ fake }}"
    conversations: list[list[dict[str, Any]]] = field(default_factory=list)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        *,
        tokenize: bool,
        add_generation_prompt: bool,
        chat_template: str | None = None,
    ) -> str:
        assert tokenize is False
        assert add_generation_prompt is True
        self.conversations.append(conversation)
        lines = []
        for message in conversation:
            content = message["content"]
            if isinstance(content, list):
                content = "".join(p.get("text", f"<{p['type']}>") for p in content)
            lines.append(f"{message['role']}: {content}")
        return "\n".join(lines) + "\nassistant:"


@dataclass
class FakeAsyncLLM:
    """A deterministic AsyncLLM: token ``i`` is ``100 + i``; one output per token in DELTA mode.

    ``delay``: seconds before each token.  ``self_abort``: like vLLM, abort the
    request when the generator is cancelled or closed.  ``fail_with``: raised by
    ``generate`` before any output.  ``finish_reason``: of the last output.
    """

    delay: float = 0.0
    self_abort: bool = True
    fail_with: BaseException | None = None
    finish_reason: str = "length"
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    calls: list[dict[str, Any]] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    yielded: Counter[str] = field(default_factory=Counter)
    running: set[str] = field(default_factory=set)
    threads: set[str] = field(default_factory=set)
    shutdown_on: str | None = None
    errored: bool = False
    signal_after: tuple[int, ThreadSignal] | None = None
    _stop: dict[str, asyncio.Event] = field(default_factory=dict)

    def _note_thread(self) -> None:
        asyncio.get_running_loop()  # raises outside an asyncio loop
        self.threads.add(threading.current_thread().name)

    async def generate(
        self,
        prompt: dict[str, Any],
        sampling_params: FakeParams,
        request_id: str,
        *,
        tokenization_kwargs: dict[str, Any] | None = None,
        **extra: Any,
    ) -> AsyncIterator[FakeOutput]:
        self._note_thread()
        kwargs = sampling_params.kwargs
        self.calls.append(
            {
                "request_id": request_id,
                "prompt": prompt,
                "kwargs": kwargs,
                "tokenization_kwargs": tokenization_kwargs,
                **extra,
            }
        )
        if self.fail_with is not None:
            raise self.fail_with
        stop = self._stop[request_id] = asyncio.Event()
        self.running.add(request_id)
        prompt_ids = prompt.get("prompt_token_ids") or [1] * len(prompt["prompt"].split())
        final_only = kwargs["output_kind"] == "final_only"
        extra = kwargs.get("extra_args") or {}
        produced: list[int] = []
        try:
            for i in range(kwargs["max_tokens"]):
                if self.delay:
                    await asyncio.sleep(self.delay)
                if stop.is_set():
                    yield FakeOutput(request_id, [FakeCompletion([], "", None, "abort")], True, [])
                    return
                last = i == kwargs["max_tokens"] - 1
                produced.append(100 + i)
                if final_only and not last:
                    continue
                ids = produced if final_only else [100 + i]
                logprobs = None
                if kwargs["logprobs"] is not None:
                    # As vLLM: per token, the sampled one first, then the most likely others.
                    logprobs = [
                        {
                            t: FakeLogprob(-(t - 99) / 10, f"t{t - 100} "),
                            **{
                                900 + j: FakeLogprob(-(t - 99) / 10 - 1 - j, f"alt{j}")
                                for j in range(kwargs["logprobs"])
                            },
                        }
                        for t in ids
                    ]
                completion = FakeCompletion(
                    list(ids),
                    "".join(f"t{t - 100} " for t in ids),
                    logprobs,
                    self.finish_reason if last else None,
                )
                output = FakeOutput(request_id, [completion], last, list(prompt_ids))
                if last and extra.get("kv_transfer_params", {}).get("do_remote_decode"):
                    output.kv_transfer_params = {
                        "do_remote_prefill": True,
                        "remote_block_ids": [[1, 2]],
                        "remote_engine_id": "fake-engine",
                        "remote_request_id": f"{request_id}-0f1e",
                    }
                if last and "multi_modal_data" in prompt:
                    output.ec_transfer_params = {f"mm-{request_id}": {"item_indices": [0]}}
                self.yielded[request_id] += 1
                if self.signal_after and self.yielded[request_id] == self.signal_after[0]:
                    self.signal_after[1].set()
                yield output
        except (asyncio.CancelledError, GeneratorExit):
            if self.self_abort:
                await self.abort(request_id)
            raise
        finally:
            self.running.discard(request_id)
            del self._stop[request_id]

    async def abort(self, request_id: str) -> None:
        self._note_thread()
        await asyncio.sleep(0)
        self.aborts.append(request_id)
        if request_id in self._stop:
            self._stop[request_id].set()

    def get_tokenizer(self) -> FakeTokenizer:
        return self.tokenizer

    def shutdown(self) -> None:
        self._note_thread()
        self.shutdown_on = threading.current_thread().name


def fake_decode(item: MediaItem) -> object:
    return f"decoded:{item.content_hash[:6]}"


OPTIONS = {
    Role.ENCODE: VllmOptions(ec_connector="ECExampleConnector"),
    Role.PREFILL: VllmOptions(kv_connector="NixlConnector"),
    Role.DECODE: VllmOptions(kv_connector="NixlConnector"),
    Role.PD: VllmOptions(),
}


def open_fake(
    fake: FakeAsyncLLM, role: Role = Role.DECODE, *, stream_buffer: int = 8, factory_log: list[Any]
) -> Any:
    def factory(cli_args: list[str]) -> VllmApi:
        factory_log.append((cli_args, threading.current_thread().name))
        return VllmApi(
            fake,
            FakeParams,
            dead_errors=(FakeDeadError,),
            client_errors=(FakeClientError,),
            overload_errors=(FakeQueueFull,),
        )

    return open_vllm_engine(
        role,
        "fake-model",
        OPTIONS[role],
        api_factory=factory,
        decode_media=fake_decode,
        stream_buffer=stream_buffer,
    )


async def collect(engine: VllmEngine, request: GenerateRequest) -> list[Delta]:
    deltas: list[Delta] = []

    async def emit(delta: Delta) -> None:
        deltas.append(delta)

    await engine.generate(request, emit)
    return deltas


def image(tag: bytes) -> MediaItem:
    return MediaItem.from_bytes(b"\x89PNG" + tag, "image/png")


# ---------------------------------------------------------------- the bridge


async def test_bridge_runs_coroutines_and_functions_on_its_own_thread() -> None:
    async def where(x: int) -> tuple[str, int]:
        await asyncio.sleep(0)
        return threading.current_thread().name, x * 2

    async with open_asyncio_bridge(name="bridge-test") as bridge:
        assert await bridge.run(where, 21) == ("bridge-test", 42)
        assert await bridge.run_sync(lambda: threading.current_thread().name) == "bridge-test"
        assert bridge.statistics().calls_in_flight == 0
    assert not bridge.thread.is_alive()
    assert not bridge.statistics().running


async def test_bridge_reraises_asyncio_errors_in_trio() -> None:
    async def boom() -> None:
        await asyncio.sleep(0)
        raise KeyError("from asyncio")

    async with open_asyncio_bridge() as bridge:
        with pytest.raises(KeyError, match="from asyncio"):
            await bridge.run(boom)


async def test_cancelling_a_call_waits_for_the_asyncio_task_to_finish() -> None:
    events: list[str] = []
    started = ThreadSignal()

    async def slow() -> None:
        try:
            started.set()
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.05)  # cleanup that takes a while
            events.append("asyncio cleanup done")

    async with open_asyncio_bridge() as bridge:
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as nursery:

                async def call() -> None:
                    try:
                        await bridge.run(slow)
                    finally:
                        events.append("trio call returned")

                nursery.start_soon(call)
                await started.event.wait()
                nursery.cancel_scope.cancel()
    assert events == ["asyncio cleanup done", "trio call returned"]


async def test_stream_delivers_items_in_order_then_the_error() -> None:
    async def items(n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i
        raise ValueError("after the items")

    async with open_asyncio_bridge() as bridge:
        received: list[int] = []

        async def drain(stream: BridgeStream[int]) -> None:
            while True:
                received.extend(await stream.receive_batch())

        async with bridge.open_stream(items, 50, max_buffer=4) as stream:
            with pytest.raises(ValueError, match="after the items"):
                await drain(stream)
        assert received == list(range(50))
        assert bridge.statistics().streams_open == 0


async def test_stream_backpressure_stops_the_producer() -> None:
    pulled: list[int] = []
    third = ThreadSignal()

    async def endless() -> AsyncIterator[int]:
        i = 0
        while True:
            pulled.append(i)
            if i == 2:
                third.set()
            yield i
            i += 1

    async with open_asyncio_bridge() as bridge:
        with trio.fail_after(GUARD_S):
            async with bridge.open_stream(endless, max_buffer=3) as stream:
                first = await stream.receive_batch()
                await third.event.wait()
                await trio.sleep(0.05)  # time to overrun, if it could
                # Nothing is given back until the next batch is asked for.
                assert stream.producer_waiting
                assert len(pulled) == 3
                second = await stream.receive_batch()
                assert first + second == list(range(len(first) + len(second)))
        # Leaving the block cancelled the producer and closed its generator.
        assert len(pulled) <= 6


async def test_closed_bridge_refuses_work_and_its_thread_is_gone() -> None:
    async with open_asyncio_bridge() as bridge:
        thread = bridge.thread
        assert thread.is_alive()
    assert not thread.is_alive()
    with pytest.raises(BridgeClosed):
        await bridge.run(asyncio.sleep, 0)


# ---------------------------------------------------------------- stages


async def test_engine_starts_on_the_bridge_thread_and_shuts_down_with_it() -> None:
    fake = FakeAsyncLLM()
    log: list[Any] = []
    async with open_fake(fake, Role.DECODE, factory_log=log) as engine:
        assert engine.is_ready()
        assert (engine.model, engine.role, engine.capabilities) == (
            "fake-model",
            Role.DECODE,
            ("vllm",),
        )
        thread = engine._bridge.thread
    ((cli_args, factory_thread),) = log
    assert factory_thread == "vllm-decode"
    assert cli_args[:2] == ["--model", "fake-model"]
    assert fake.shutdown_on == "vllm-decode"
    assert not thread.is_alive()


async def test_prefill_asks_for_remote_decode_and_returns_the_kv_params() -> None:
    fake = FakeAsyncLLM()
    async with open_fake(fake, Role.PREFILL, factory_log=[]) as engine:
        result = await engine.prefill(
            PrefillRequest(
                "p1",
                Prompt(token_ids=(5, 6, 7)),
                sampling=SamplingParams(max_tokens=64, min_tokens=3, stop=("x",), logprobs=2),
                ec_transfer_params={"mm-e1": {"item_indices": [0]}},
            )
        )
    (call,) = fake.calls
    assert call["prompt"] == {"prompt_token_ids": [5, 6, 7]}
    kwargs = call["kwargs"]
    assert (kwargs["max_tokens"], kwargs["min_tokens"], kwargs["stop"], kwargs["logprobs"]) == (
        1,
        0,
        [],
        None,
    )
    assert kwargs["output_kind"] == "final_only"
    assert kwargs["extra_args"] == {
        "kv_transfer_params": dict(REMOTE_DECODE_PARAMS),
        "ec_transfer_params": {"mm-e1": {"item_indices": [0]}},
    }
    assert result.request_id == "p1"
    assert result.prompt_tokens == 3
    assert result.kv_transfer_params == {
        "do_remote_prefill": True,
        "remote_block_ids": [[1, 2]],
        "remote_engine_id": "fake-engine",
        "remote_request_id": "p1-0f1e",
    }
    assert set(result.timings) == {"prefill_s", "total_s"}
    assert fake.aborts == []
    assert engine.statistics().in_flight == 0


async def test_encode_runs_each_distinct_item_once_as_a_one_token_chat() -> None:
    fake = FakeAsyncLLM()
    red, blue = image(b"red"), image(b"blue")
    async with open_fake(fake, Role.ENCODE, factory_log=[]) as engine:
        result = await engine.encode(EncodeRequest("e1", (red, blue, red)))
    assert [c["request_id"] for c in fake.calls] == ["e1:0", "e1:1"]
    for call, item in zip(fake.calls, (red, blue), strict=True):
        assert call["prompt"] == {
            "prompt": "user: <image>\nassistant:",
            "multi_modal_data": {"image": [fake_decode(item)]},
        }
        assert call["kwargs"]["max_tokens"] == 1
        assert call["tokenization_kwargs"] == {"add_special_tokens": False}
    assert fake.tokenizer.conversations[0] == [{"role": "user", "content": [{"type": "image"}]}]
    assert result.ec_transfer_params == {
        "mm-e1:0": {"item_indices": [0]},
        "mm-e1:1": {"item_indices": [0]},
    }


async def test_logprob_alternatives_come_with_each_token_s_text() -> None:
    """``top_logprobs`` asks for alternatives: each token's text and its first k candidates."""
    fake = FakeAsyncLLM()
    async with open_fake(fake, Role.PD, factory_log=[]) as engine:
        deltas = await collect(
            engine,
            GenerateRequest(
                "g1",
                Prompt(token_ids=(5, 6)),
                sampling=SamplingParams(max_tokens=3, temperature=0.0, logprobs=2),
            ),
        )
    tokens = [t for d in deltas for t in d.tokens or ()]
    assert tokens == ["t0 ", "t1 ", "t2 "]
    top = [alternatives for d in deltas for alternatives in d.top_logprobs or ()]
    assert [[c.token for c in alternatives] for alternatives in top] == [
        ["t0 ", "alt0"],
        ["t1 ", "alt0"],
        ["t2 ", "alt0"],
    ]
    assert top[0][1].logprob == pytest.approx(-1.1)


async def test_decode_streams_deltas_with_usage_and_logprobs() -> None:
    fake = FakeAsyncLLM(delay=0.001)
    kv = {"remote_request_id": "p1-0f1e", "remote_block_ids": [[1, 2]]}
    async with open_fake(fake, Role.DECODE, factory_log=[]) as engine:
        deltas = await collect(
            engine,
            GenerateRequest(
                "d1",
                Prompt(token_ids=(5, 6, 7, 8)),
                sampling=SamplingParams(max_tokens=6, temperature=0.0, logprobs=0),
                kv_transfer_params=kv,
            ),
        )
    (call,) = fake.calls
    assert call["kwargs"]["extra_args"] == {"kv_transfer_params": kv}
    assert call["kwargs"]["output_kind"] == "delta"
    assert call["kwargs"]["max_tokens"] == 6
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == [100, 101, 102, 103, 104, 105]
    assert "".join(d.text for d in deltas) == "t0 t1 t2 t3 t4 t5 "
    assert [lp for d in deltas for lp in d.logprobs or ()] == pytest.approx(
        [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6]
    )
    final = deltas[-1]
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert final.finish_reason == "length"
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (4, 6)
    assert final.timings is not None
    assert set(final.timings) == {"ttft_s", "decode_s", "total_s"}
    assert fake.aborts == []


async def test_pd_renders_chat_messages_with_media_where_the_client_put_them() -> None:
    fake = FakeAsyncLLM()
    cat, dog = image(b"cat"), image(b"dog")
    messages = (
        ChatMessage("system", ("Be brief.",)),
        ChatMessage("user", ("Compare ", 1, " and ", 0, ".")),
    )
    async with open_fake(fake, Role.PD, factory_log=[]) as engine:
        deltas = await collect(
            engine,
            GenerateRequest(
                "pd1",
                Prompt(messages=messages),
                media=(cat, dog),
                sampling=SamplingParams(max_tokens=2),
                ec_transfer_params={"mm-x": {}},
            ),
        )
    (call,) = fake.calls
    assert call["prompt"] == {
        "prompt": "system: Be brief.\nuser: Compare <image> and <image>.\nassistant:",
        "multi_modal_data": {"image": [fake_decode(dog), fake_decode(cat)]},
    }
    assert call["kwargs"]["extra_args"] == {"ec_transfer_params": {"mm-x": {}}}
    assert fake.tokenizer.conversations[0][0] == {"role": "system", "content": "Be brief."}
    assert deltas[-1].finish_reason == "length"


# ---------------------------------------------------------------- cancellation and backpressure


@pytest.mark.parametrize("self_abort", [True, False], ids=["vllm-aborts-too", "adapter-aborts"])
async def test_cancelled_generate_aborts_in_vllm_before_returning(self_abort: bool) -> None:
    fake = FakeAsyncLLM(delay=0.002, self_abort=self_abort)
    async with open_fake(fake, Role.DECODE, factory_log=[]) as engine:
        first = trio.Event()
        request = GenerateRequest(
            "g1", Prompt(text="hello"), sampling=SamplingParams(max_tokens=10_000)
        )

        async def emit(delta: Delta) -> None:
            first.set()

        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.generate, request, emit)
                await first.wait()
                nursery.cancel_scope.cancel()
        # The Trio call has returned: vLLM was told, and the generator is gone.
        assert "g1" in fake.aborts
        assert "g1" not in fake.running
        assert engine.statistics().in_flight == 0
        assert fake.yielded["g1"] < 10_000


async def test_a_slow_consumer_makes_the_asyncio_producer_wait() -> None:
    three = ThreadSignal()
    fake = FakeAsyncLLM(signal_after=(3, three))
    async with open_fake(fake, Role.DECODE, stream_buffer=3, factory_log=[]) as engine:
        go = trio.Event()
        deltas: list[Delta] = []

        async def emit(delta: Delta) -> None:
            deltas.append(delta)
            await go.wait()

        request = GenerateRequest(
            "slow", Prompt(text="hi"), sampling=SamplingParams(max_tokens=200)
        )
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.generate, request, emit)
                await three.event.wait()
                await trio.sleep(0.05)  # time to overrun, if it could
                # Three outputs taken (the buffer), none more while emit waits.
                assert fake.yielded["slow"] == 3
                assert len(deltas) == 1
                go.set()
    assert sum(len(d.token_ids) for d in deltas) == 200
    assert deltas[-1].usage is not None
    assert deltas[-1].usage.completion_tokens == 200
    assert len(deltas) <= 200


async def test_abort_through_the_worker_runtime_is_answered_after_vllm_aborted() -> None:
    fake = FakeAsyncLLM(delay=0.002)
    async with open_fake(fake, Role.DECODE, factory_log=[]) as engine:
        server = WorkerServer(engine, WorkerConfig(worker_id="v1", auth_token=None))
        client_stream, server_stream = trio.testing.memory_stream_pair()
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(server.handle_stream, server_stream)
                client = FramedStream(client_stream, peer="test")
                await client.send(Hello(PROTOCOL_VERSION, "", "tester"))
                assert isinstance(await client.receive(), Welcome)
                await client.send(
                    GenerateRequest(
                        "w1", Prompt(text="x"), sampling=SamplingParams(max_tokens=5000)
                    )
                )
                assert isinstance(await client.receive(), Delta)
                await client.send(Abort("w1"))
                while not isinstance(message := await client.receive(), Aborted):
                    assert isinstance(message, Delta)
                assert "w1" in fake.aborts
                assert "w1" not in fake.running
                await client.aclose()


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("error", "code", "retryable"),
    [
        (FakeClientError("prompt too long"), ErrorCode.INVALID_REQUEST, False),
        (ValueError("bad value"), ErrorCode.INVALID_REQUEST, False),
        (FakeQueueFull("queue full"), ErrorCode.OVERLOADED, True),
        (RuntimeError("scheduler hiccup"), ErrorCode.ENGINE_ERROR, True),
    ],
    ids=["client-error", "value-error", "overloaded", "other"],
)
async def test_vllm_errors_become_engine_errors(
    error: Exception, code: str, retryable: bool
) -> None:
    fake = FakeAsyncLLM(fail_with=error)
    async with open_fake(fake, Role.PD, factory_log=[]) as engine:
        with pytest.raises(EngineError) as caught:
            await collect(engine, GenerateRequest("x", Prompt(text="hi")))
        assert (caught.value.code, caught.value.retryable) == (code, retryable)
        assert engine.is_ready()


async def test_engine_dead_error_crashes_the_engine() -> None:
    fake = FakeAsyncLLM(fail_with=FakeDeadError("core died"))
    async with open_fake(fake, Role.PREFILL, factory_log=[]) as engine:
        with pytest.raises(EngineCrashed):
            await engine.prefill(PrefillRequest("p", Prompt(text="hi")))
        assert not engine.is_ready()
        with pytest.raises(EngineCrashed):
            await engine.prefill(PrefillRequest("p2", Prompt(text="hi")))


async def test_a_request_vllm_aborted_is_a_retryable_engine_error() -> None:
    fake = FakeAsyncLLM(finish_reason="abort")
    async with open_fake(fake, Role.DECODE, factory_log=[]) as engine:
        with pytest.raises(EngineError) as caught:
            await collect(
                engine,
                GenerateRequest("a", Prompt(text="hi"), sampling=SamplingParams(max_tokens=3)),
            )
    assert caught.value.code == ErrorCode.ENGINE_ERROR
    assert caught.value.retryable


async def test_stages_of_other_roles_are_refused() -> None:
    async with open_fake(FakeAsyncLLM(), Role.DECODE, factory_log=[]) as engine:
        with pytest.raises(EngineError) as caught:
            await engine.encode(EncodeRequest("e", (image(b"x"),)))
        assert caught.value.code == ErrorCode.UNSUPPORTED_STAGE


async def test_release_of_a_finished_prefill_answers_false() -> None:
    fake = FakeAsyncLLM()
    async with open_fake(fake, Role.PREFILL, factory_log=[]) as engine:
        result = await engine.prefill(PrefillRequest("p", Prompt(text="hi")))
        assert result.kv_transfer_params is not None
        assert await engine.release(result.kv_transfer_params) is False
        await engine.abort("p")  # nothing held: no vLLM call
    assert fake.aborts == []


async def test_factory_failure_is_a_config_error_and_stops_the_bridge() -> None:
    threads: list[threading.Thread] = []

    def factory(cli_args: list[str]) -> VllmApi:
        threads.append(threading.current_thread())
        raise OSError("no such model directory")

    with pytest.raises(ConfigError, match="no such model directory"):
        async with open_vllm_engine(Role.PD, "missing", api_factory=factory):
            pass  # pragma: no cover
    assert threads
    assert not threads[0].is_alive()


# ---------------------------------------------------------------- prompts and sampling


def test_render_prompt_passes_token_ids_and_text_through() -> None:
    assert render_prompt(Prompt(token_ids=(1, 2)), (), tokenizer=None).prompt == {
        "prompt_token_ids": [1, 2]
    }
    rendered = render_prompt(
        Prompt(text="<image> hi"), (image(b"a"),), tokenizer=None, decode_media=fake_decode
    )
    assert rendered.prompt == {
        "prompt": "<image> hi",
        "multi_modal_data": {"image": [fake_decode(image(b"a"))]},
    }
    assert rendered.tokenization_kwargs is None


def test_render_prompt_decodes_each_item_once() -> None:
    decoded: list[str] = []

    def counting(item: MediaItem) -> object:
        decoded.append(item.content_hash)
        return item.content_hash

    same = image(b"same")
    messages = (ChatMessage("user", (0, 1, "twice")),)
    rendered = render_prompt(
        Prompt(messages=messages), (same, same), tokenizer=FakeTokenizer(), decode_media=counting
    )
    assert decoded == [same.content_hash]
    assert rendered.prompt["multi_modal_data"] == {"image": [same.content_hash] * 2}


@pytest.mark.parametrize(
    ("parts", "media", "tokenizer", "code"),
    [
        (("look", 3), 1, FakeTokenizer(), ErrorCode.INVALID_REQUEST),
        (("no media part",), 1, FakeTokenizer(), ErrorCode.INVALID_REQUEST),
        (("hi",), 0, FakeTokenizer(chat_template=None), ErrorCode.ENGINE_ERROR),
        (("hi",), 0, None, ErrorCode.ENGINE_ERROR),
    ],
    ids=["index-out-of-range", "unreferenced-media", "no-template", "no-tokenizer"],
)
def test_render_prompt_refusals(
    parts: tuple[Any, ...], media: int, tokenizer: Any, code: str
) -> None:
    items = tuple(image(bytes([i])) for i in range(media))
    with pytest.raises(EngineError) as caught:
        render_prompt(
            Prompt(messages=(ChatMessage("user", parts),)),
            items,
            tokenizer=tokenizer,
            decode_media=fake_decode,
        )
    assert caught.value.code == code


def test_an_explicit_chat_template_replaces_a_missing_one() -> None:
    tokenizer = FakeTokenizer(chat_template=None)
    rendered = render_prompt(
        Prompt(messages=(ChatMessage("user", ("hi",)),)), (), tokenizer=tokenizer, chat_template="t"
    )
    assert rendered.prompt == {"prompt": "user: hi\nassistant:"}
    assert rendered.tokenization_kwargs == {"add_special_tokens": False}


def test_sampling_kwargs_map_every_field() -> None:
    sampling = SamplingParams(
        max_tokens=9,
        temperature=0.5,
        top_p=0.9,
        top_k=4,
        stop=("\n",),
        seed=7,
        min_tokens=2,
        logprobs=1,
    )
    assert sampling_kwargs(sampling, output_kind="delta") == {
        "max_tokens": 9,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 4,
        "seed": 7,
        "min_tokens": 2,
        "stop": ["\n"],
        "logprobs": 1,
        "output_kind": "delta",
    }


# ---------------------------------------------------------------- engine arguments per role

EC_EXTRA = {"shared_storage_path": "ec_store"}
KV_EXTRA = {"backends": ["UCX"]}
FULL = VllmOptions(
    ec_connector="ECExampleConnector",
    ec_connector_extra=EC_EXTRA,
    kv_connector="NixlConnector",
    kv_connector_extra=KV_EXTRA,
)
EC_PRODUCER = {
    "ec_connector": "ECExampleConnector",
    "ec_role": "ec_producer",
    "ec_connector_extra_config": EC_EXTRA,
}
EC_CONSUMER = {**EC_PRODUCER, "ec_role": "ec_consumer"}
KV_PRODUCER = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_producer",
    "kv_connector_extra_config": KV_EXTRA,
}
KV_CONSUMER = {**KV_PRODUCER, "kv_role": "kv_consumer"}


@pytest.mark.parametrize(
    ("role", "options", "expected"),
    [
        (
            Role.ENCODE,
            VllmOptions(ec_connector="ECExampleConnector", ec_connector_extra=EC_EXTRA),
            {
                "ec_transfer_config": EC_PRODUCER,
                "mm_encoder_only": True,
                "enable_prefix_caching": False,
            },
        ),
        (
            Role.PREFILL,
            FULL,
            {"ec_transfer_config": EC_CONSUMER, "kv_transfer_config": KV_PRODUCER},
        ),
        (
            Role.PREFILL,
            VllmOptions(kv_connector="NixlConnector", kv_connector_extra=KV_EXTRA),
            {"kv_transfer_config": KV_PRODUCER},
        ),
        (
            Role.DECODE,
            VllmOptions(kv_connector="NixlConnector", kv_connector_extra=KV_EXTRA),
            {"kv_transfer_config": KV_CONSUMER},
        ),
        (
            Role.PD,
            VllmOptions(ec_connector="ECExampleConnector", ec_connector_extra=EC_EXTRA),
            {"ec_transfer_config": EC_CONSUMER},
        ),
        (Role.PD, VllmOptions(), {}),
        (
            Role.DECODE,
            VllmOptions(
                kv_connector="NixlConnector",
                kv_transfer_fields={"kv_role": "kv_both", "kv_buffer_device": "cpu"},
            ),
            {
                "kv_transfer_config": {
                    "kv_connector": "NixlConnector",
                    "kv_role": "kv_both",
                    "kv_buffer_device": "cpu",
                }
            },
        ),
    ],
    ids=["E", "P", "P-text-only", "D", "PD", "PD-encodes-itself", "D-nixl-cpu-kv-both"],
)
def test_engine_args_for_role(role: Role, options: VllmOptions, expected: dict[str, Any]) -> None:
    assert engine_args_for_role(role, "m", options) == {"model": "m", **expected}


@pytest.mark.parametrize(
    ("role", "options", "message"),
    [
        (Role.ENCODE, VllmOptions(), "needs --ec-connector"),
        (Role.ENCODE, FULL, "drop --kv-connector"),
        (Role.PREFILL, VllmOptions(ec_connector="X"), "needs --kv-connector"),
        (Role.DECODE, VllmOptions(), "needs --kv-connector"),
        (Role.DECODE, FULL, "drop --ec-connector"),
        (Role.PD, VllmOptions(kv_connector="X"), "drop --kv-connector"),
        (Role.PD, VllmOptions(ec_connector_extra={}), "--ec-connector-extra needs --ec-connector"),
        (
            Role.DECODE,
            VllmOptions(kv_connector="X", kv_transfer_fields={"kv_connector": "Y"}),
            "may not set kv_connector",
        ),
    ],
    ids=[
        "E-without-ec",
        "E-with-kv",
        "P-without-kv",
        "D-without-kv",
        "D-with-ec",
        "PD-with-kv",
        "extra-without-connector",
        "fields-clash",
    ],
)
def test_engine_args_for_role_refusals(role: Role, options: VllmOptions, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        engine_args_for_role(role, "m", options)


def test_engine_cli_args_render_the_role_then_pass_the_rest_through() -> None:
    options = VllmOptions(
        ec_connector="ECExampleConnector",
        ec_connector_extra=EC_EXTRA,
        engine_args=("--dtype", "float32", "--enforce-eager", "--max-model-len", "512"),
    )
    argv = engine_cli_args(Role.ENCODE, "tiny", options)
    assert argv == [
        "--model",
        "tiny",
        "--ec-transfer-config",
        json.dumps(EC_PRODUCER, separators=(",", ":")),
        "--mm-encoder-only",
        "--no-enable-prefix-caching",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "512",
    ]


PREFILL_OPTIONS = VllmOptions(ec_connector="E", kv_connector="K")
ENCODE_OPTIONS = VllmOptions(ec_connector="E")


@pytest.mark.parametrize(
    ("role", "options", "tokens"),
    [
        (Role.PREFILL, PREFILL_OPTIONS, ("--model", "x")),
        (Role.PREFILL, PREFILL_OPTIONS, ("--kv_transfer_config", "{}")),
        (Role.PREFILL, PREFILL_OPTIONS, ("--kv-transfer-config.kv_role=kv_both",)),
        (Role.ENCODE, ENCODE_OPTIONS, ("--enable-prefix-caching",)),
    ],
    ids=["model", "underscore-spelling", "dotted-field", "prefix-caching-on-E"],
)
def test_engine_cli_args_refuse_what_the_role_sets(
    role: Role, options: VllmOptions, tokens: tuple[str, ...]
) -> None:
    with pytest.raises(ConfigError, match="is set by the worker"):
        engine_cli_args(role, "m", dataclasses.replace(options, engine_args=tokens))


def test_vllm_options_from_the_command_line(tmp_path: Path) -> None:
    import argparse

    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages }}", encoding="utf-8")
    parser = argparse.ArgumentParser()
    add_vllm_arguments(parser)
    ns = parser.parse_args(
        [
            "--kv-connector",
            "NixlConnector",
            "--kv-transfer-fields",
            '{"kv_buffer_device": "cpu"}',
            "--chat-template",
            str(template),
            "--",
            "--dtype",
            "float32",
        ]
    )
    options = vllm_options_from_args(ns)
    assert options == VllmOptions(
        kv_connector="NixlConnector",
        kv_transfer_fields={"kv_buffer_device": "cpu"},
        chat_template="{{ messages }}",
        engine_args=("--dtype", "float32"),
    )
    with pytest.raises(ConfigError, match="--ec-connector-extra: must be a JSON object"):
        vllm_options_from_args(parser.parse_args(["--ec-connector-extra", "[1]"]))


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vLLM is installed in this environment"
)
def test_worker_with_vllm_engine_but_no_vllm_exits_2_with_install_hint() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "epd_actors",
            "worker",
            "--role",
            "decode",
            "--engine",
            "vllm",
            "--model",
            "tiny-model",
            "--kv-connector",
            "NixlConnector",
            "--insecure-no-auth",
            "--",
            "--dtype",
            "float32",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert completed.returncode == 2, completed.stderr
    assert VLLM_MISSING in completed.stderr
    assert "pip install 'epd_actors[vllm]'" in completed.stderr


def test_template_options_reach_the_chat_template_as_vllm_passes_them() -> None:
    """``chat_template_kwargs`` first, the request's own fields over them (vLLM 0.32's order)."""
    from epd_actors.worker.engines.vllm_io import render_prompt

    seen: list[dict[str, object]] = []

    class Recording:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, conversation: object, **options: object) -> str:
            seen.append(options)
            return "rendered"

    prompt = Prompt(messages=(ChatMessage("user", ("hi",)),))
    options = {
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template_kwargs": {
            "enable_thinking": False,
            "continue_final_message": False,
            "tokenize": True,
        },
    }
    rendered = render_prompt(prompt, (), tokenizer=Recording(), options=options)
    assert rendered.prompt == {"prompt": "rendered"}
    assert seen == [
        {
            "tokenize": False,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "enable_thinking": False,
        }
    ]
    # Only the kwargs: the fields' defaults still win over them, as in vLLM's server.
    seen.clear()
    only_kwargs = {
        "chat_template_kwargs": {"add_generation_prompt": False, "continue_final_message": True}
    }
    render_prompt(prompt, (), tokenizer=Recording(), options=only_kwargs)
    assert seen == [
        {"tokenize": False, "add_generation_prompt": True, "continue_final_message": False}
    ]

"""The EPD simulator engine: data dependencies, determinism, latency model, faults.

Every async test takes ``autojump_clock`` (pytest-trio only wires a clock the test
asks for itself), and latencies are powers of two so virtual times add up exactly.
"""

from __future__ import annotations

import argparse
import hashlib
import math
from dataclasses import FrozenInstanceError, replace
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio
import trio.testing

from epd_actors.errors import ConfigError, EngineCrashed, EngineError
from epd_actors.protocol import (
    ChatMessage,
    Delta,
    EncodeRequest,
    ErrorCode,
    GenerateRequest,
    MediaItem,
    PrefillRequest,
    Prompt,
    Role,
    SamplingParams,
    StageResult,
)
from epd_actors.simulator.cli import (
    add_sim_arguments,
    option_name,
    sim_args_from_config,
    sim_config_from_args,
    sim_stores_from_args,
)
from epd_actors.simulator.engine import (
    KV_HANDLE_KEY,
    SimConfig,
    SimCounters,
    SimEngine,
    count_prompt_tokens,
    prompt_digest,
    sim_knobs,
)
from epd_actors.simulator.store import (
    DirectoryKVStore,
    MemoryKVStore,
    SimStores,
    create_sim_stores,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

CONFIG = SimConfig(
    encode_item_s=0.25,
    encode_kib_s=0.0,
    prefill_token_s=0.125,
    first_token_s=0.5,
    output_token_s=0.0625,
    media_tokens_per_item=4,
    kv_ttl_s=8.0,
)
PROMPT = Prompt(text="what is in this picture")  # 5 words
IMAGE_DATA = b"\x89PNG fake image bytes"
IMAGE = MediaItem("image/png", IMAGE_DATA, hashlib.sha256(IMAGE_DATA).hexdigest())
PROMPT_TOKENS = 5 + 4  # words + media_tokens_per_item


def engine(
    role: Role, stores: SimStores, config: SimConfig = CONFIG, worker_id: str = ""
) -> SimEngine:
    return SimEngine(
        role,
        worker_id=worker_id or f"{role.value}-0",
        config=config,
        ec_store=stores.ec,
        kv_store=stores.kv,
    )


def sampling(**kw: object) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 4, "temperature": 0.0, **kw})  # type: ignore[arg-type]


async def generate(sim: SimEngine, request: GenerateRequest) -> list[tuple[float, Delta]]:
    """Run a generate; every delta with the virtual time it was emitted."""
    out: list[tuple[float, Delta]] = []

    async def emit(delta: Delta) -> None:
        out.append((trio.current_time(), delta))

    await sim.generate(request, emit)
    return out


def text_of(deltas: list[tuple[float, Delta]]) -> str:
    return "".join(d.text for _, d in deltas)


def ids_of(deltas: list[tuple[float, Delta]]) -> tuple[int, ...]:
    return tuple(i for _, d in deltas for i in d.token_ids)


async def refused(code: ErrorCode, fn: Callable[[], Awaitable[object]]) -> EngineError:
    with pytest.raises(EngineError) as info:
        await fn()
    assert info.value.code == code
    return info.value


@pytest.fixture(params=["memory", "directory"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> SimStores:
    return create_sim_stores(None if request.param == "memory" else tmp_path / "sim")


@pytest.fixture
def memory() -> SimStores:
    return create_sim_stores()


async def prefilled(
    stores: SimStores, request_id: str = "r1", prompt: Prompt = PROMPT
) -> StageResult:
    """E then P for ``prompt`` with IMAGE; returns P's result."""
    await engine(Role.ENCODE, stores).encode(EncodeRequest(request_id, (IMAGE,)))
    return await engine(Role.PREFILL, stores).prefill(PrefillRequest(request_id, prompt, (IMAGE,)))


def decode_request(
    params: dict[str, object] | None, prompt: Prompt = PROMPT, **kw: object
) -> GenerateRequest:
    return GenerateRequest("r1", prompt, (IMAGE,), sampling(**kw), kv_transfer_params=params)


# ---------------------------------------------------------------- the E -> P -> D contract


async def test_encode_prefill_decode_happy_path(
    stores: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    e = engine(Role.ENCODE, stores)
    p = engine(Role.PREFILL, stores)
    d = engine(Role.DECODE, stores)

    encoded = await e.encode(EncodeRequest("r1", (IMAGE, IMAGE)))
    assert trio.current_time() == 0.25  # the duplicate item is encoded once
    assert encoded.ec_transfer_params == {IMAGE.content_hash: {"producer": "encode-0"}}
    assert encoded.timings == {"encode_s": 0.25, "total_s": 0.25}
    entry = stores.ec.get(IMAGE.content_hash)
    assert entry is not None
    assert (entry.producer, entry.modality, entry.num_bytes) == ("encode-0", "image", 21)

    result = await p.prefill(PrefillRequest("r1", PROMPT, (IMAGE,)))
    assert trio.current_time() == 0.25 + PROMPT_TOKENS * 0.125
    assert result.prompt_tokens == PROMPT_TOKENS
    params = result.kv_transfer_params
    assert params is not None
    assert params["producer"] == "prefill-0"
    assert params["prompt_tokens"] == PROMPT_TOKENS
    assert result.timings == {"encode_s": 0.0, "prefill_s": 1.125, "total_s": 1.125}
    assert len(stores.kv) == 1

    start = trio.current_time()
    deltas = await generate(d, decode_request(params))
    assert [t - start for t, _ in deltas] == [0.5, 0.5625, 0.625, 0.6875]
    final = deltas[-1][1]
    assert final.finish_reason == "length"
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (PROMPT_TOKENS, 4)
    assert final.timings == {"ttft_s": 0.5, "decode_s": 0.1875, "total_s": 0.6875}
    assert len(stores.kv) == 0

    assert e.statistics().ec_entries_written == 1
    stats = p.statistics()
    assert (stats.kv_handles_created, stats.kv_handles_outstanding, stats.ec_entries_read) == (
        1,
        0,
        1,
    )
    stats = d.statistics()
    assert (stats.kv_handles_consumed, stats.tokens_generated, stats.in_flight) == (1, 4, 0)


async def test_pd_gives_the_same_output_as_prefill_then_decode(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    params = (await prefilled(memory)).kv_transfer_params
    via_d = await generate(engine(Role.DECODE, memory), decode_request(params, max_tokens=12))
    via_pd = await generate(engine(Role.PD, memory), decode_request(None, max_tokens=12))
    assert text_of(via_d) == text_of(via_pd)
    assert ids_of(via_d) == ids_of(via_pd)
    assert text_of(via_pd).count(" ") == 11  # readable words, space separated


async def test_pd_prefills_itself(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    await engine(Role.ENCODE, memory).encode(EncodeRequest("r1", (IMAGE,)))
    start = trio.current_time()
    deltas = await generate(engine(Role.PD, memory), decode_request(None, max_tokens=2))
    final = deltas[-1][1]
    assert final.usage is not None
    assert final.usage.prompt_tokens == PROMPT_TOKENS
    assert final.timings == {
        "encode_s": 0.0,
        "prefill_s": 1.125,
        "ttft_s": 1.625,
        "decode_s": 0.0625,
        "total_s": 1.6875,
    }
    assert trio.current_time() - start == 1.6875
    assert len(memory.kv) == 0


@pytest.mark.parametrize("role", [Role.PREFILL, Role.PD])
async def test_strict_mode_refuses_a_missing_encoder_entry(
    role: Role, memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    sim = engine(role, memory)
    calls: dict[Role, Callable[[], Awaitable[object]]] = {
        Role.PREFILL: lambda: sim.prefill(PrefillRequest("r1", PROMPT, (IMAGE,))),
        Role.PD: lambda: generate(sim, decode_request(None)),
    }
    error = await refused(ErrorCode.MISSING_ENCODER_CACHE, calls[role])
    assert error.retryable is False
    assert IMAGE.content_hash[:16] in error.detail
    assert trio.current_time() == 0.0
    assert len(memory.kv) == 0
    assert sim.statistics().kv_handles_created == 0


async def test_recompute_mode_runs_the_encoder_on_prefill(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    p = engine(Role.PREFILL, memory, replace(CONFIG, ec_mode="recompute"))
    result = await p.prefill(PrefillRequest("r1", PROMPT, (IMAGE,)))
    assert trio.current_time() == 0.25 + 1.125
    assert result.timings == {"encode_s": 0.25, "prefill_s": 1.125, "total_s": 1.375}
    stats = p.statistics()
    assert (stats.recomputed_items, stats.ec_entries_read) == (1, 0)
    assert memory.ec.get(IMAGE.content_hash) is None  # a consumer does not write the cache
    deltas = await generate(engine(Role.DECODE, memory), decode_request(result.kv_transfer_params))
    assert deltas[-1][1].finish_reason == "length"


async def test_recompute_mode_on_pd(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    pd = engine(Role.PD, memory, replace(CONFIG, ec_mode="recompute"))
    deltas = await generate(pd, decode_request(None, max_tokens=1))
    assert deltas[-1][1].timings == {
        "encode_s": 0.25,
        "prefill_s": 1.125,
        "ttft_s": 1.875,
        "decode_s": 0.0,
        "total_s": 1.875,
    }
    assert pd.statistics().recomputed_items == 1


# ---------------------------------------------------------------- D refuses bad handles


async def test_decode_refuses_an_unknown_handle(
    stores: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    d = engine(Role.DECODE, stores)
    error = await refused(
        ErrorCode.UNKNOWN_KV_HANDLE, lambda: generate(d, decode_request({KV_HANDLE_KEY: "ab12"}))
    )
    assert "unknown" in error.detail
    assert d.statistics().kv_handles_consumed == 0


async def test_decode_refuses_a_consumed_handle(
    stores: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    params = (await prefilled(stores)).kv_transfer_params
    await generate(engine(Role.DECODE, stores), decode_request(params))
    other = engine(Role.DECODE, stores, worker_id="decode-1")
    error = await refused(
        ErrorCode.UNKNOWN_KV_HANDLE, lambda: generate(other, decode_request(params))
    )
    assert "already consumed" in error.detail


async def test_two_decoders_racing_for_one_handle_one_wins(
    stores: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    params = (await prefilled(stores)).kv_transfer_params
    outcomes: list[str] = []

    async def consume(worker_id: str) -> None:
        try:
            await generate(engine(Role.DECODE, stores, worker_id=worker_id), decode_request(params))
        except EngineError as exc:
            outcomes.append(exc.code)
        else:
            outcomes.append("ok")

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(consume, f"decode-{i}")
    assert sorted(outcomes) == ["ok"] + [ErrorCode.UNKNOWN_KV_HANDLE] * 3


async def test_decode_refuses_an_expired_handle_and_the_producer_counts_a_leak(
    stores: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    await engine(Role.ENCODE, stores).encode(EncodeRequest("r1", (IMAGE,)))
    p = engine(Role.PREFILL, stores)
    params = (await p.prefill(PrefillRequest("r1", PROMPT, (IMAGE,)))).kv_transfer_params
    await trio.sleep(CONFIG.kv_ttl_s - 1.125)  # exactly at the deadline
    d = engine(Role.DECODE, stores)
    error = await refused(ErrorCode.UNKNOWN_KV_HANDLE, lambda: generate(d, decode_request(params)))
    assert "expired" in error.detail
    assert len(stores.kv) == 1  # D does not free it; its producer does
    stats = p.statistics()
    assert (stats.kv_handles_leaked, stats.kv_handles_outstanding) == (1, 0)
    assert len(stores.kv) == 0


async def test_a_handle_is_good_until_its_deadline(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    p = engine(Role.PREFILL, memory)
    params = (await p.prefill(PrefillRequest("r1", Prompt(text="hi"), ()))).kv_transfer_params
    await trio.sleep(CONFIG.kv_ttl_s - 0.125 - 0.0625)
    assert p.statistics().kv_handles_outstanding == 1
    request = GenerateRequest("r1", Prompt(text="hi"), kv_transfer_params=params)
    await generate(engine(Role.DECODE, memory), request)
    await trio.sleep(1.0)
    stats = p.statistics()
    assert (stats.kv_handles_leaked, stats.kv_handles_outstanding) == (0, 0)


async def test_expiry_is_swept_by_any_call_of_the_producer(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    p = engine(Role.PREFILL, memory)
    for i in range(3):
        await p.prefill(PrefillRequest(f"r{i}", Prompt(text="hi"), ()))
        await trio.sleep(2.0)
    await trio.sleep(2.625)  # t = 9: the first handle (due at 8) expired, two did not
    assert await p.release({KV_HANDLE_KEY: "0000"}) is False
    assert len(memory.kv) == 2
    await trio.sleep(10.0)
    await p.abort("nobody")
    assert len(memory.kv) == 0
    assert p.statistics().kv_handles_leaked == 3


async def test_decode_refuses_a_handle_prefilled_for_another_prompt(
    stores: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    params = (await prefilled(stores)).kv_transfer_params
    d = engine(Role.DECODE, stores)
    wrong = decode_request(params, prompt=Prompt(text="a different prompt"))
    error = await refused(ErrorCode.UNKNOWN_KV_HANDLE, lambda: generate(d, wrong))
    assert "mismatch" in error.detail
    assert "'r1'" in error.detail
    deltas = await generate(d, decode_request(params))  # the right request still gets it
    assert deltas[-1][1].finish_reason == "length"


async def test_decode_refuses_a_handle_of_the_same_text_with_other_media(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    params = (await prefilled(memory)).kv_transfer_params
    other = MediaItem("image/png", b"other", hashlib.sha256(b"other").hexdigest())
    request = GenerateRequest("r1", PROMPT, (other,), sampling(), kv_transfer_params=params)
    error = await refused(
        ErrorCode.UNKNOWN_KV_HANDLE, lambda: generate(engine(Role.DECODE, memory), request)
    )
    assert "mismatch" in error.detail


@pytest.mark.parametrize(
    "params",
    [None, {}, {KV_HANDLE_KEY: 7}, {KV_HANDLE_KEY: "../../etc/passwd"}, {KV_HANDLE_KEY: ""}],
    ids=["missing", "no-handle", "not-a-string", "traversal", "empty"],
)
async def test_decode_rejects_malformed_transfer_params(
    params: dict[str, object] | None, stores: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    d = engine(Role.DECODE, stores)
    await refused(ErrorCode.INVALID_REQUEST, lambda: generate(d, decode_request(params)))


# ---------------------------------------------------------------- roles


@pytest.mark.parametrize(
    ("role", "stage"),
    [
        (Role.ENCODE, "prefill"),
        (Role.ENCODE, "generate"),
        (Role.PREFILL, "encode"),
        (Role.PREFILL, "generate"),
        (Role.DECODE, "encode"),
        (Role.DECODE, "prefill"),
        (Role.PD, "encode"),
        (Role.PD, "prefill"),
    ],
    ids=lambda x: str(x),
)
async def test_a_stage_the_role_does_not_serve_is_unsupported(
    role: Role, stage: str, memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    sim = engine(role, memory)
    calls: dict[str, Callable[[], Awaitable[object]]] = {
        "encode": lambda: sim.encode(EncodeRequest("r1", (IMAGE,))),
        "prefill": lambda: sim.prefill(PrefillRequest("r1", PROMPT)),
        "generate": lambda: generate(sim, decode_request(None)),
    }
    await refused(ErrorCode.UNSUPPORTED_STAGE, calls[stage])
    assert sim.statistics() == engine(role, memory).statistics()  # nothing counted


@pytest.mark.parametrize(
    "content_hash", ["../x", "a/b", "ABC", ".hidden", "a" * 129], ids=lambda h: h[:10]
)
async def test_unsafe_content_hashes_are_invalid(
    content_hash: str, stores: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    item = MediaItem("image/png", b"x", content_hash)
    e = engine(Role.ENCODE, stores)
    await refused(ErrorCode.INVALID_REQUEST, lambda: e.encode(EncodeRequest("r1", (item,))))
    assert len(stores.ec) == 0


async def test_verify_media_hash_refuses_a_wrong_hash(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    e = engine(Role.ENCODE, memory, replace(CONFIG, verify_media_hash=True))
    await e.encode(EncodeRequest("r1", (IMAGE,)))
    lying = MediaItem("image/png", b"not the image", IMAGE.content_hash)
    error = await refused(
        ErrorCode.INVALID_REQUEST, lambda: e.encode(EncodeRequest("r2", (lying,)))
    )
    assert "sha256" in error.detail


async def test_chat_part_naming_missing_media_is_invalid(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    prompt = Prompt(messages=(ChatMessage("user", ("look", 1)),))
    p = engine(Role.PREFILL, memory)
    await refused(
        ErrorCode.INVALID_REQUEST, lambda: p.prefill(PrefillRequest("r1", prompt, (IMAGE,)))
    )


# ---------------------------------------------------------------- release and abort


async def test_release_frees_a_handle_once(
    stores: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    p = engine(Role.PREFILL, stores)
    params = (await p.prefill(PrefillRequest("r1", Prompt(text="hi")))).kv_transfer_params
    assert params is not None
    assert await p.release(params) is True
    assert await p.release(params) is False
    stats = p.statistics()
    assert (stats.releases_found, stats.releases_not_found, stats.kv_handles_released) == (1, 1, 1)
    assert stats.kv_handles_outstanding == 0
    request = GenerateRequest("r1", Prompt(text="hi"), kv_transfer_params=params)
    await refused(
        ErrorCode.UNKNOWN_KV_HANDLE, lambda: generate(engine(Role.DECODE, stores), request)
    )


async def test_release_of_malformed_params_is_invalid(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    p = engine(Role.PREFILL, memory)
    await refused(ErrorCode.INVALID_REQUEST, lambda: p.release({"handle": "x"}))


async def test_release_completes_inside_a_cancelled_scope(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    p = engine(Role.PREFILL, memory)
    params = (await p.prefill(PrefillRequest("r1", Prompt(text="hi")))).kv_transfer_params
    assert params is not None
    with trio.CancelScope() as scope:
        scope.cancel()
        found = await p.release(params)
        await p.abort("r1")
    assert found is True
    assert p.statistics().aborts == 1


# Virtual times at which the prefill below is cancelled: before anything ran (at the
# admission checkpoint), during the injected stall (0-1), during the recomputed encoder
# (1-2), and during the prefill time (2-3), when the handle already exists.
CANCEL_POINTS = {"admission": 0.0, "stall": 0.5, "recompute": 1.5, "prefill": 2.5}


@pytest.mark.parametrize("when", CANCEL_POINTS.values(), ids=CANCEL_POINTS.keys())
async def test_abort_frees_what_a_cancelled_prefill_left(
    when: float, stores: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    config = replace(CONFIG, stall_s=1.0, ec_mode="recompute", encode_item_s=1.0)
    p = engine(Role.PREFILL, stores, config)
    prompt = Prompt(text="one two three four")  # 4 words + 4 media tokens = 1 s of prefill
    with trio.move_on_at(when) as scope:
        await p.prefill(PrefillRequest("r1", prompt, (IMAGE,)))
    assert scope.cancelled_caught
    stats = p.statistics()
    holds = 1 if when > 2 else 0
    assert (stats.kv_handles_created, stats.kv_handles_outstanding) == (holds, holds)
    assert stats.in_flight == 0
    assert len(stores.kv) == holds

    await p.abort("r1")
    await p.abort("r1")  # idempotent
    stats = p.statistics()
    assert (stats.aborts, stats.kv_handles_aborted, stats.kv_handles_outstanding) == (2, holds, 0)
    assert len(stores.kv) == 0
    await trio.sleep(config.kv_ttl_s)
    assert p.statistics().kv_handles_leaked == 0


async def test_abort_after_a_finished_prefill_frees_its_handle(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    p = engine(Role.PREFILL, memory)
    params = (await p.prefill(PrefillRequest("r1", Prompt(text="hi")))).kv_transfer_params
    await p.prefill(PrefillRequest("r2", Prompt(text="hi")))
    await p.abort("r1")
    assert len(memory.kv) == 1  # r2's handle is untouched
    request = GenerateRequest("r1", Prompt(text="hi"), kv_transfer_params=params)
    await refused(
        ErrorCode.UNKNOWN_KV_HANDLE, lambda: generate(engine(Role.DECODE, memory), request)
    )


async def test_a_handle_consumed_elsewhere_is_not_outstanding(
    stores: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    p = engine(Role.PREFILL, stores)
    params = (await p.prefill(PrefillRequest("r1", Prompt(text="hi")))).kv_transfer_params
    assert p.statistics().kv_handles_outstanding == 1
    request = GenerateRequest("r1", Prompt(text="hi"), kv_transfer_params=params)
    await generate(engine(Role.DECODE, stores), request)
    assert p.statistics().kv_handles_outstanding == 0
    await p.abort("r1")
    assert p.statistics().kv_handles_aborted == 0


# ---------------------------------------------------------------- output


def test_prompt_tokens_and_digest_are_stable_functions() -> None:
    chat = Prompt(messages=(ChatMessage("user", ("two words", 0, "three more words")),))
    assert count_prompt_tokens(chat, (IMAGE,), 10) == 15
    assert count_prompt_tokens(Prompt(token_ids=(1, 2, 3)), (), 10) == 3
    assert count_prompt_tokens(PROMPT, (), 10) == 5
    assert prompt_digest(PROMPT, ()) == prompt_digest(Prompt(text=PROMPT.text), ())
    assert prompt_digest(PROMPT, ()) != prompt_digest(PROMPT, (IMAGE,))
    assert prompt_digest(Prompt(text="1,2"), ()) != prompt_digest(Prompt(token_ids=(1, 2)), ())
    assert prompt_digest(PROMPT, ()) == "3d7814d9687b78be666871626879ea43"  # not salted


async def pd_run(
    memory: SimStores, prompt: Prompt = PROMPT, **kw: object
) -> list[tuple[float, Delta]]:
    pd = engine(Role.PD, memory, replace(CONFIG, ec_mode="recompute"))
    return await generate(pd, GenerateRequest("r1", prompt, (), sampling(**kw)))


async def test_same_prompt_and_seed_give_the_same_output(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    a = await pd_run(memory, temperature=1.0, seed=7, max_tokens=16)
    b = await pd_run(memory, temperature=1.0, seed=7, max_tokens=16)
    c = await pd_run(memory, temperature=1.0, seed=8, max_tokens=16)
    d = await pd_run(memory, Prompt(text="something else"), temperature=1.0, seed=7, max_tokens=16)
    assert (text_of(a), ids_of(a)) == (text_of(b), ids_of(b))
    assert ids_of(a) != ids_of(c)
    assert ids_of(a) != ids_of(d)
    assert all(0 <= i < 32_000 for i in ids_of(a))


async def test_temperature_zero_ignores_the_seed(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    a = await pd_run(memory, temperature=0.0, seed=1, max_tokens=16)
    b = await pd_run(memory, temperature=0.0, seed=2, max_tokens=16)
    c = await pd_run(memory, temperature=0.0, max_tokens=16)
    assert ids_of(a) == ids_of(b) == ids_of(c)
    assert ids_of(a) != ids_of(await pd_run(memory, temperature=1.0, seed=1, max_tokens=16))


async def test_max_tokens_ends_with_length(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    deltas = await pd_run(memory, max_tokens=7)
    final = deltas[-1][1]
    assert len(ids_of(deltas)) == 7
    assert final.finish_reason == "length"
    assert final.usage is not None
    assert final.usage.completion_tokens == 7
    assert all(d.finish_reason is None for _, d in deltas[:-1])


async def test_a_stop_string_ends_the_text_before_it(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    full = text_of(await pd_run(memory, max_tokens=32))
    words = full.split(" ")
    stop = f"{words[3]} {words[4][:2]}"  # spans a token boundary
    cut = full.index(stop)
    deltas = await pd_run(memory, max_tokens=32, stop=(stop, "never-there"))
    assert text_of(deltas) == full[:cut]
    final = deltas[-1][1]
    assert final.finish_reason == "stop"
    assert final.usage is not None
    assert final.usage.completion_tokens == 5
    assert len(ids_of(deltas)) == 5


async def test_min_tokens_defers_a_stop_string(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    full = await pd_run(memory, max_tokens=8)
    words = text_of(full).split(" ")
    stop = f" {words[1]} {words[2]}"  # completes with token 3
    for min_tokens in (0, 3):
        early = await pd_run(memory, max_tokens=8, min_tokens=min_tokens, stop=(stop,))
        assert (text_of(early), len(ids_of(early))) == (words[0], 3)
        assert early[-1][1].finish_reason == "stop"
    # Like vLLM, a stop string completed before min_tokens is not looked for again.
    late = await pd_run(memory, max_tokens=8, min_tokens=4, stop=(stop,))
    assert (text_of(late), late[-1][1].finish_reason) == (text_of(full), "length")


async def test_streamed_text_never_shows_part_of_a_stop_string(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    full = text_of(await pd_run(memory, max_tokens=32))
    stop = full[-6:] + "zzz"  # a near miss: the held-back tail is released at the end
    deltas = await pd_run(memory, max_tokens=32, stop=(stop,))
    assert text_of(deltas) == full
    assert deltas[-1][1].finish_reason == "length"
    streamed = "".join(d.text for _, d in deltas[:-1])
    assert len(streamed) <= len(full) - (len(stop) - 1)


async def test_logprobs_one_negative_float_per_token(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    deltas = await pd_run(memory, max_tokens=8, logprobs=0)
    values = [lp for _, d in deltas for lp in d.logprobs or ()]
    assert len(values) == 8
    assert all(-4.0 <= v < 0 for v in values)
    again = await pd_run(memory, max_tokens=8, logprobs=2)
    assert values == [lp for _, d in again for lp in d.logprobs or ()]
    assert all(d.logprobs is None for _, d in await pd_run(memory, max_tokens=8))


# ---------------------------------------------------------------- latency model


async def test_unpaced_output_comes_in_chunks_at_one_instant(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    config = replace(CONFIG, output_token_s=0.0, tokens_per_delta=16, ec_mode="recompute")
    pd = engine(Role.PD, config=config, stores=memory)
    deltas = await generate(
        pd, GenerateRequest("r1", Prompt(text="a b"), (), sampling(max_tokens=40))
    )
    assert [len(d.token_ids) for _, d in deltas] == [16, 16, 8]
    assert {t for t, _ in deltas} == {2 * 0.125 + 0.5}


async def test_step_clock_gives_every_stream_its_tokens_on_the_same_ticks(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    config = replace(CONFIG, first_token_s=0.0, step_clock=True, ec_mode="recompute")
    pd = engine(Role.PD, config=config, stores=memory)
    times: dict[str, list[float]] = {}

    async def stream(request_id: str, start: float) -> None:
        await trio.sleep(start)
        request = GenerateRequest(request_id, Prompt(text="a"), (), sampling(max_tokens=3))
        times[request_id] = [t for t, _ in await generate(pd, request)]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream, "early", 0.0)
        nursery.start_soon(stream, "late", 0.25 + 0.03125)  # mid-tick
    prefill = 0.125  # one prompt token
    assert times["early"] == [prefill, 0.1875, 0.25]  # ticks every 0.0625 s
    assert times["late"] == [0.28125 + prefill, 0.4375, 0.5]  # the same clock's ticks
    unpaced = replace(config, output_token_s=0.0, tokens_per_delta=1)
    deltas = await generate(
        engine(Role.PD, config=unpaced, stores=memory),
        GenerateRequest("r", Prompt(text="a"), (), sampling(max_tokens=2)),
    )
    assert [t for t, _ in deltas] == [0.5 + prefill] * 2  # no clock without pacing


async def test_encode_cost_grows_with_media_size(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    e = engine(Role.ENCODE, memory, replace(CONFIG, encode_kib_s=0.125))
    big = MediaItem("image/png", bytes(4096), "b1")
    small = MediaItem("audio/wav", bytes(1024), "b2")
    result = await e.encode(EncodeRequest("r1", (big, small)))
    assert trio.current_time() == (0.25 + 0.5) + (0.25 + 0.125)
    assert result.timings["encode_s"] == 1.125
    assert len(memory.ec) == 2


async def test_default_latencies_are_small_but_nonzero(
    autojump_clock: trio.testing.MockClock,
) -> None:
    defaults = SimConfig()
    assert 0 < defaults.first_token_s <= 0.01
    assert 0 < defaults.output_token_s <= 0.01
    assert 0 < defaults.encode_item_s <= 0.01
    assert 0 < defaults.prefill_token_s <= 0.001
    assert defaults.kv_ttl_s == 30.0


# ---------------------------------------------------------------- faults


@pytest.mark.parametrize("stage", ["encode", "prefill", "generate"])
async def test_an_error_rate_of_one_always_fails_retryably(
    stage: str, memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    params = (await prefilled(memory)).kv_transfer_params
    config = replace(CONFIG, **{f"{stage}_error_rate": 1.0})  # type: ignore[arg-type]
    role = {"encode": Role.ENCODE, "prefill": Role.PREFILL, "generate": Role.DECODE}[stage]
    sim = engine(role, memory, config)
    calls: dict[str, Callable[[], Awaitable[object]]] = {
        "encode": lambda: sim.encode(EncodeRequest("r1", (IMAGE,))),
        "prefill": lambda: sim.prefill(PrefillRequest("r1", PROMPT, (IMAGE,))),
        "generate": lambda: generate(sim, decode_request(params)),
    }
    error = await refused(ErrorCode.ENGINE_ERROR, calls[stage])
    assert error.retryable is True
    assert sim.statistics().errors_injected == 1
    assert len(memory.kv) == 1  # a failed decode did not consume the handle
    await generate(engine(Role.DECODE, memory), decode_request(params))  # the retry works


async def test_error_injection_is_deterministic_per_seed_and_worker(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    async def pattern(worker_id: str, seed: int) -> list[bool]:
        config = replace(CONFIG, encode_error_rate=0.5, fault_seed=seed, encode_item_s=0.0)
        sim = engine(Role.ENCODE, memory, config, worker_id=worker_id)
        failed = []
        for i in range(32):
            try:
                await sim.encode(EncodeRequest(f"r{i}", (IMAGE,)))
            except EngineError:
                failed.append(True)
            else:
                failed.append(False)
        return failed

    first = await pattern("e0", 1)
    assert first == await pattern("e0", 1)
    assert first != await pattern("e0", 2)
    assert first != await pattern("e1", 1)
    assert 4 < sum(first) < 28


async def test_stall_delays_every_stage(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    e = engine(Role.ENCODE, memory, replace(CONFIG, stall_s=3.0))
    result = await e.encode(EncodeRequest("r1", (IMAGE,)))
    assert trio.current_time() == 3.25
    assert result.timings == {"encode_s": 0.25, "total_s": 3.25}


async def test_an_infinite_stall_hangs_until_cancelled(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    e = engine(Role.ENCODE, memory, replace(CONFIG, stall_s=math.inf))
    with trio.move_on_after(3600) as scope:
        await e.encode(EncodeRequest("r1", (IMAGE,)))
    assert scope.cancelled_caught
    assert len(memory.ec) == 0
    assert e.is_ready()


async def test_stall_after_tokens_hangs_mid_stream(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    pd = engine(Role.PD, memory, replace(CONFIG, stall_after_tokens=3, ec_mode="recompute"))
    received: list[Delta] = []

    async def emit(delta: Delta) -> None:
        received.append(delta)

    with trio.move_on_after(3600) as scope:
        await pd.generate(
            GenerateRequest("r1", Prompt(text="hi"), (), sampling(max_tokens=9)), emit
        )
    assert scope.cancelled_caught
    assert sum(len(d.token_ids) for d in received) == 3
    assert all(d.finish_reason is None for d in received)


async def test_stall_after_tokens_flushes_a_partial_chunk_first(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    config = replace(CONFIG, stall_after_tokens=5, output_token_s=0.0, ec_mode="recompute")
    received: list[int] = []

    async def emit(delta: Delta) -> None:
        received.append(len(delta.token_ids))

    with trio.move_on_after(1):
        await engine(Role.PD, memory, config).generate(
            GenerateRequest("r1", Prompt(text="hi"), (), sampling(max_tokens=40)), emit
        )
    assert received == [5]


async def test_crash_after_tokens_kills_the_engine(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    params = (await prefilled(memory)).kv_transfer_params
    d = engine(Role.DECODE, memory, replace(CONFIG, crash_after_tokens=2))
    received: list[Delta] = []

    async def emit(delta: Delta) -> None:
        received.append(delta)

    start = trio.current_time()
    with pytest.raises(EngineCrashed):
        await d.generate(decode_request(params, max_tokens=9), emit)
    assert trio.current_time() - start == 0.5 + 2 * 0.0625
    assert len(received) == 2
    assert not d.is_ready()
    assert d.statistics().crashed
    with pytest.raises(EngineCrashed):
        await generate(d, decode_request(params))
    assert "crashed" in repr(d)


async def test_crash_on_request_and_a_crashed_prefill_loses_its_handles(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    p = engine(Role.PREFILL, memory, replace(CONFIG, crash_on_request=3))
    params = (await p.prefill(PrefillRequest("r1", Prompt(text="hi")))).kv_transfer_params
    await p.prefill(PrefillRequest("r2", Prompt(text="hi")))
    assert p.is_ready()
    with pytest.raises(EngineCrashed):
        await p.prefill(PrefillRequest("r3", Prompt(text="hi")))
    assert not p.is_ready()
    assert len(memory.kv) == 0
    stats = p.statistics()
    assert (stats.kv_handles_lost, stats.kv_handles_outstanding, stats.prefill_requests) == (
        2,
        0,
        3,
    )
    request = GenerateRequest("r1", Prompt(text="hi"), kv_transfer_params=params)
    await refused(
        ErrorCode.UNKNOWN_KV_HANDLE, lambda: generate(engine(Role.DECODE, memory), request)
    )


async def test_a_crash_fails_the_other_requests_in_flight(
    memory: SimStores, autojump_clock: trio.testing.MockClock
) -> None:
    pd = engine(Role.PD, memory, replace(CONFIG, crash_on_request=2, ec_mode="recompute"))
    outcome: list[str] = []

    async def long_stream() -> None:
        try:
            await generate(
                pd, GenerateRequest("r1", Prompt(text="hi"), (), sampling(max_tokens=99))
            )
        except EngineCrashed:
            outcome.append("crashed")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(long_stream)
        await trio.sleep(1.0)
        with pytest.raises(EngineCrashed):
            await generate(pd, GenerateRequest("r2", Prompt(text="hi"), (), sampling()))
    assert outcome == ["crashed"]
    assert pd.statistics().in_flight == 0


# ---------------------------------------------------------------- configuration and stats


@pytest.mark.parametrize(
    ("knob", "value"),
    [
        ("encode_item_s", -1.0),
        ("first_token_s", math.inf),
        ("output_token_s", math.nan),
        ("kv_ttl_s", 0.0),
        ("tokens_per_delta", 0),
        ("ec_mode", "lenient"),
        ("encode_error_rate", 1.5),
        ("crash_on_request", 0),
        ("stall_after_tokens", -1),
        ("verify_media_hash", "yes"),
        ("fault_seed", 1.5),
    ],
    ids=lambda x: str(x),
)
def test_invalid_config_is_refused_naming_the_knob(knob: str, value: object) -> None:
    with pytest.raises(ConfigError, match=knob):
        SimConfig(**{knob: value})  # type: ignore[arg-type]


def test_every_knob_is_documented() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "simulator.md").read_text()
    for knob in sim_knobs():
        assert f"`{knob.name}`" in docs, knob.name
        assert knob.spec.doc


def test_statistics_is_a_frozen_snapshot(memory: SimStores) -> None:
    stats = engine(Role.ENCODE, memory).statistics()
    assert isinstance(stats, SimCounters)
    with pytest.raises(FrozenInstanceError):
        stats.aborts = 3  # type: ignore[misc]
    assert repr(engine(Role.ENCODE, memory)) == "<SimEngine encode-0 role=encode in_flight=0>"


# ---------------------------------------------------------------- command line


def sim_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="worker")
    add_sim_arguments(parser)
    return parser


def test_cli_defaults_are_the_config_defaults() -> None:
    ns = sim_parser().parse_args([])
    assert sim_config_from_args(ns) == SimConfig()
    assert isinstance(sim_stores_from_args(ns).kv, MemoryKVStore)
    assert sim_args_from_config(SimConfig()) == []


def test_cli_has_an_option_for_every_knob() -> None:
    text = sim_parser().format_help()
    for knob in sim_knobs():
        assert option_name(knob.name) in text


def test_cli_round_trip_of_a_changed_config(tmp_path: Path) -> None:
    config = SimConfig(
        encode_item_s=0.5,
        output_token_s=0.0,
        tokens_per_delta=4,
        ec_mode="recompute",
        kv_ttl_s=math.inf,
        verify_media_hash=True,
        prefill_error_rate=0.25,
        stall_s=math.inf,
        crash_after_tokens=0,
        crash_on_request=3,
        fault_seed=-5,
    )
    args = sim_args_from_config(config)
    assert "--sim-verify-media-hash" in args
    ns = sim_parser().parse_args([*args, "--sim-store-dir", str(tmp_path)])
    assert sim_config_from_args(ns) == config
    assert isinstance(sim_stores_from_args(ns).kv, DirectoryKVStore)
    off = SimConfig(verify_media_hash=False)
    assert sim_config_from_args(sim_parser().parse_args(sim_args_from_config(off))) == off


def test_cli_off_turns_an_optional_fault_off() -> None:
    ns = sim_parser().parse_args(
        ["--sim-crash-after-tokens", "5", "--sim-crash-after-tokens", "off"]
    )
    assert sim_config_from_args(ns).crash_after_tokens is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sim-stall-s", "-1"], "--sim-stall-s: must be >= 0"),
        (["--sim-first-token-s", "soon"], "--sim-first-token-s: invalid value 'soon'"),
        (["--sim-first-token-s", "inf"], "--sim-first-token-s: must be finite"),
        (["--sim-encode-error-rate", "2"], "probability in [0, 1]"),
        (["--sim-ec-mode", "lenient"], "must be one of strict, recompute"),
        (["--sim-tokens-per-delta", "0"], "integer >= 1"),
        (["--sim-crash-on-request", "1.5"], "--sim-crash-on-request: invalid value"),
    ],
    ids=lambda x: x[0] if isinstance(x, list) else "",
)
def test_cli_rejects_invalid_values_naming_the_option(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        sim_parser().parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_config_from_a_hand_built_namespace_is_checked() -> None:
    ns = sim_parser().parse_args([])
    ns.sim_kv_ttl_s = -3.0
    with pytest.raises(ConfigError, match="--sim-kv-ttl-s: must be > 0"):
        sim_config_from_args(ns)
    partial = argparse.Namespace(sim_stall_s=2.0)
    assert sim_config_from_args(partial) == SimConfig(stall_s=2.0)


def test_the_python_example_in_the_docs_runs(capsys: pytest.CaptureFixture[str]) -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "simulator.md").read_text()
    example = docs.split("## Using it from Python\n\n```python\n", 1)[1].split("```", 1)[0]
    exec(compile(example, "docs/simulator.md", "exec"), {"__name__": "docs_example"})
    assert len(capsys.readouterr().out.split()) == 16

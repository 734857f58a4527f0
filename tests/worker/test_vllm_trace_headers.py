"""The vLLM engine hands each stage request's ``traceparent`` to vLLM as ``trace_headers``."""

from __future__ import annotations

import pytest

from epd_actors.protocol import (
    EncodeRequest,
    GenerateRequest,
    PrefillRequest,
    Prompt,
    Role,
    SamplingParams,
)
from epd_actors.worker.engines.vllm import vllm_trace_headers
from tests.worker.test_vllm_engine import FakeAsyncLLM, collect, image, open_fake

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_the_mapping_is_the_w3c_header_or_nothing() -> None:
    assert vllm_trace_headers(TRACEPARENT) == {"traceparent": TRACEPARENT}
    assert vllm_trace_headers(None) is None


@pytest.mark.parametrize("traceparent", [TRACEPARENT, None])
async def test_generate_passes_trace_headers_only_when_traced(traceparent: str | None) -> None:
    fake = FakeAsyncLLM()
    async with open_fake(fake, Role.PD, factory_log=[]) as engine:
        await collect(
            engine,
            GenerateRequest(
                "g1",
                Prompt(token_ids=(5, 6)),
                sampling=SamplingParams(max_tokens=2),
                traceparent=traceparent,
            ),
        )
    (call,) = fake.calls
    if traceparent is None:
        assert "trace_headers" not in call  # left out: older engines lack the argument
    else:
        assert call["trace_headers"] == {"traceparent": traceparent}


async def test_prefill_and_encode_pass_trace_headers() -> None:
    prefill_llm, encode_llm = FakeAsyncLLM(), FakeAsyncLLM()
    async with open_fake(prefill_llm, Role.PREFILL, factory_log=[]) as engine:
        await engine.prefill(
            PrefillRequest("p1", Prompt(token_ids=(5, 6)), traceparent=TRACEPARENT)
        )
    async with open_fake(encode_llm, Role.ENCODE, factory_log=[]) as engine:
        await engine.encode(
            EncodeRequest("e1", (image(b"a"), image(b"b")), traceparent=TRACEPARENT)
        )
    calls = [*prefill_llm.calls, *encode_llm.calls]
    assert len(calls) == 3
    assert all(call["trace_headers"] == {"traceparent": TRACEPARENT} for call in calls)

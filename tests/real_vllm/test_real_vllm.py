"""The router in front of real vLLM engines on CPU, with both backends.

Each test proves that the stages really happened, not only that text came
back: golden logprobs from a plain single instance (recorded, or asked of a
plain instance the lane starts), E's encoder-cache entry on disk, the router's
own record of the stages it ran (``x-epd-timings``) and of the encoder calls it
skipped, vLLM's own ``prompt_tokens_by_source_total{source="external_kv_transfer"}``
on D, and vLLM's running gauge and abort counter on D.  The tests share one
fleet per backend and run in file order; the kill -9 test is last because it
takes D away.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

from .cases import CASES, Answer, Case, answer_of, assert_matches, assert_matches_golden
from .fleet import metric_sum, ran_stages
from .matrix import PROFILES, jsonschema_validator, run_matrix

if TYPE_CHECKING:
    from .conftest import Fleet, Plain

pytestmark = pytest.mark.real_vllm

CLIENT_TIMEOUT_S = 120.0
EXTERNAL_KV = 'source="external_kv_transfer"'
RUNNING = "vllm:num_requests_running"
FINISHED_BY_LENGTH = ("vllm:request_success_total", 'finished_reason="length"')
GENERATED = "vllm:generation_tokens_total"
FINISHED = "vllm:request_success_total"
SKIPPED = ("epd_encoder_calls_skipped_total", 'pool="encode"')
# About ten seconds of decoding for the tiny model here: D is surely still running when the
# client hangs up or D is killed, and a finished request would show in the counts.
LONG_TOKENS = 3500


def openai_chat(fleet: Fleet, router: str, case: Case, **extra: Any) -> Any:
    """``case``, as :meth:`Case.body` builds it, through the official ``openai`` client."""
    client = openai.OpenAI(
        base_url=fleet.routers[router].v1,
        api_key="unused",
        max_retries=0,
        timeout=CLIENT_TIMEOUT_S,
    )
    return client.chat.completions.create(**case.body(fleet.model(case.model_kind)), **extra)


def chat(url: str, body: dict[str, Any]) -> tuple[Answer, float]:
    answer, elapsed, _ = chat_with_stages(url, body)
    return answer, elapsed


def chat_with_stages(url: str, body: dict[str, Any]) -> tuple[Answer, float, set[str]]:
    """The answer, its latency and the stages the router says it ran (``x-epd-timings``)."""
    started = time.monotonic()
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT_S)
    elapsed = time.monotonic() - started
    assert response.status_code == 200, response.text
    return answer_of(response.json()), elapsed, ran_stages(response.headers["x-epd-timings"])


def external_kv_tokens(fleet: Fleet, engine: str) -> float:
    url = fleet.engines[engine].metrics_url
    return metric_sum(url, "vllm:prompt_tokens_by_source_total", EXTERNAL_KV)


def has_text(line: str) -> bool:
    """An SSE data line whose chunk carries generated text (not the opening role chunk)."""
    if not line.startswith("data: {"):
        return False
    chunk = json.loads(line.removeprefix("data: "))
    return any((choice.get("delta") or {}).get("content") for choice in chunk.get("choices", []))


def long_stream_body(fleet: Fleet) -> dict[str, Any]:
    body = CASES["qwen-text"].body(fleet.model("qwen2vl"), max_tokens=LONG_TOKENS)
    return body | {"stream": True, "min_tokens": LONG_TOKENS}


def wait_for_metric(url: str, name: str, label: str, want: float, timeout_s: float) -> float:
    """Poll until the metric equals ``want``; returns the seconds it took."""
    started = time.monotonic()
    while True:
        value = metric_sum(url, name, label)
        if value == want:
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"{name}{{{label}}} stayed at {value}, not {want}, for {timeout_s} s")
        time.sleep(0.05)


def test_e_p_d_image_equals_a_plain_instance_and_every_stage_ran(fleet: Fleet) -> None:
    case = CASES["green"]
    before_entries = fleet.ec_entries()
    before_kv = external_kv_tokens(fleet, "d")
    answer, _ = chat(fleet.routers["epd"].url, case.body(fleet.model("qwen2vl")))
    assert_matches_golden(case, answer)
    new_entries = fleet.ec_entries() - before_entries
    assert len(new_entries) == 1, new_entries
    (entry,) = new_entries
    assert (fleet.ec_store / entry / "encoder_cache.safetensors").is_file()
    assert external_kv_tokens(fleet, "d") - before_kv == answer.prompt_tokens


def test_streaming_through_the_openai_client(fleet: Fleet) -> None:
    case = CASES["blue"]
    before_entries = fleet.ec_entries()
    stream = openai_chat(fleet, "epd", case, stream=True, stream_options={"include_usage": True})
    text, logprobs, finish, usage, chunks = "", [], None, None, 0
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs and choice.logprobs.content:
                logprobs += [entry.logprob for entry in choice.logprobs.content]
            finish = choice.finish_reason or finish
    assert usage is not None
    assert chunks >= 2
    answer = Answer(text, logprobs, usage.prompt_tokens, usage.completion_tokens, finish)
    assert finish == "length"
    assert_matches_golden(case, answer)
    assert len(fleet.ec_entries() - before_entries) == 1


def test_text_only_request_skips_the_encoder(fleet: Fleet) -> None:
    case = CASES["qwen-text"]
    before_entries = fleet.ec_entries()
    before_kv = external_kv_tokens(fleet, "d")
    answer, _ = chat(fleet.routers["epd"].url, case.body(fleet.model("qwen2vl")))
    assert_matches_golden(case, answer)
    assert fleet.ec_entries() == before_entries
    assert external_kv_tokens(fleet, "d") - before_kv == answer.prompt_tokens


def test_e_pd_image_equals_a_plain_instance(fleet: Fleet) -> None:
    case = CASES["red"]
    before_entries = fleet.ec_entries()
    completion = openai_chat(fleet, "e_pd", case)
    answer = answer_of(completion.model_dump())
    assert_matches_golden(case, answer)
    assert answer.finish_reason == "length"
    assert len(fleet.ec_entries() - before_entries) == 1


def test_p_d_text_model_equals_a_plain_instance(fleet: Fleet) -> None:
    case = CASES["llama-text"]
    before_kv = external_kv_tokens(fleet, "td")
    answer, _ = chat(fleet.routers["text"].url, case.body(fleet.model("llama")))
    assert_matches_golden(case, answer)
    assert external_kv_tokens(fleet, "td") - before_kv == answer.prompt_tokens


def test_e_p_d_video_equals_a_plain_instance_and_every_stage_ran(
    fleet: Fleet, plain: Plain
) -> None:
    case = CASES["video-cyan"]
    expected = plain.answer(case)
    before_entries = fleet.ec_entries()
    before_kv = external_kv_tokens(fleet, "d")
    answer, _, stages = chat_with_stages(
        fleet.routers["epd"].url, case.body(fleet.model("qwen2vl"))
    )
    assert_matches(case, answer, expected.to_json())
    assert {"encode", "prefill", "decode"} <= stages, stages
    new_entries = fleet.ec_entries() - before_entries
    assert len(new_entries) == 1, new_entries
    (entry,) = new_entries
    assert (fleet.ec_store / entry / "encoder_cache.safetensors").is_file()
    assert external_kv_tokens(fleet, "d") - before_kv == answer.prompt_tokens


def test_e_pd_video_equals_a_plain_instance(fleet: Fleet, plain: Plain) -> None:
    case = CASES["video-orange"]
    expected = plain.answer(case)
    before_entries = fleet.ec_entries()
    answer, _, stages = chat_with_stages(
        fleet.routers["e_pd"].url, case.body(fleet.model("qwen2vl"))
    )
    assert_matches(case, answer, expected.to_json())
    assert {"encode", "pd"} <= stages, stages
    assert len(fleet.ec_entries() - before_entries) == 1


def test_e_pd_audio_equals_a_plain_instance(fleet: Fleet, plain: Plain) -> None:
    """Qwen2-Audio: E (encoder only) wrote the clip's encoder output; PD read it."""
    case = CASES["audio-a4"]
    expected = plain.answer(case)
    before_entries = fleet.ec_entries()
    answer, _, stages = chat_with_stages(
        fleet.routers["audio"].url, case.body(fleet.model("qwen2audio"))
    )
    assert_matches(case, answer, expected.to_json())
    assert {"encode", "pd"} <= stages, stages
    new_entries = fleet.ec_entries() - before_entries
    assert len(new_entries) == 1, new_entries
    (entry,) = new_entries
    assert (fleet.ec_store / entry / "encoder_cache.safetensors").is_file()


def test_a_repeated_image_skips_e_with_encoder_reuse(fleet: Fleet, plain: Plain) -> None:
    """``reuse = "ttl"``: the second request with the same image runs no encode stage (the
    router says so, counts the skipped call, and E finished no request), and D's answer still
    equals a plain instance's: P read the entry E wrote for the first request."""
    case = CASES["reuse-yellow"]
    expected = plain.answer(case).to_json()
    router = fleet.routers["epd_reuse"]
    router_metrics = f"{router.url}/metrics"
    e_metrics = fleet.engines["e"].metrics_url
    body = case.body(fleet.model("qwen2vl"))
    before_entries = fleet.ec_entries()
    skipped_before = metric_sum(router_metrics, *SKIPPED)
    e_before = metric_sum(e_metrics, FINISHED)

    first, _, first_stages = chat_with_stages(router.url, body)
    assert_matches(case, first, expected)
    assert "encode" in first_stages, first_stages
    assert len(fleet.ec_entries() - before_entries) == 1
    assert metric_sum(router_metrics, *SKIPPED) == skipped_before
    e_after_first = metric_sum(e_metrics, FINISHED)

    before_kv = external_kv_tokens(fleet, "d")
    second, _, second_stages = chat_with_stages(router.url, body)
    assert_matches(case, second, expected)
    assert "encode" not in second_stages, second_stages
    assert {"prefill", "decode"} <= second_stages, second_stages
    assert metric_sum(router_metrics, *SKIPPED) - skipped_before == 1
    assert metric_sum(e_metrics, FINISHED) == e_after_first
    assert external_kv_tokens(fleet, "d") - before_kv == second.prompt_tokens
    fleet.report["reuse_e_requests_finished"] = {
        "first": e_after_first - e_before,
        "second": metric_sum(e_metrics, FINISHED) - e_after_first,
    }


def test_latency_through_the_router_versus_direct(fleet: Fleet) -> None:
    """Medians of five requests per path, for docs/benchmarks.md; latencies are not asserted.

    A failed request is recorded in the report with its answer rather than failing the lane
    (six engines on two cores make single slow answers likely); every path must still
    succeed at least once, and the correctness of each path is the other tests' job.
    """
    text = CASES["llama-text"]
    image = CASES["magenta"]
    paths = {
        "router P+D text": (fleet.routers["text"].url, text.body(fleet.model("llama"))),
        "router E+P+D image": (fleet.routers["epd"].url, image.body(fleet.model("qwen2vl"))),
    }
    if fleet.backend == "openai_http":
        direct = (fleet.engines["td"].address, text.body(fleet.model("llama")))
        paths["direct text (one instance)"] = direct
    samples: dict[str, list[float]] = {name: [] for name in paths}
    failures: list[str] = []
    for _ in range(5):
        for name, (url, body) in paths.items():
            started = time.monotonic()
            try:
                response = httpx.post(
                    f"{url}/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT_S
                )
            except httpx.HTTPError as exc:
                failures.append(f"{name}: {type(exc).__name__}: {exc}")
                continue
            if response.status_code == 200:
                samples[name].append(time.monotonic() - started)
            else:
                failures.append(f"{name}: {response.status_code} {response.text[:300]}")
    rows = {name: round(statistics.median(v) * 1000, 1) for name, v in samples.items() if v}
    fleet.report["latency_ms_p50"] = rows
    fleet.report["latency_failures"] = failures
    print(f"\nreal-vllm {fleet.backend} latency (ms, p50): {json.dumps(rows)}; failed: {failures}")
    assert all(samples.values()), failures


def test_parameter_matrix_through_p_d_equals_a_plain_instance(fleet: Fleet, plain: Plain) -> None:
    """Every field of the API-fidelity rule through the text router (P+D on the Llama), compared
    token by token with a plain ``vllm serve``, or refused by name where the native engine does
    not honour it (tests/real_vllm/matrix.py; its outcomes go to the report)."""
    plain.wait_ready()
    started = time.monotonic()
    with httpx.Client(timeout=CLIENT_TIMEOUT_S) as client:
        report = run_matrix(
            client,
            router_url=fleet.routers["text"].url,
            plain=plain.answers,
            model=plain.model,
            profile=PROFILES[fleet.backend],
            validate=jsonschema_validator(fleet.lane.python),
        )
    fleet.report["matrix"] = report.outcomes()
    fleet.report["matrix_s"] = round(time.monotonic() - started, 1)
    problems = report.problems()
    assert not problems, "\n".join(problems)


def test_client_disconnect_aborts_the_request_inside_vllm(fleet: Fleet) -> None:
    """D was running the request; after the client hangs up it runs nothing, and the request
    neither ran to its length nor produced its tokens: it was aborted inside vLLM."""
    d_metrics = fleet.engines["d"].metrics_url
    finished_before = metric_sum(d_metrics, *FINISHED_BY_LENGTH)
    generated_before = metric_sum(d_metrics, GENERATED)
    url = f"{fleet.routers['epd'].url}/v1/chat/completions"
    with httpx.stream("POST", url, json=long_stream_body(fleet), timeout=CLIENT_TIMEOUT_S) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        assert any(has_text(line) for line in lines)
        # Keep reading, as a client would, until D's gauge shows the request running.
        seen: list[str] = []
        started = time.monotonic()
        while metric_sum(d_metrics, RUNNING) != 1:
            line = next(lines, None)
            assert line is not None, f"the stream ended before D showed it running: {seen[-3:]}"
            seen.append(line)
            assert time.monotonic() - started < 30, "D never showed the request running"
    took = wait_for_metric(d_metrics, RUNNING, "", 0, timeout_s=30)
    assert metric_sum(d_metrics, *FINISHED_BY_LENGTH) == finished_before
    assert metric_sum(d_metrics, GENERATED) - generated_before < LONG_TOKENS
    fleet.report["disconnect_to_running_0_s"] = round(took, 2)


def test_kill_9_of_decode_mid_stream_is_an_error_and_other_pools_still_serve(
    fleet: Fleet,
) -> None:
    url = f"{fleet.routers['epd'].url}/v1/chat/completions"
    events: list[str] = []
    with httpx.stream("POST", url, json=long_stream_body(fleet), timeout=60.0) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert any(has_text(line) for line in lines)
        fleet.engines["d"].process.kill_group()
        killed = time.monotonic()
        events = [line for line in lines if line.startswith("data: ")]
    ended_after = time.monotonic() - killed
    assert "data: [DONE]" not in events
    assert events, "the stream ended without an error event"
    error = json.loads(events[-1].removeprefix("data: "))
    assert "error" in error, events[-1]
    fleet.report["kill_9_to_client_error_s"] = round(ended_after, 2)

    # The E+P+D router sees its decode pool empty and refuses new requests at once; the
    # routers over other pools (E+PD, and P+D on the text model) still serve.
    wait_for_health(fleet.routers["epd"].url, "decode", usable=0, timeout_s=30)
    refused = httpx.post(url, json=CASES["qwen-text"].body(fleet.model("qwen2vl")), timeout=150)
    assert refused.status_code == 503, refused.text
    answer, _ = chat(fleet.routers["e_pd"].url, CASES["green"].body(fleet.model("qwen2vl")))
    assert_matches_golden(CASES["green"], answer)
    answer, _ = chat(fleet.routers["text"].url, CASES["llama-text"].body(fleet.model("llama")))
    assert_matches_golden(CASES["llama-text"], answer)


def wait_for_health(url: str, pool: str, usable: int, timeout_s: float) -> None:
    started = time.monotonic()
    while True:
        health = httpx.get(f"{url}/health", timeout=10).json()
        if health["pools"][pool]["usable"] == usable:
            return
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"pool {pool} of {url} stayed at {health['pools'][pool]}")
        time.sleep(0.2)

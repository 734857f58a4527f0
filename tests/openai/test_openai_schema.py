"""Parsing and validation of OpenAI request bodies, media policy, and response shapes."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from typing import TYPE_CHECKING

import httpx
import pytest
import trio

from epd_actors.errors import ConfigError, InvalidRequest
from epd_actors.frontends.media_fetch import open_media_fetcher, resolve_media
from epd_actors.openai.media import MediaLimits, MediaPolicy, PendingMedia
from epd_actors.openai.schema import (
    ParsedRequest,
    SseFormatter,
    parse_chat_completion,
    parse_completion,
    response_body,
)
from epd_actors.protocol import ChatMessage, MediaItem, Prompt, Usage

if TYPE_CHECKING:
    from pathlib import Path

LIMITS = MediaLimits()
PNG = b"\x89PNG\r\n\x1a\nfake-image"
WAV = b"RIFF....WAVEfake-audio"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def image_part(url: str) -> dict[str, object]:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts: object) -> dict[str, object]:
    return {"role": "user", "content": list(parts)}


def chat(*messages: object, limits: MediaLimits = LIMITS, **fields: object) -> ParsedRequest:
    body = {
        "model": "m",
        "messages": list(messages) or [{"role": "user", "content": "hi"}],
        **fields,
    }
    return parse_chat_completion(body, request_id="r1", limits=limits)


def completion(**fields: object) -> ParsedRequest:
    return parse_completion({"model": "m", **fields}, request_id="r1", limits=LIMITS)


def refused(call: object, param: str | None) -> InvalidRequest:
    assert callable(call)
    with pytest.raises(InvalidRequest) as info:
        call()
    assert info.value.param == param, str(info.value)
    return info.value


# ---------------------------------------------------------------- chat content


def test_text_and_media_parts_become_ordered_parts_and_items() -> None:
    audio = {"type": "input_audio", "input_audio": {"data": b64(WAV), "format": "wav"}}
    parsed = chat(
        {"role": "system", "content": "be brief"},
        user(
            {"type": "text", "text": "look"}, image_part(f"data:image/png;base64,{b64(PNG)}"), audio
        ),
    )
    request = parsed.request
    assert request.prompt.messages == (
        ChatMessage("system", ("be brief",)),
        ChatMessage("user", ("look", 0, 1)),
    )
    assert [item.mime_type for item in request.media] == ["image/png", "audio/wav"]
    assert request.media[0].data == PNG
    assert request.media[0].content_hash == hashlib.sha256(PNG).hexdigest()
    assert parsed.kind == "chat"
    assert parsed.model == "m"


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ({"role": "developer", "content": "x"}, ChatMessage("system", ("x",))),
        ({"role": "assistant", "content": None}, ChatMessage("assistant", ())),
        (
            {"role": "tool", "content": "42", "tool_call_id": "t"},
            ChatMessage("tool", ("42",), {"tool_call_id": "t"}),
        ),
        (user(), ChatMessage("user", ())),
    ],
    ids=["developer-is-system", "assistant-null", "tool", "empty-parts"],
)
def test_roles(message: dict[str, object], expected: ChatMessage) -> None:
    assert chat(message).prompt.messages == (expected,)


def test_mp3_audio_and_audio_url() -> None:
    parsed = chat(
        user(
            {"type": "input_audio", "input_audio": {"data": b64(b"ID3"), "format": "mp3"}},
            {"type": "audio_url", "audio_url": {"url": f"data:audio/ogg;base64,{b64(b'Ogg')}"}},
        )
    )
    assert [m.mime_type for m in parsed.request.media] == ["audio/mpeg", "audio/ogg"]


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (None, "messages"),
        ([], "messages"),
        (["hi"], "messages[0]"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": ["user"], "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([user({"type": "video"})], "messages[0].content[0].type"),
        ([user({"type": "text"})], "messages[0].content[0].text"),
        ([user({"type": "text", "text": 1})], "messages[0].content[0].text"),
        ([user("plain string part")], "messages[0].content[0]"),
        ([user({"type": "image_url", "image_url": "data:x"})], "messages[0].content[0].image_url"),
        ([user(image_part(""))], "messages[0].content[0].image_url.url"),
        ([{"role": "assistant", "content": [image_part("data:image/png;base64,AA==")]}],
         "messages[0].content[0].type"),
    ],
    ids=[
        "missing", "empty", "not-object", "role", "role-unhashable", "content-type",
        "user-null", "part-type", "text-missing", "text-not-str", "part-not-object",
        "image_url-not-object", "url-empty", "media-outside-user",
    ],
)  # fmt: skip
def test_bad_messages_name_the_field(messages: object, param: str) -> None:
    body = {"model": "m", "messages": messages}
    refused(lambda: parse_chat_completion(body, request_id="r", limits=LIMITS), param)


MEDIA = "messages[0].content[0].image_url"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png;base64,%%%", "invalid base64"),
        ("data:image/png,rawbytes", "data:<mime>;base64"),
        ("data:audio/wav;base64,AAAA", "expected a image/*"),
        ("data:image/PNG XSS;base64,AAAA", "expected a image/*"),
        ("data:image/png;base64,", "empty"),
        ("ftp://example.com/a.png", "unsupported media URL"),
        ("https://example.com/a.png", "not allowed"),
        ("/etc/passwd", "not allowed"),
        ("file:///etc/passwd", "not allowed"),
    ],
    ids=["base64", "not-base64", "wrong-modality", "bad-mime", "empty", "ftp", "https-default",
         "path-default", "file-url-default"],
)  # fmt: skip
def test_bad_media_references(url: str, message: str) -> None:
    error = refused(lambda: chat(user(image_part(url))), MEDIA)
    assert message in str(error)


def test_bad_input_audio() -> None:
    prefix = "messages[0].content[0].input_audio"
    for audio, param in [
        ({"data": b64(WAV), "format": "flac"}, f"{prefix}.format"),
        ({"data": b64(WAV), "format": ["wav"]}, f"{prefix}.format"),
        ({"format": "wav"}, f"{prefix}.data"),
        ({"data": "!!", "format": "wav"}, f"{prefix}.data"),
    ]:
        part = {"type": "input_audio", "input_audio": audio}
        refused(lambda part=part: chat(user(part)), param)  # type: ignore[misc]


def test_media_limits() -> None:
    small = MediaLimits(max_items=2, max_item_bytes=len(PNG), max_total_bytes=2 * len(PNG))
    url = f"data:image/png;base64,{b64(PNG)}"
    chat(user(image_part(url), image_part(url)), limits=small)
    refused(
        lambda: chat(user(image_part(url), image_part(url), image_part(url)), limits=small),
        "messages[0].content[2].image_url",
    )
    big = f"data:image/png;base64,{b64(PNG + b'!')}"
    error = refused(lambda: chat(user(image_part(big)), limits=small), MEDIA)
    assert "exceeds the limit" in str(error)
    total = MediaLimits(max_item_bytes=len(PNG), max_total_bytes=len(PNG) + 1)
    refused(
        lambda: chat(user(image_part(url), image_part(url)), limits=total),
        "messages[0].content[1].image_url",
    )


# ---------------------------------------------------------------- allow-list

POLICY = MediaPolicy(
    url_prefixes=("https://cdn.example.com/images/", "http://media.local:8080"),
    local_dirs=("/srv/media",),
)


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("https://cdn.example.com/images/cat.png", True),
        ("https://CDN.example.com:443/images/a/b.png", True),
        ("http://media.local:8080/anything.png", True),
        ("https://cdn.example.com/imagesX/cat.png", False),
        ("https://cdn.example.com.evil.net/images/cat.png", False),
        ("https://cdn.example.com@evil.net/images/cat.png", False),
        ("https://user:pw@cdn.example.com/images/cat.png", False),
        ("https://cdn.example.com/images/../secret.png", False),
        ("https://cdn.example.com/images/%2e%2e/secret.png", False),
        ("http://cdn.example.com/images/cat.png", False),
        ("https://cdn.example.com:8443/images/cat.png", False),
        ("http://media.local/anything.png", False),
        ("https://cdn.example.com:99999/images/cat.png", False),
    ],
    ids=[
        "prefix", "host-case-default-port", "whole-host", "not-a-path-boundary", "host-suffix",
        "userinfo-trick", "credentials", "dot-dot", "encoded-dot-dot", "scheme", "port",
        "default-port-mismatch", "bad-port",
    ],
)  # fmt: skip
def test_url_allow_list(url: str, allowed: bool) -> None:
    assert POLICY.allows_url(url) is allowed
    limits = MediaLimits(policy=POLICY)
    if allowed:
        [pending] = chat(user(image_part(url)), limits=limits).pending
        assert pending == PendingMedia(url, False, "image", MEDIA)
    else:
        refused(lambda: chat(user(image_part(url)), limits=limits), MEDIA)


@pytest.mark.parametrize(
    ("reference", "resolved"),
    [
        ("/srv/media/a.png", "/srv/media/a.png"),
        ("file:///srv/media/sub/a.png", "/srv/media/sub/a.png"),
        ("file://localhost/srv/media/a%20b.png", "/srv/media/a b.png"),
        ("/srv/media//a.png", "/srv/media/a.png"),
        ("/srv/media/../etc/passwd", None),
        ("/srv/media/sub/../../etc/passwd", None),
        ("file:///srv/media/%2e%2e/etc/passwd", None),
        ("/srv/mediaX/a.png", None),
        ("file://otherhost/srv/media/a.png", None),
        ("/etc/passwd", None),
    ],
    ids=[
        "path", "file-url", "localhost-escaped", "double-slash", "traversal", "deep-traversal",
        "encoded-traversal", "sibling-dir", "remote-file-host", "outside",
    ],
)  # fmt: skip
def test_local_path_allow_list(reference: str, resolved: str | None) -> None:
    limits = MediaLimits(policy=POLICY)
    if resolved is None:
        refused(lambda: chat(user(image_part(reference)), limits=limits), MEDIA)
    else:
        [pending] = chat(user(image_part(reference)), limits=limits).pending
        assert (pending.source, pending.local) == (resolved, True)


def test_policy_is_checked_when_configured() -> None:
    with pytest.raises(ConfigError, match=r"url_prefixes\[0\]"):
        MediaPolicy(url_prefixes=("cdn.example.com",))
    with pytest.raises(ConfigError, match=r"local_dirs\[0\]"):
        MediaPolicy(local_dirs=("relative/dir",))


def test_pending_media_must_be_resolved_before_running() -> None:
    limits = MediaLimits(policy=POLICY)
    text = {"type": "text", "text": "a"}
    parsed = chat(user(text, image_part("https://cdn.example.com/images/x.png")), limits=limits)
    with pytest.raises(RuntimeError, match="resolve_media"):
        _ = parsed.request
    item = MediaItem("image/png", PNG, hashlib.sha256(PNG).hexdigest())
    assert parsed.with_media((item,)).request.media == (item,)


# ---------------------------------------------------------------- resolving media


def mock_fetcher_limits(tmp_path: Path | None = None, **limits: object) -> MediaLimits:
    dirs = (str(tmp_path),) if tmp_path is not None else ()
    policy = MediaPolicy(url_prefixes=("https://cdn.example.com/",), local_dirs=dirs)
    return MediaLimits(policy=policy, **limits)  # type: ignore[arg-type]


def transport() -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/cat.png":
            return httpx.Response(200, content=PNG, headers={"content-type": "image/png"})
        if request.url.path == "/guess.jpg":
            return httpx.Response(200, content=PNG, headers={"content-type": "text/plain"})
        if request.url.path == "/big.png":
            return httpx.Response(200, content=PNG * 100)
        if request.url.path == "/moved.png":
            return httpx.Response(302, headers={"location": "https://evil.net/x.png"})
        return httpx.Response(404)

    return httpx.MockTransport(handle)


async def resolve(urls: list[str], limits: MediaLimits) -> ParsedRequest:
    parsed = chat(user(*(image_part(url) for url in urls)), limits=limits)
    async with open_media_fetcher(limits, transport=transport()) as fetcher:
        return await resolve_media(parsed, limits=limits, fetcher=fetcher)


async def test_resolve_fetches_allowed_urls() -> None:
    limits = mock_fetcher_limits()
    parsed = await resolve(
        ["https://cdn.example.com/cat.png", "https://cdn.example.com/guess.jpg"], limits
    )
    assert [(m.mime_type, m.data) for m in parsed.request.media] == [
        ("image/png", PNG),
        ("image/jpeg", PNG),
    ]
    assert parsed.request.media[0].content_hash == hashlib.sha256(PNG).hexdigest()


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/missing.png", "HTTP 404"),
        ("/moved.png", "HTTP 302"),
        ("/big.png", "larger than"),
    ],
    ids=["404", "redirect-not-followed", "too-large"],
)
async def test_resolve_failures_name_the_field(path: str, message: str) -> None:
    limits = mock_fetcher_limits(max_item_bytes=len(PNG) * 10)
    with pytest.raises(InvalidRequest, match=message) as info:
        await resolve([f"https://cdn.example.com{path}"], limits)
    assert info.value.param == MEDIA


async def test_resolve_without_a_fetcher_refuses_urls() -> None:
    limits = mock_fetcher_limits()
    parsed = chat(user(image_part("https://cdn.example.com/cat.png")), limits=limits)
    with pytest.raises(InvalidRequest, match="does not fetch"):
        await resolve_media(parsed, limits=limits, fetcher=None)


async def test_resolve_reads_local_files_and_refuses_symlink_escapes(tmp_path: Path) -> None:
    inside = tmp_path / "media"
    inside.mkdir()
    (inside / "cat.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(b"secret")
    os.symlink(tmp_path / "secret.png", inside / "link.png")
    limits = mock_fetcher_limits(inside)
    parsed = await resolve([str(inside / "cat.png")], limits)
    assert parsed.request.media[0].data == PNG
    with pytest.raises(InvalidRequest, match="outside the allowed") as info:
        await resolve([str(inside / "link.png")], limits)
    assert info.value.param == MEDIA
    with pytest.raises(InvalidRequest, match="cannot read"):
        await resolve([str(inside / "nothing.png")], limits)


async def test_resolve_times_out(autojump_clock: trio.testing.MockClock) -> None:
    class Stuck:
        async def fetch_url(self, url: str, *, max_bytes: int) -> object:
            await trio.sleep_forever()

    limits = mock_fetcher_limits(fetch_timeout_s=2.0)
    parsed = chat(user(image_part("https://cdn.example.com/cat.png")), limits=limits)
    with pytest.raises(InvalidRequest, match="longer than 2s"):
        await resolve_media(parsed, limits=limits, fetcher=Stuck())  # type: ignore[arg-type]
    assert trio.current_time() == 2.0


# ---------------------------------------------------------------- sampling


def test_what_the_client_leaves_unset_stays_unset() -> None:
    """No router-side defaults: the engine applies its own (generation config, context)."""
    for parsed in (chat(), completion(prompt="x")):
        sampling = parsed.sampling
        assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k) == (
            None,
            None,
            None,
            None,
        )
        assert (parsed.stream, parsed.include_usage, parsed.logprobs, parsed.n) == (
            False,
            False,
            False,
            1,
        )
        assert parsed.options is None
        assert parsed.request.options is None


def test_every_sampling_field() -> None:
    parsed = chat(
        max_completion_tokens=50,
        max_tokens=7,
        temperature=0,
        top_p=0.5,
        top_k=40,
        stop="END",
        seed=-3,
        min_tokens=2,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        stream_options={"include_usage": True},
        user="alice",
        frequency_penalty=0,
    )
    sampling = parsed.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k) == (
        50,
        0.0,
        0.5,
        40,
    )
    assert (sampling.stop, sampling.seed, sampling.min_tokens, sampling.logprobs) == (
        ("END",),
        -3,
        2,
        3,
    )
    assert (parsed.stream, parsed.include_usage, parsed.logprobs, parsed.top_logprobs) == (
        True,
        True,
        True,
        3,
    )
    assert parsed.session_key == "alice"
    assert parsed.request.options == {"frequency_penalty": 0}


def test_session_header_wins_over_user() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "user": "alice"}
    parsed = parse_chat_completion(body, request_id="r", limits=LIMITS, session_key="s1")
    assert parsed.session_key == "s1"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.1}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a", ""]}, "stop[1]"),
        ({"stop": ["s"] * 17}, "stop"),
        ({"seed": 1 << 64}, "seed"),
        ({"seed": "1"}, "seed"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"logprobs": 1}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"n": 2}, "n"),
        ({"n": "1"}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": []}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"model": ""}, "model"),
        ({"model": 5}, "model"),
        ({"user": 7}, "user"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"some_future_field": {"x": True}}, "some_future_field"),
    ],
    ids=lambda value: json.dumps(value, default=str) if isinstance(value, dict) else None,
)
def test_bad_fields_name_the_field(fields: dict[str, object], param: str) -> None:
    refused(lambda: chat(**fields), param)


def test_harmless_fields_are_accepted() -> None:
    parsed = chat(tools=[], response_format={"type": "text"}, n=1, logit_bias={})
    assert parsed.n == 1
    assert parsed.options == {"tools": [], "response_format": {"type": "text"}, "logit_bias": {}}


def test_body_must_be_an_object() -> None:
    refused(lambda: parse_chat_completion([], request_id="r", limits=LIMITS), None)


# ---------------------------------------------------------------- completions


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", Prompt(text="hello")),
        ([1, 2, 3], Prompt(token_ids=(1, 2, 3))),
        (["only one"], Prompt(text="only one")),
        ([[4, 5]], Prompt(token_ids=(4, 5))),
    ],
    ids=["text", "token-ids", "single-text", "single-ids"],
)
def test_completion_prompts(prompt: object, expected: Prompt) -> None:
    assert completion(prompt=prompt).prompt == expected


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({}, "prompt", "string or an array"),
        ({"prompt": []}, "prompt", "string or an array"),
        ({"prompt": ["a", "b"]}, "prompt", "batched prompts are not supported"),
        ({"prompt": [[1], [2]]}, "prompt", "batched prompts are not supported"),
        ({"prompt": [[]]}, "prompt", "must not be empty"),
        ({"prompt": [1, "a"]}, "prompt[1]", "token ids"),
        ({"prompt": [1, -1]}, "prompt[1]", "token ids"),
        ({"prompt": [True]}, "prompt[0]", "token ids"),
        ({"prompt": "x", "echo": 1}, "echo", "true or false"),
        ({"prompt": "x", "suffix": "end"}, "suffix", "not supported"),
        ({"prompt": "x", "best_of": 2}, "best_of", "not supported"),
        ({"prompt": "x", "logprobs": True}, "logprobs", "integer"),
        ({"prompt": "x", "logprobs": 21}, "logprobs", "integer"),
    ],
    ids=[
        "missing", "empty", "batch-text", "batch-ids", "empty-ids", "mixed", "negative",
        "bool-id", "echo", "suffix", "best_of", "logprobs-bool", "logprobs-range",
    ],
)  # fmt: skip
def test_bad_completions(fields: dict[str, object], param: str, message: str) -> None:
    error = refused(lambda: completion(**fields), param)
    assert message in str(error)


def test_completion_logprobs_is_a_count() -> None:
    parsed = completion(prompt="x", logprobs=2, echo=False, best_of=1)
    assert (parsed.logprobs, parsed.sampling.logprobs, parsed.kind) == (True, 2, "completion")
    assert parsed.options == {"echo": False}


# ---------------------------------------------------------------- responses


def test_response_bodies() -> None:
    usage = Usage(3, 2)
    chat_body = response_body(
        "chat",
        request_id="r1",
        model="m",
        created=9,
        text="hi",
        finish_reason="stop",
        usage=usage,
    )
    assert chat_body == {
        "id": "chatcmpl-r1",
        "object": "chat.completion",
        "created": 9,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    text_body = response_body(
        "completion",
        request_id="r1",
        model="m",
        created=9,
        text="hi",
        finish_reason="length",
        usage=usage,
    )
    assert text_body["object"] == "text_completion"
    assert text_body["choices"] == [
        {"index": 0, "text": "hi", "logprobs": None, "finish_reason": "length"}
    ]


def test_sse_chunks_equal_the_compact_json_of_the_chunk_dict() -> None:
    formatter = SseFormatter("chat", request_id="r1", model='m"odel', created=5)
    event = formatter.delta('é "q" \n\u2028')
    assert event.startswith("data: ")
    assert event.endswith("\n\n")
    expected = {
        "id": "chatcmpl-r1",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": 'm"odel',
        "choices": [
            {
                "index": 0,
                "delta": {"content": 'é "q" \n\u2028'},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
    assert json.loads(event[6:]) == expected
    assert event[6:-2] == json.dumps(expected, separators=(",", ":"), ensure_ascii=False)


def test_sse_logprobs_chunks() -> None:
    chat_fmt = SseFormatter("chat", request_id="r", model="m", created=1, logprobs=True)
    chunk = json.loads(chat_fmt.delta("ab", (7, 8), (-0.5, -1.0))[6:])
    assert chunk["choices"][0]["logprobs"] == {
        "content": [
            {"token": "token_id:7", "logprob": -0.5, "bytes": None, "top_logprobs": []},
            {"token": "token_id:8", "logprob": -1.0, "bytes": None, "top_logprobs": []},
        ]
    }
    text_fmt = SseFormatter("completion", request_id="r", model="m", created=1, logprobs=True)
    chunk = json.loads(text_fmt.delta("a", (7,), (-0.5,))[6:])
    assert chunk["choices"][0]["logprobs"] == {
        "tokens": ["token_id:7"],
        "token_logprobs": [-0.5],
        "top_logprobs": None,
    }
    assert SseFormatter.comment("a\nb") == ": a b\n\n"

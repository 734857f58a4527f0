"""The checks both front ends make on a decoded JSON body (sans-IO)."""

from __future__ import annotations

import json

import pytest

from epd_actors.errors import InvalidRequest
from epd_actors.openai.body_checks import (
    LoneSurrogate,
    dotted_path,
    find_lone_surrogate,
    may_hold_lone_surrogate,
    reject_lone_surrogates,
    unknown_model,
)
from epd_actors.openai.errors import error_response


@pytest.mark.parametrize(
    ("raw", "may"),
    [
        ('{"a": "plain"}', False),
        ('{"a": "\\u00e9\\u4e2d"}', False),
        ('{"a": "\\ud800"}', True),
        ('{"a": "\\uDFFF"}', True),
        ('{"a": "\\ud83d\\ude00"}', True),  # a pair: the walk decides
        (b'{"a": "\\ud800"}', True),
        (b'{"a": "\xed\xa0\x80"}', True),  # a UTF-8-encoded surrogate
        ('{"a": "é 中 😀"}'.encode(), False),  # raw UTF-8 holds none
        ('{"a": "x"}'.encode("utf-16-le"), True),  # decoded with surrogatepass
    ],
    ids=[
        "ascii",
        "bmp-escapes",
        "lone-high",
        "upper-case-low",
        "pair",
        "bytes-escape",
        "utf8-surrogate",
        "utf8-text",
        "utf16",
    ],
)
def test_the_scan_flags_every_way_a_lone_surrogate_can_arrive(raw: str | bytes, may: bool) -> None:
    assert may_hold_lone_surrogate(raw) is may


@pytest.mark.parametrize(
    ("value", "found"),
    [
        ({"messages": [{"content": "ok"}, {"content": "a\ud800"}]}, (("messages", 1, "content"),)),
        ({"stop": ["x", "\udc00"]}, (("stop", 1),)),
        ({"a": "\ud800", "b": "\ud800"}, (("a",),)),  # the first in document order
        ({"m": [{"\ud800": 1}]}, (("m", 0), True)),
        ({"a": "\U0001f600", "b": [1, None, 2.5, True]}, None),
        ("\ud800", ((),)),
    ],
    ids=["nested", "array", "first", "key", "clean", "root"],
)
def test_the_walk_finds_the_first_lone_surrogate(
    value: object, found: tuple[tuple[str | int, ...], bool] | tuple[tuple[str | int, ...]] | None
) -> None:
    assert find_lone_surrogate(value) == (None if found is None else LoneSurrogate(*found))


def test_the_walk_is_iterative_at_depths_no_recursion_limit_allows() -> None:
    value: object = "\ud800"
    for _ in range(50_000):
        value = {"a": value}
    found = find_lone_surrogate(value)
    assert found is not None
    assert found.path == ("a",) * 50_000


def test_a_valid_pair_and_an_escaped_backslash_pass() -> None:
    for raw in ('{"t": "\\ud83d\\ude00"}', '{"t": "\\\\ud800"}'):
        reject_lone_surrogates(raw, json.loads(raw))


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ('{"messages": [{"content": "\\ud800"}]}', "messages[0].content"),
        ('{"messages": [{"content": [{}, {"text": "\\udbff"}]}]}', "messages[0].content[1].text"),
        ('{"stop": ["\\uDC00"]}', "stop[0]"),
        ('{"prompt": "a\\ud800b"}', "prompt"),
        ('{"tools": {"\\ud800": 1}}', "tools"),
        ('"\\ud800"', None),
    ],
    ids=["content", "text-part", "stop", "prompt", "key", "root"],
)
def test_the_refusal_is_a_400_naming_the_field(raw: str, param: str | None) -> None:
    with pytest.raises(InvalidRequest) as caught:
        reject_lone_surrogates(raw, json.loads(raw))
    assert caught.value.param == param
    answer = error_response(caught.value)
    assert answer is not None
    assert answer.status == 400
    assert answer.body["error"]["type"] == "invalid_request_error"
    json.dumps(answer.body, ensure_ascii=False).encode()  # the answer itself is valid Unicode


def test_dotted_paths_name_fields_as_the_parser_does() -> None:
    assert dotted_path(("messages", 0, "content", 1, "text")) == "messages[0].content[1].text"
    assert dotted_path((0, "a")) == "[0].a"
    assert dotted_path(()) == ""


def test_unknown_model_is_the_http_404() -> None:
    answer = error_response(unknown_model("gpt-4o"))
    assert answer is not None
    assert answer.status == 404
    assert answer.body["error"] == {
        "message": "the model 'gpt-4o' does not exist",
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }

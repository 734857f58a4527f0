"""The one mapping from errors to HTTP answers (status, OpenAI error body, headers).

=========================================  ======  =================================
error                                      status  notes
=========================================  ======  =================================
``ModelNotFound``                           404     ``model_not_found``, ``param`` model
``InvalidRequest``, ``ConfigError``         400     ``param`` names the field
``Unauthorized``                            401
``HttpError`` (front-end refusals)          its own 404, 405, 408, 413, 415, 431
``Overloaded``                              429     ``Retry-After``
``NoHealthyWorker``                         503     ``Retry-After``
``StageTimeout``                            504     ``code`` is the phase
``RemoteWorkerError`` ``invalid_request``   400     the worker judged the input
``RemoteWorkerError``, ``WorkerError``,     502
``ActorCrashed``
``RequestCancelled``                        --      no answer: the client left
anything else                               500
=========================================  ======  =================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import (
    ActorCrashed,
    ConfigError,
    InvalidRequest,
    ModelNotFound,
    NoHealthyWorker,
    Overloaded,
    RemoteWorkerError,
    RequestCancelled,
    StageTimeout,
    Unauthorized,
    WorkerError,
)
from ..protocol import ErrorCode
from .format import error_body

ErrorBody = dict[str, dict[str, str | None]]


class HttpError(Exception):
    """A refusal decided by the front end itself (404, 405, 413, 415, ...)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers


@dataclass(frozen=True, slots=True)
class ErrorResponse:
    """An error as HTTP: status, OpenAI error body, extra headers."""

    status: int
    body: ErrorBody
    headers: tuple[tuple[str, str], ...] = ()


def error_response(exc: BaseException) -> ErrorResponse | None:
    """The one mapping from errors to HTTP answers; None means "just close".

    ``RequestCancelled`` maps to None: the client left (nginx's 499), nobody
    reads an answer.  Anything unrecognised is a 500.
    """
    if isinstance(exc, HttpError):
        body = error_body(str(exc), type=exc.type, param=exc.param, code=exc.code)
        return ErrorResponse(exc.status, body, exc.headers)
    if isinstance(exc, RequestCancelled):
        return None
    status, kind, code, param, headers = _classify(exc)
    return ErrorResponse(status, error_body(str(exc), type=kind, param=param, code=code), headers)


def _classify(
    exc: BaseException,
) -> tuple[int, str, str | None, str | None, tuple[tuple[str, str], ...]]:
    if isinstance(exc, ModelNotFound):
        return 404, "not_found_error", exc.code, exc.param, ()
    if isinstance(exc, InvalidRequest):
        return 400, "invalid_request_error", exc.code, exc.param, ()
    if isinstance(exc, ConfigError):
        return 400, "invalid_request_error", None, None, ()
    if isinstance(exc, Unauthorized):
        return 401, "authentication_error", "invalid_api_key", None, ()
    if isinstance(exc, Overloaded):
        retry = (("retry-after", str(max(1, math.ceil(exc.retry_after)))),)
        if isinstance(exc, NoHealthyWorker):
            return 503, "service_unavailable_error", "no_healthy_worker", None, retry
        return 429, "rate_limit_error", "overloaded", None, retry
    if isinstance(exc, StageTimeout):
        return 504, "timeout_error", exc.phase, None, ()
    if isinstance(exc, RemoteWorkerError) and exc.code == ErrorCode.INVALID_REQUEST:
        return 400, "invalid_request_error", exc.code, exc.param, ()
    if isinstance(exc, RemoteWorkerError):
        return 502, "upstream_error", exc.code, None, ()
    if isinstance(exc, WorkerError | ActorCrashed):
        return 502, "upstream_error", type(exc).__name__, None, ()
    return 500, "internal_error", type(exc).__name__, None, ()

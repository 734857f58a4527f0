"""The exception tree of epd_actors.

Every error the library raises on purpose is one of these; each boundary (the
worker connection, the HTTP and WebSocket front ends, the embeddable API) maps
them once.  Internal code may see exception groups; public entry points raise a
single exception from this tree::

    EpdError
    ├── ProtocolError                 bytes or messages that break the wire contract
    │   ├── LocalProtocolError        we were about to send something invalid
    │   └── RemoteProtocolError       the peer sent something invalid
    │       └── FrameTooLarge         a frame header announced more than the limit
    ├── ConfigError                   invalid configuration (names the key)
    ├── InvalidRequest                a client request that can never succeed (HTTP 400)
    │   └── ModelNotFound             the request names a model or adapter nobody serves (HTTP 404)
    ├── Unauthorized                  bad API key or worker auth token
    ├── ConnectionLost                the peer closed or reset a native connection
    ├── WorkerError                   something went wrong on or with a worker
    │   ├── WorkerDisconnected        the connection dropped or never came up
    │   ├── HandshakeRejected         the worker refused our hello (token, version)
    │   ├── RemoteWorkerError         the worker answered a request with an error
    │   ├── StreamOverrun             a request read its replies too slowly and was aborted
    │   ├── AdapterLoadFailed         a worker did not load a LoRA adapter in time, or refused to
    │   └── HandoffRejected           a later stage refused what an earlier stage's worker handed on
    ├── Overloaded                    admission refused; retry later (HTTP 429/503)
    │   └── NoHealthyWorker           a needed pool has no usable worker (HTTP 503)
    ├── StageTimeout                  a deadline expired (HTTP 504)
    │   └── AttemptTimeout            one worker did not answer a stage attempt in time
    ├── RequestCancelled              the caller or the router cancelled the request
    ├── ActorCrashed                  the stage actor holding the job crashed (restarted)
    ├── InternalError                 a router bug: one part broke its contract with another (500)
    ├── EngineError                   raised inside a worker by its engine; becomes an ErrorReply
    └── EngineCrashed                 the engine died; the worker goes down without goodbye
"""

from __future__ import annotations


class EpdError(Exception):
    """Base class of every error epd_actors raises on purpose."""


class ProtocolError(EpdError):
    """The native wire contract was broken."""


class LocalProtocolError(ProtocolError):
    """We were about to build or send a message that breaks the contract."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes or a message that break the contract."""


class FrameTooLarge(RemoteProtocolError):
    """A frame header announced a body larger than the configured limit.

    Raised as soon as the header arrives, before any of the body is buffered.
    """

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit


class ConfigError(EpdError):
    """Configuration that cannot be used; the message names the offending key."""


class InvalidRequest(EpdError):
    """A client request that can never succeed as sent.

    Attributes:
        param: the offending field (dotted path), when one can be named.
        code: a machine-readable reason, when there is one beyond "invalid"
            (``unknown_parameter``).
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ModelNotFound(InvalidRequest):
    """The request names a model (or LoRA adapter) the router does not serve.

    The message is the one both front ends give for it (HTTP 404
    ``model_not_found``, and the same error on the WebSocket).

    Attributes:
        model: the name the request gave.
    """

    def __init__(self, model: str) -> None:
        super().__init__(
            f"the model {model!r} does not exist", param="model", code="model_not_found"
        )
        self.model = model


class Unauthorized(EpdError):
    """A missing or wrong API key or auth token."""


class ConnectionLost(EpdError):
    """The peer of a native-protocol connection closed it or reset it."""


class WorkerError(EpdError):
    """Something went wrong on or with a worker."""

    retryable: bool = True


class WorkerDisconnected(WorkerError):
    """The connection to a worker dropped, or could not be opened."""


class HandshakeRejected(WorkerError):
    """The worker refused the handshake (auth token, protocol version)."""

    retryable = False


class RemoteWorkerError(WorkerError):
    """A worker answered a request with a typed error.

    Attributes:
        code: the wire error code (see ``protocol.messages.ErrorCode``).
        retryable: whether the same request may succeed on another worker.
        worker_id: the worker that answered, when known.
        stage: the stage that failed, when known.
        request_id: the request the error belongs to.
        param: the request field the worker blamed, when it named one.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        retryable: bool,
        worker_id: str | None = None,
        stage: str | None = None,
        request_id: str | None = None,
        param: str | None = None,
    ) -> None:
        where = f" (worker {worker_id}, stage {stage})" if worker_id or stage else ""
        super().__init__(f"{code}: {message}{where}")
        self.code = code
        self.detail = message
        self.retryable = retryable
        self.worker_id = worker_id
        self.stage = stage
        self.request_id = request_id
        self.param = param


class StreamOverrun(WorkerError):
    """A request's replies arrived faster than its reader took them; it was aborted.

    The connection's single reader never waits for one slow consumer: when a
    request's bounded reply buffer is full, that request alone fails with this
    error and the worker is told to abort it.  Not retryable: an overrun means a
    stuck or broken consumer, and the same consumer would overrun again.
    """

    retryable = False


class AdapterLoadFailed(WorkerError):
    """A worker did not load the LoRA adapter a request needs (refused, failed, too slow).

    Retryable: the request moves to another worker of the pool, which may
    have the adapter, or load it.

    Attributes:
        adapter: the adapter's name.
        worker_id: the worker that was asked to load it.
    """

    def __init__(self, message: str, *, adapter: str, worker_id: str) -> None:
        super().__init__(f"worker {worker_id} could not load LoRA adapter {adapter!r}: {message}")
        self.detail = message
        self.adapter = adapter
        self.worker_id = worker_id


class HandoffRejected(WorkerError):
    """A stage refused what an earlier stage's worker handed it (a KV handle).

    The refusing worker judged correctly; the fault lies with the worker that
    produced the hand-off.  Not retryable where it was raised (another
    decoder would refuse the same handle): the supervisor charges the
    producing worker and runs the producing stage again on another worker.

    Attributes:
        cause: the refusal, as the consuming worker answered it.
        stage: the stage that refused.
    """

    retryable = False

    def __init__(self, message: str, *, cause: RemoteWorkerError, stage: str) -> None:
        super().__init__(message)
        self.cause = cause
        self.stage = stage


class Overloaded(EpdError):
    """Admission refused: too much work in flight.  Retry after ``retry_after`` seconds."""

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class NoHealthyWorker(Overloaded):
    """A stage the request needs has no healthy worker right now."""


class StageTimeout(EpdError):
    """A deadline expired; ``phase`` says which one (request, first_token, ...)."""

    def __init__(self, message: str, *, phase: str) -> None:
        super().__init__(message)
        self.phase = phase


class AttemptTimeout(StageTimeout):
    """One worker did not answer a stage attempt within the stage's deadline.

    Treated like a worker failure: the attempt is aborted on that worker,
    counted against its circuit breaker and retried on another worker.  The
    caller sees it (a ``StageTimeout``, HTTP 504) only when no attempt is left.

    Attributes:
        worker_id: the worker that did not answer.
    """

    def __init__(self, message: str, *, phase: str, worker_id: str) -> None:
        super().__init__(message, phase=phase)
        self.worker_id = worker_id


class RequestCancelled(EpdError):
    """The request was cancelled by its caller or by the router's shutdown."""


class EngineError(EpdError):
    """Raised by a worker engine; the worker runtime turns it into an ``ErrorReply``.

    Attributes:
        code: a wire error code (``protocol.messages.ErrorCode`` value).
        retryable: whether another worker may succeed with the same request.
        param: the request field to blame (``ErrorReply.param``), when one can be named.
    """

    def __init__(
        self, code: str, message: str, *, retryable: bool = False, param: str | None = None
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.detail = message
        self.retryable = retryable
        self.param = param


class EngineCrashed(EpdError):
    """The engine died; the worker runtime tears the whole worker down without goodbye."""


class ActorCrashed(EpdError):
    """The stage actor running a request's job crashed; it is being restarted."""


class InternalError(EpdError):
    """A router bug: one part broke its contract with another (a stage actor
    replied with a ``Delta`` instead of its ``StageOutput``).  The request it
    hit fails; nothing is retried.  Maps to HTTP 500."""

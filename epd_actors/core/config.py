"""Router configuration: pools, workers, deadlines and limits, validated at start-up.

Every option has a default and a unit; an invalid value raises ``ConfigError``
naming the offending key (``pools.encode.policy``, ``deadlines.request_timeout_s``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from ..backends.native.settings import NativeSettings
from ..backends.openai_http.settings import OpenAIHttpSettings
from ..errors import ConfigError
from ..limits import ACTOR_INBOX_CAPACITY, ACTOR_MAX_JOBS
from .encoder_cache import EncoderReuse
from .fleet.settings import SharedSettings
from .health import HealthPolicy
from .kv_settings import KVEventsSettings, check_zmq_endpoint
from .retry import RetryPolicy
from .routing import build_policy
from .tracing.config import TracingConfig

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from ..lora import LoraAdapter


_ADDRESS_CHECKS: dict[str, Callable[[str, str], None]] = {}


def register_address_check(backend: str, check: Callable[[str, str], None]) -> None:
    """Make ``backend`` a valid worker backend whose addresses ``check(address, key)`` checks.

    :func:`~epd_actors.core.backend_kinds.register_backend_kind` calls this for
    every kind it registers, so the configuration knows the kinds without
    importing the module that builds their backends.
    """
    _ADDRESS_CHECKS[backend] = check


def check_worker_address(backend: str, address: str, *, key: str) -> None:
    """Refuse an unknown ``backend``, or an ``address`` its kind cannot reach.

    Raises:
        ConfigError: naming ``key.backend`` (with the known kinds) or ``key.address``.
    """
    check = _ADDRESS_CHECKS.get(backend)
    if check is None:
        raise ConfigError(
            f"{key}.backend: unknown backend {backend!r} (choose from {', '.join(_ADDRESS_CHECKS)})"
        )
    check(address, f"{key}.address")


@dataclass(frozen=True, slots=True)
class WorkerEndpoint:
    """One worker of a pool.

    Attributes:
        worker_id: unique across the whole router.
        address: ``tcp://HOST:PORT`` or ``unix:PATH`` (native backend), or
            ``http(s)://HOST:PORT`` (``openai_http`` backend).
        backend: how to reach it (``native`` or ``openai_http``).
        kv_events_endpoint / kv_events_replay_endpoint: where its engine
            publishes KV events (ZMQ PUB) and answers replays (ROUTER), for a
            pool with ``kv_events`` on; None: the pool's port rule
            (:class:`~.kv_settings.KVEventsSettings`).
    """

    worker_id: str
    address: str
    backend: str = "native"
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """The workers of one stage and how to route among them.

    Attributes:
        stage: ``encode``, ``prefill``, ``decode`` or ``pd`` (or a registered stage).
        workers: its workers (may be empty and filled at run time).
        policy: a routing policy name (see ``routing.policy_names()``); None:
            the stage actor's ``default_policy`` (``actors.stage_policy``:
            consistent hashing on the media hash for encode, least-in-flight
            elsewhere).
        max_in_flight_per_worker: jobs one worker may hold from this router.
        policy_options: the policy's options by name (each policy lists its
            own; docs/routing.md), e.g. ``{"load_factor": 1.5}``.
        model: the model the pool's workers serve (None: the router's
            ``model``).  A stage may have one pool per model.
        lora_loading: the router may load a LoRA adapter of the model on a
            worker of this pool at run time (vLLM's ``/v1/load_lora_adapter``,
            ``openai_http`` workers), when a request names one that no worker
            with room has loaded and the adapter has a ``path``.
        encoder_reuse: whether the router skips E for an item whose encoder
            output an earlier request produced (``reuse``/``reuse_ttl_s`` in
            the file; a stage that produces encoder outputs only, i.e. encode).
        kv_events: whether the router follows the workers' KV events, and
            where they publish (``kv_events``, ``kv_events_port`` ... in the
            file; docs/configuration.md).
        local_prefill_below_tokens: conditional disaggregation, on a pool
            whose stage hands its KV on (prefill): a request of which the
            consumer pool's best worker lacks fewer tokens than this skips
            the stage, and the consumer prefills it itself (0: never).
    """

    stage: str
    workers: tuple[WorkerEndpoint, ...] = ()
    policy: str | None = None
    max_in_flight_per_worker: int = 256
    policy_options: Mapping[str, object] = field(default_factory=dict)
    model: str | None = None
    lora_loading: bool = False
    encoder_reuse: EncoderReuse = field(default_factory=EncoderReuse)
    kv_events: KVEventsSettings = field(default_factory=KVEventsSettings)
    local_prefill_below_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the router knows of one model beyond its pools: its LoRA adapters.

    Attributes:
        name: a model some pool serves.
        lora_adapters: adapters a request may name instead of the model; its
            pools' workers serve them (``--lora-modules``), or load those with
            a ``path`` at run time (a pool's ``lora_loading``).  Adapters the
            workers announce or list are served without being configured.
    """

    name: str
    lora_adapters: tuple[LoraAdapter, ...] = ()


@dataclass(frozen=True, slots=True)
class Deadlines:
    """Every deadline of a request (seconds).

    The stage deadlines (``encode_timeout_s``, ``prefill_timeout_s``,
    ``first_token_timeout_s``) bound one attempt on one worker, from when the
    worker is chosen: on expiry the attempt is aborted there, counted against
    that worker's circuit breaker and retried on another worker, within the
    retry policy.  The request deadline bounds everything, retries included.

    Attributes:
        request_timeout_s: the whole request, from receipt to the last token.
        encode_timeout_s: one encode attempt, to its answer.
        prefill_timeout_s: one prefill attempt, to its answer.
        first_token_timeout_s: one attempt of the output stage (D or PD), to
            its first token.
        inter_token_timeout_s: between two output tokens.
        cleanup_timeout_s: how long aborts and releases may take after a
            request failed or was cancelled.
    """

    request_timeout_s: float = 600.0
    encode_timeout_s: float = 60.0
    prefill_timeout_s: float = 120.0
    first_token_timeout_s: float = 120.0
    inter_token_timeout_s: float = 60.0
    cleanup_timeout_s: float = 5.0


DEADLINE_NAMES: tuple[str, ...] = tuple(f.name for f in fields(Deadlines))
"""Every deadline of :class:`Deadlines`, in declaration order (each a number of seconds)."""


@dataclass(frozen=True, slots=True)
class ActorLimits:
    """Per-actor bounds.

    Attributes:
        inbox_capacity: jobs waiting in one actor's inbox.
        max_jobs: jobs one actor runs at once.
        restart_backoff_start_s / restart_backoff_max_s: restart delays after
            an actor crash (doubling).
    """

    inbox_capacity: int = ACTOR_INBOX_CAPACITY
    max_jobs: int = ACTOR_MAX_JOBS
    restart_backoff_start_s: float = 0.1
    restart_backoff_max_s: float = 10.0


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """Admission control.

    Attributes:
        max_requests_in_flight: requests the router serves at once; more are
            refused at once with ``Overloaded`` (HTTP 429 + ``Retry-After``).
        retry_after_s: the ``Retry-After`` a refusal suggests.
        low_priority_share: a ``low`` priority request is admitted only while
            fewer than this share of the limit are in flight.
        high_priority_reserve: the share of the limit only ``high`` priority
            requests may use (0: ``normal`` may use all of it).
    """

    max_requests_in_flight: int = 4096
    retry_after_s: float = 1.0
    low_priority_share: float = 0.8
    high_priority_reserve: float = 0.0

    def limit_for(self, priority: str) -> int:
        """How many requests may be in flight for a new one of ``priority`` to be admitted."""
        limit = self.max_requests_in_flight
        if priority == "high":
            return limit
        if priority == "low":
            return max(1, int(limit * self.low_priority_share))
        return max(1, limit - int(limit * self.high_priority_reserve))


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything the router needs to start.

    Attributes:
        pools: one per configured stage and model.
        auth_token: presented to native workers in the handshake.
        model: the router's default model: what a pool without a ``model``
            serves, and what a request without one is for.
        models: the LoRA adapters of the served models (see :class:`ModelConfig`).
        deadlines: request deadlines.
        actors: actor bounds.
        retries: when failed E, P (and not yet streaming D/PD) attempts move to
            another worker.
        health: the per-worker circuit breaker thresholds.
        admission: the global in-flight limit.
        native: connections to native workers (heartbeats, reconnects, buffers).
        openai_http: connections to stock ``vllm serve`` workers (timeouts,
            pools, health probes, the KV release policy).
        shared: the state this router shares with its replicas through Redis
            (off by default; ``epd_actors.core.fleet``).
        tracing: OpenTelemetry request tracing (off by default).
    """

    pools: tuple[PoolConfig, ...]
    auth_token: str = ""
    model: str = "sim-model"
    models: tuple[ModelConfig, ...] = ()
    deadlines: Deadlines = field(default_factory=Deadlines)
    actors: ActorLimits = field(default_factory=ActorLimits)
    retries: RetryPolicy = field(default_factory=RetryPolicy)
    health: HealthPolicy = field(default_factory=HealthPolicy)
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)
    native: NativeSettings = field(default_factory=NativeSettings)
    openai_http: OpenAIHttpSettings = field(default_factory=OpenAIHttpSettings)
    shared: SharedSettings = field(default_factory=SharedSettings)
    tracing: TracingConfig = field(default_factory=TracingConfig)

    def __post_init__(self) -> None:
        validate(self)

    def pool(self, stage: str, model: str | None = None) -> PoolConfig | None:
        """The pool of ``stage`` for ``model`` (default: the router's model), if configured."""
        wanted = model or self.model
        for pool in self.pools:
            if pool.stage == stage and self.pool_model(pool) == wanted:
                return pool
        return None

    def pool_model(self, pool: PoolConfig) -> str:
        """The model ``pool`` serves."""
        return pool.model or self.model

    def pool_name(self, pool: PoolConfig) -> str:
        """How the router names ``pool``: its stage, with ``@model`` for another model."""
        return pool_name(pool.stage, self.pool_model(pool), self.model)

    def served_models(self) -> tuple[str, ...]:
        """Every model some pool serves, in the order the pools are configured."""
        return tuple(dict.fromkeys(self.pool_model(pool) for pool in self.pools))

    def lora_adapters(self, model: str) -> tuple[LoraAdapter, ...]:
        """The configured LoRA adapters of ``model``."""
        return next((m.lora_adapters for m in self.models if m.name == model), ())


def pool_name(stage: str, model: str, default_model: str) -> str:
    """``stage`` for the default model's pool, ``stage@model`` for another model's."""
    return stage if model == default_model else f"{stage}@{model}"


def _positive(key: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{key} must be a positive number, got {value!r}")


def validate(config: RouterConfig) -> None:
    """Check every field; raise ``ConfigError`` naming the first bad key."""
    if not config.pools:
        raise ConfigError("pools: at least one pool is needed")
    seen_pools: set[str] = set()
    seen_workers: set[str] = set()
    for pool in config.pools:
        key = f"pools.{pool.stage}"
        if pool.model is not None and not pool.model:
            raise ConfigError(f"{key}.model must not be empty")
        name = config.pool_name(pool)
        if name in seen_pools:
            model = config.pool_model(pool)
            raise ConfigError(f"{key}: configured twice for model {model!r}")
        seen_pools.add(name)
        if pool.policy is not None:  # else the stage actor's default, checked by build_pools
            try:
                build_policy(pool.policy, pool.policy_options)
            except ConfigError as exc:
                raise ConfigError(f"{key}.policy: {exc}") from None
        if pool.max_in_flight_per_worker < 1:
            raise ConfigError(f"{key}.max_in_flight_per_worker must be >= 1")
        pool.encoder_reuse.check(key)
        pool.kv_events.check(key)
        if pool.local_prefill_below_tokens < 0:
            raise ConfigError(f"{key}.local_prefill_below_tokens must be >= 0")
        for index, worker in enumerate(pool.workers):
            worker_key = f"{key}.workers[{index}]"
            if not worker.worker_id:
                raise ConfigError(f"{worker_key}.id must not be empty")
            if worker.worker_id in seen_workers:
                raise ConfigError(f"{worker_key}.id: duplicate worker id {worker.worker_id!r}")
            seen_workers.add(worker.worker_id)
            check_worker_address(worker.backend, worker.address, key=worker_key)
            check_kv_endpoints(pool.kv_events, worker, key=worker_key)
    _check_models(config)
    deadlines = config.deadlines
    for name in DEADLINE_NAMES:
        _positive(f"deadlines.{name}", getattr(deadlines, name))
    actors = config.actors
    if actors.inbox_capacity < 0:
        raise ConfigError("actors.inbox_capacity must be >= 0")
    if actors.max_jobs < 1:
        raise ConfigError("actors.max_jobs must be >= 1")
    _positive("actors.restart_backoff_start_s", actors.restart_backoff_start_s)
    if config.admission.max_requests_in_flight < 1:
        raise ConfigError("admission.max_requests_in_flight must be >= 1")
    _positive("admission.retry_after_s", config.admission.retry_after_s)
    if not 0.0 < config.admission.low_priority_share <= 1.0:
        raise ConfigError("admission.low_priority_share must be in (0, 1]")
    if not 0.0 <= config.admission.high_priority_reserve < 1.0:
        raise ConfigError("admission.high_priority_reserve must be in [0, 1)")
    _positive("actors.restart_backoff_max_s", actors.restart_backoff_max_s)


def check_kv_endpoints(settings: KVEventsSettings, worker: WorkerEndpoint, *, key: str) -> None:
    """Refuse KV event endpoints that cannot be used for ``worker`` (``key``: its config key).

    A pool without ``kv_events`` must not name any; a pool with it must find
    one for every worker (its own, or the pool's port rule).

    Raises:
        ConfigError: naming ``key.kv_events_endpoint`` (or ``..._replay_endpoint``).
    """
    own = (
        ("kv_events_endpoint", worker.kv_events_endpoint),
        ("kv_events_replay_endpoint", worker.kv_events_replay_endpoint),
    )
    for name, value in own:
        if value is None:
            continue
        if not settings.enabled:
            raise ConfigError(f"{key}.{name}: the pool's kv_events is off")
        check_zmq_endpoint(value, key=f"{key}.{name}")
    if worker.kv_events_replay_endpoint is not None and worker.kv_events_endpoint is None:
        raise ConfigError(f"{key}.kv_events_replay_endpoint: needs kv_events_endpoint")
    found = settings.endpoints(worker.address, worker.kv_events_endpoint, None)
    if settings.enabled and found is None:
        raise ConfigError(
            f"{key}.kv_events_endpoint: required (the pool has no kv_events_port, "
            f"or the address {worker.address!r} names no host)"
        )


def _check_models(config: RouterConfig) -> None:
    """Every ``models`` entry names a served model; adapter names are unique and no model's."""
    served = set(config.served_models())
    seen_models: set[str] = set()
    seen_adapters: set[str] = set()
    for index, model in enumerate(config.models):
        key = f"models[{index}]"
        if model.name not in served:
            raise ConfigError(f"{key}.name: no pool serves model {model.name!r}")
        if model.name in seen_models:
            raise ConfigError(f"{key}.name: model {model.name!r} is listed twice")
        seen_models.add(model.name)
        for number, adapter in enumerate(model.lora_adapters):
            adapter_key = f"{key}.lora_adapters[{number}]"
            if not adapter.name:
                raise ConfigError(f"{adapter_key}.name must not be empty")
            if adapter.name in served:
                raise ConfigError(f"{adapter_key}.name: {adapter.name!r} is a model's name")
            if adapter.name in seen_adapters:
                raise ConfigError(f"{adapter_key}.name: adapter {adapter.name!r} is listed twice")
            if adapter.path is not None and not adapter.path:
                raise ConfigError(f"{adapter_key}.path must not be empty")
            seen_adapters.add(adapter.name)

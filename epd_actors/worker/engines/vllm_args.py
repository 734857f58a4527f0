"""Options of the vLLM engine, and the vLLM engine arguments each role needs.

Pure and cheap: nothing here imports vLLM (or asyncio), so the worker's command
line can parse and check every option before the slow engine start.

A worker role maps onto vLLM's disaggregation settings like this (connector
names and their extra config come from the options, passed through unchanged):

===========  ==========================================  ==============================
role         ``ec_transfer_config``                      ``kv_transfer_config``
===========  ==========================================  ==============================
``encode``   ``ec_role="ec_producer"`` (required), plus  --
             ``mm_encoder_only`` and no prefix caching
``prefill``  ``ec_role="ec_consumer"`` (if configured)    ``kv_role="kv_producer"`` (required)
``decode``   --                                          ``kv_role="kv_consumer"`` (required)
``pd``       ``ec_role="ec_consumer"`` (if configured)    --
===========  ==========================================  ==============================

P and PD take the encoder-cache connector only when it is configured: a P+D
topology without encoders needs none, nor does a PD worker that encodes itself.
``--kv-transfer-fields`` / ``--ec-transfer-fields`` add other top-level fields
of vLLM's ``KVTransferConfig`` / ``ECTransferConfig`` (``{"kv_buffer_device":
"cpu"}`` for NIXL on CPU, or ``{"kv_role": "kv_both"}`` where a connector wants
that role).  Everything after ``--`` on the command line is handed to vLLM's
own engine-argument parser unchanged, except the flags the role sets itself.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from ...errors import ConfigError
from ...protocol import Role

if TYPE_CHECKING:
    import argparse
    from collections.abc import Mapping

__all__ = [
    "VLLM_MISSING",
    "VllmOptions",
    "add_vllm_arguments",
    "check_vllm_installed",
    "engine_args_for_role",
    "engine_cli_args",
    "vllm_options_from_args",
]

VLLM_MISSING: Final = (
    "--engine vllm needs vLLM, which is not installed: pip install 'epd_actors[vllm]' "
    "(on CPU-only machines see docs/worker.md, section 'The vLLM engine')"
)

# Fields of the transfer configs that have their own options.
_KV_OWN_FIELDS: Final = frozenset({"kv_connector", "kv_connector_extra_config"})
_EC_OWN_FIELDS: Final = frozenset({"ec_connector", "ec_connector_extra_config"})


@dataclass(frozen=True, slots=True)
class VllmOptions:
    """What the worker's options say about the vLLM engine.

    Attributes:
        ec_connector: vLLM encoder-cache connector (``ECExampleConnector``, ...).
        ec_connector_extra: its ``ec_connector_extra_config``, unchanged.
        ec_transfer_fields: more top-level ``ECTransferConfig`` fields.
        kv_connector: vLLM KV connector (``NixlConnector``, ``ExampleConnector``, ...).
        kv_connector_extra: its ``kv_connector_extra_config``, unchanged.
        kv_transfer_fields: more top-level ``KVTransferConfig`` fields; may
            override the role's ``kv_role``.
        chat_template: a Jinja chat template (the text) replacing the model's.
        engine_args: vLLM engine arguments, as on ``vllm serve``'s command line.
    """

    ec_connector: str | None = None
    ec_connector_extra: Mapping[str, Any] | None = None
    ec_transfer_fields: Mapping[str, Any] | None = None
    kv_connector: str | None = None
    kv_connector_extra: Mapping[str, Any] | None = None
    kv_transfer_fields: Mapping[str, Any] | None = None
    chat_template: str | None = None
    engine_args: tuple[str, ...] = ()


# ---------------------------------------------------------------- role -> engine args


def _transfer_config(
    kind: str,
    connector: str,
    role: str,
    extra: Mapping[str, Any] | None,
    fields: Mapping[str, Any] | None,
    own: frozenset[str],
) -> dict[str, Any]:
    config: dict[str, Any] = {f"{kind}_connector": connector, f"{kind}_role": role}
    if fields:
        clash = sorted(own & fields.keys())
        if clash:
            raise ConfigError(
                f"--{kind}-transfer-fields may not set {', '.join(clash)}: "
                f"use --{kind}-connector and --{kind}-connector-extra"
            )
        config.update(fields)
    if extra is not None:
        config[f"{kind}_connector_extra_config"] = dict(extra)
    return config


def _refuse(options: VllmOptions, kind: str, role: Role) -> None:
    given = [
        f"--{kind}-{name}"
        for name in ("connector", "connector-extra", "transfer-fields")
        if getattr(options, f"{kind}_{name.replace('-', '_')}") is not None
    ]
    if given:
        raise ConfigError(
            f"a {role.value} worker uses no {kind.upper()} connector: drop {given[0]}"
        )


def _ec(options: VllmOptions, ec_role: str) -> dict[str, Any]:
    assert options.ec_connector is not None
    return _transfer_config(
        "ec",
        options.ec_connector,
        ec_role,
        options.ec_connector_extra,
        options.ec_transfer_fields,
        _EC_OWN_FIELDS,
    )


def _kv(options: VllmOptions, kv_role: str, role: Role) -> dict[str, Any]:
    if options.kv_connector is None:
        raise ConfigError(f"a {role.value} worker needs --kv-connector (e.g. NixlConnector)")
    return _transfer_config(
        "kv",
        options.kv_connector,
        kv_role,
        options.kv_connector_extra,
        options.kv_transfer_fields,
        _KV_OWN_FIELDS,
    )


def _check_orphans(options: VllmOptions) -> None:
    for kind in ("ec", "kv"):
        if getattr(options, f"{kind}_connector") is None:
            for name in ("connector_extra", "transfer_fields"):
                if getattr(options, f"{kind}_{name}") is not None:
                    option = f"--{kind}-{name.replace('_', '-')}"
                    raise ConfigError(f"{option} needs --{kind}-connector")


def engine_args_for_role(role: Role, model: str, options: VllmOptions) -> dict[str, Any]:
    """The vLLM engine arguments (``AsyncEngineArgs`` field -> value) that ``role`` needs.

    Transfer configs are plain dicts (as vLLM's command line takes them as JSON).
    The arguments after ``--`` are not included: see :func:`engine_cli_args`.

    Raises:
        ConfigError: a connector the role needs is missing, or one it cannot use
            is given; the message names the option.
    """
    role = Role(role)
    _check_orphans(options)
    args: dict[str, Any] = {"model": model}
    if role == Role.ENCODE:
        if options.ec_connector is None:
            raise ConfigError("an encode worker needs --ec-connector (e.g. ECExampleConnector)")
        _refuse(options, "kv", role)
        args["ec_transfer_config"] = _ec(options, "ec_producer")
        args["mm_encoder_only"] = True
        args["enable_prefix_caching"] = False
    elif role == Role.PREFILL:
        if options.ec_connector is not None:
            args["ec_transfer_config"] = _ec(options, "ec_consumer")
        args["kv_transfer_config"] = _kv(options, "kv_producer", role)
    elif role == Role.DECODE:
        _refuse(options, "ec", role)
        args["kv_transfer_config"] = _kv(options, "kv_consumer", role)
    else:
        _refuse(options, "kv", role)
        if options.ec_connector is not None:
            args["ec_transfer_config"] = _ec(options, "ec_consumer")
    return args


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _option_name(token: str) -> str:
    """``--kv_transfer_config.kv_role=x`` -> ``--kv-transfer-config`` (vLLM's spellings)."""
    name = token.split("=", 1)[0].split(".", 1)[0]
    return "--" + name[2:].replace("_", "-")


def engine_cli_args(role: Role, model: str, options: VllmOptions) -> list[str]:
    """vLLM engine arguments as a command line: the role's, then the pass-through ones.

    vLLM's own parser reads the result, so values mean exactly what they mean
    on ``vllm serve``'s command line.

    Raises:
        ConfigError: as :func:`engine_args_for_role`, or a pass-through argument
            sets something the role decides (``--model``, a transfer config, ...).
    """
    argv: list[str] = []
    managed: set[str] = set()
    for name, value in engine_args_for_role(role, model, options).items():
        flag = _flag(name)
        managed |= {flag, "--no-" + flag[2:]}
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + flag[2:])
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value, separators=(",", ":"))]
        else:
            argv += [flag, str(value)]
    for token in options.engine_args:
        if token.startswith("--") and _option_name(token) in managed:
            raise ConfigError(
                f"vLLM engine argument {token.split('=', 1)[0]} is set by the worker "
                f"for role {Role(role).value}; use the worker's own options instead"
            )
    return argv + list(options.engine_args)


# ---------------------------------------------------------------- command line


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``--engine vllm`` options, and the engine arguments after ``--``."""
    group = parser.add_argument_group(
        "vLLM engine (--engine vllm)", "see docs/worker.md, section 'The vLLM engine'"
    )
    for kind, example in (("ec", "ECExampleConnector"), ("kv", "NixlConnector")):
        config = "ECTransferConfig" if kind == "ec" else "KVTransferConfig"
        group.add_argument(
            f"--{kind}-connector",
            metavar="NAME",
            default=None,
            help=f"vLLM {kind.upper()} connector, e.g. {example}",
        )
        group.add_argument(
            f"--{kind}-connector-extra",
            metavar="JSON",
            default=None,
            help=f"its {kind}_connector_extra_config (a JSON object), passed unchanged",
        )
        group.add_argument(
            f"--{kind}-transfer-fields",
            metavar="JSON",
            default=None,
            help=f"more top-level {config} fields (a JSON object)",
        )
    group.add_argument(
        "--chat-template",
        metavar="FILE",
        default=None,
        help="a Jinja chat template replacing the model's (for chat prompts)",
    )
    group.add_argument(
        "engine_args",
        nargs="*",
        metavar="-- VLLM_ARG",
        help="after --: vLLM engine arguments, passed unchanged "
        "(e.g. -- --dtype float32 --enforce-eager --max-model-len 512)",
    )


def _json_object(text: str | None, option: str) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{option}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{option}: must be a JSON object, got {type(value).__name__}")
    return value


def vllm_options_from_args(ns: argparse.Namespace) -> VllmOptions:
    """Build :class:`VllmOptions` from the options :func:`add_vllm_arguments` added.

    Reads the ``--chat-template`` file.  Options missing from ``ns`` are unset.

    Raises:
        ConfigError: bad JSON, an unreadable template file; names the option.
    """
    template_path = getattr(ns, "chat_template", None)
    template: str | None = None
    if template_path is not None:
        try:
            with open(template_path, encoding="utf-8") as handle:
                template = handle.read()
        except OSError as exc:
            raise ConfigError(f"--chat-template: {exc}") from None
    values: dict[str, Any] = {}
    for kind in ("ec", "kv"):
        values[f"{kind}_connector"] = getattr(ns, f"{kind}_connector", None)
        for name in ("connector_extra", "transfer_fields"):
            option = f"--{kind}-{name.replace('_', '-')}"
            values[f"{kind}_{name}"] = _json_object(getattr(ns, f"{kind}_{name}", None), option)
    return VllmOptions(
        **values,
        chat_template=template,
        engine_args=tuple(getattr(ns, "engine_args", None) or ()),
    )


def check_vllm_installed() -> None:
    """Raise ``ConfigError`` with install instructions when vLLM cannot be imported."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(VLLM_MISSING)

"""Command-line options of the simulator engine: ``--sim-<knob>`` for every SimConfig field.

The options are generated from :func:`~epd_actors.simulator.config.sim_knobs`, so a new knob is one
field in :class:`~epd_actors.simulator.config.SimConfig` and nothing here.  Values are checked twice
with the same rules: while argparse parses (``parser.error`` names the option)
and again in :func:`sim_config_from_args` (``ConfigError`` names the option), so
a namespace built by hand cannot slip past either.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .config import SimConfig, sim_knobs
from .store import create_sim_stores

if TYPE_CHECKING:
    from collections.abc import Callable

    from .config import Knob
    from .store import SimStores

STORE_DIR_OPTION = "--sim-store-dir"


def option_name(knob_name: str) -> str:
    """The command-line option of a SimConfig field: ``stall_s`` -> ``--sim-stall-s``."""
    return "--sim-" + knob_name.replace("_", "-")


def _dest(knob_name: str) -> str:
    return f"sim_{knob_name}"


def _argument_type(knob: Knob) -> Callable[[str], object]:
    parse = knob.spec.parse
    assert parse is not None

    def convert(text: str) -> object:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}") from None
        problem = knob.spec.check(value)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return value

    convert.__name__ = knob.name
    return convert


def _format_default(value: object) -> str:
    if value is None:
        return "off"
    if isinstance(value, bool):
        return "on" if value else "off"
    return value if isinstance(value, str) else repr(value)


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--sim-store-dir`` and one ``--sim-*`` option per SimConfig knob to ``parser``.

    Defaults are SimConfig's, so ``sim_config_from_args(parser.parse_args([]))``
    equals ``SimConfig()``.
    """
    group = parser.add_argument_group(
        "simulator engine (--engine sim)", "see docs/simulator.md for the model and each knob"
    )
    group.add_argument(
        STORE_DIR_OPTION,
        dest="sim_store_dir",
        metavar="DIR",
        default=None,
        help="share encoder-cache and KV stores through this directory (give every "
        "simulated worker on the machine the same one); default: in-process memory",
    )
    for knob in sim_knobs():
        text = f"{knob.spec.doc} (default: {_format_default(knob.default)})".replace("%", "%%")
        if knob.spec.parse is None:
            group.add_argument(
                option_name(knob.name),
                dest=_dest(knob.name),
                action=argparse.BooleanOptionalAction,
                default=knob.default,
                help=text,
            )
            continue
        group.add_argument(
            option_name(knob.name),
            dest=_dest(knob.name),
            type=_argument_type(knob),
            default=knob.default,
            metavar=knob.spec.metavar or None,
            help=text,
        )


def sim_config_from_args(ns: argparse.Namespace) -> SimConfig:
    """Build a :class:`SimConfig` from options added by :func:`add_sim_arguments`.

    Options missing from ``ns`` take their defaults.

    Raises:
        ConfigError: a value is invalid; the message names the option.
    """
    values: dict[str, Any] = {}
    for knob in sim_knobs():
        value = getattr(ns, _dest(knob.name), knob.default)
        problem = knob.spec.check(value)
        if problem is not None:
            raise ConfigError(f"{option_name(knob.name)}: {problem}")
        values[knob.name] = value
    return SimConfig(**values)


def sim_stores_from_args(ns: argparse.Namespace) -> SimStores:
    """The stores ``--sim-store-dir`` asks for (in memory when it is absent)."""
    return create_sim_stores(getattr(ns, "sim_store_dir", None))


def sim_args_from_config(config: SimConfig) -> list[str]:
    """Command-line options that reproduce ``config`` (only knobs off their default).

    Used to start simulated worker processes with the same configuration.
    """
    args: list[str] = []
    for knob in sim_knobs():
        value = getattr(config, knob.name)
        if value == knob.default:
            continue
        option = option_name(knob.name)
        if isinstance(value, bool):
            args.append(option if value else "--no-" + option.removeprefix("--"))
        elif value is None:
            args += [option, "off"]
        elif isinstance(value, float) and math.isinf(value):
            args += [option, "inf"]
        else:
            args += [option, str(value)]
    return args

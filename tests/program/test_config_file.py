"""The TOML configuration: every error names its key; the example file is valid."""

from __future__ import annotations

from pathlib import Path

import pytest

from epd_actors.errors import ConfigError
from epd_actors.program.check_config import check_topology, describe
from epd_actors.program.cli import main
from epd_actors.program.config_file import load_config, parse_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "epd.toml"
ENV = {"EPD_AUTH_TOKEN": "tok", "EPD_API_KEYS": "k1, k2", "EPD_ADMIN_KEY": "adm"}

MINIMAL = """
[pools.pd]
workers = [{ id = "pd0", address = "tcp://127.0.0.1:9000" }]
"""


def test_example_file_is_valid_and_complete() -> None:
    config = load_config(EXAMPLE, environ=ENV)
    router, server = config.router, config.server
    assert [p.stage for p in router.pools] == ["encode", "prefill", "decode"]
    assert router.auth_token == "tok"
    assert server.http.api_keys == ("k1", "k2")
    assert server.ws.api_keys == ("k1", "k2")
    assert server.http.admin_keys == ("adm",)
    assert server.ws_listen == "127.0.0.1:8001"
    assert router.pool("encode") is not None
    text = describe(config)
    assert "encode -> prefill -> decode" in text
    assert "consistent_hash" in text


def test_defaults_of_a_minimal_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(MINIMAL)
    config = load_config(path, environ={})
    assert config.router.auth_token == ""
    assert config.router.pools[0].policy is None  # the stage actor's default_policy applies
    assert config.server.http_listen == "127.0.0.1:8000"
    assert config.server.http.api_keys == ()
    assert config.server.drain_timeout_s == 30.0
    assert config.server.http.fields.unknown == config.server.ws.fields.unknown == "reject"


def test_a_pool_takes_its_policy_s_options(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        MINIMAL.replace("[pools.pd]", '[pools.pd]\npolicy = "cache_aware"')
        + "[pools.pd.policy_options]\ncache_threshold = 0.3\nbalance_abs_threshold = 64\n"
    )
    (pool,) = load_config(path, environ={}).router.pools
    assert (pool.policy, dict(pool.policy_options)) == (
        "cache_aware",
        {"cache_threshold": 0.3, "balance_abs_threshold": 64},
    )
    # Options of a pool's default policy are checked where the default is known: when the
    # pools are built (check-config and serve do that before anything starts).
    path.write_text(MINIMAL + "[pools.pd.policy_options]\nthreshold = 1\n")
    with pytest.raises(ConfigError, match=r"pools\.pd\.policy: .*no option threshold"):
        check_topology(load_config(path, environ={}))


def test_unknown_fields_forward_reaches_both_front_ends(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(MINIMAL + '[server]\nunknown_fields = "forward"\n')
    config = load_config(path, environ={})
    assert config.server.http.fields.unknown == config.server.ws.fields.unknown == "forward"


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ("[server]\nidel_timeout_s = 3\n", "server.idel_timeout_s"),
        ("[server.http]\nkeep_alive_timeout_s = -1\n", "server.http.keep_alive_timeout_s"),
        ("[server.ws]\nmax_generations = 'x'\n", "server.ws.max_generations"),
        ("[server.http]\napi_keys = ['k']\n", "server.http.api_keys"),
        ("[server]\ndrain_timeout_s = 0\n", "server.drain_timeout_s"),
        ("[server.http]\nmax_body_bytes = 'big'\n", "server.http.max_body_bytes"),
        ("[server]\naccess_log = 1\n", "server.access_log"),
        ("[server]\nunknown_fields = 'drop'\n", "server.unknown_fields"),
        ("[server]\nhttp_listen = 'nowhere'\n", "server.http_listen"),
        (
            "[server.media]\nallowed_url_prefixes = ['ftp://x/']\n",
            "server.media.allowed_url_prefixes",
        ),
        ("[deadlines]\nrequest_timeout_s = 0\n", "deadlines.request_timeout_s"),
        ("[deadlines]\nencode_timeout_s = 0\n", "deadlines.encode_timeout_s"),
        ("[deadlines]\nprefill_timeout_s = -1\n", "deadlines.prefill_timeout_s"),
        ("[actors]\nmax_jobs = 0\n", "actors.max_jobs"),
        ("[pools.pd]\npolicy = 'fastest'\n", "pools.pd.policy"),
        (
            "[pools.pd]\nworkers = [{ id = 'x', address = 'http://a' }]\n",
            "pools.pd.workers[0].address",
        ),
        ("[pools.pd]\nworkers = [{ id = 'x' }]\n", "pools.pd.workers[0].address"),
        (
            "[pools.pd]\nworkers = [{ id = 'x', address = 'tcp://h:1', backend = 'grpc' }]\n",
            "pools.pd.workers[0].backend",
        ),
        ("auth_token_env = 'MISSING_VARIABLE'\n", "auth_token_env"),
        ("auth_token = 'a'\nauth_token_env = 'B'\n", "auth_token"),
        ("colour = 'blue'\n", "colour"),
    ],
    ids=lambda value: value if "." in value or value.isidentifier() else None,
)
def test_errors_name_the_offending_key(extra: str, key: str) -> None:
    import tomllib

    if extra.startswith("[pools.pd]"):
        text = extra
    else:
        text = MINIMAL + extra if extra.startswith("[") else extra + MINIMAL
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        parse_config(tomllib.loads(text), environ={})


def test_duplicate_worker_ids_are_refused() -> None:
    import tomllib

    text = """
[pools.prefill]
workers = [{ id = "w", address = "tcp://127.0.0.1:1" }]
[pools.decode]
workers = [{ id = "w", address = "tcp://127.0.0.1:2" }]
"""
    with pytest.raises(ConfigError, match=r"pools.decode.workers\[0\].id"):
        parse_config(tomllib.loads(text), environ={})


def test_check_config_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.toml"
    good.write_text(MINIMAL)
    assert main(["check-config", str(good)]) == 0
    assert "topology:   pd" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text("[pools.prefill]\nworkers = []\n")
    assert main(["check-config", str(bad)]) == 2
    assert "pools" in capsys.readouterr().err
    broken = tmp_path / "broken.toml"
    broken.write_text("[pools\n")
    assert main(["check-config", str(broken)]) == 2
    assert "invalid TOML" in capsys.readouterr().err


def test_every_settable_key_is_documented() -> None:
    import dataclasses

    from epd_actors.core.config import ActorLimits, AdmissionLimits, Deadlines
    from epd_actors.core.health import HealthPolicy
    from epd_actors.core.retry import RetryPolicy
    from epd_actors.frontends.http_app import HttpSettings
    from epd_actors.frontends.ws import WsSettings
    from epd_actors.openai.media import MediaLimits

    docs = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    # set from elsewhere: keys, media tables, `fields` from `[server] unknown_fields`,
    # `cors` from `[server] allowed_origins`
    internal = {"api_keys", "admin_keys", "media", "policy", "access_log", "fields", "cors"}
    assert "`api_key` /" in docs
    from epd_actors.backends.native.settings import NativeSettings
    from epd_actors.backends.openai_http.settings import OpenAIHttpSettings
    from epd_actors.core.fleet.settings import SharedSettings

    classes = (
        ActorLimits, AdmissionLimits, Deadlines, HttpSettings, MediaLimits, WsSettings,
        HealthPolicy, RetryPolicy, NativeSettings, OpenAIHttpSettings, SharedSettings,
    )  # fmt: skip
    missing = [
        f"{cls.__name__}.{f.name}"
        for cls in classes
        for f in dataclasses.fields(cls)
        if f.name not in internal and f"`{f.name}`" not in docs
    ]
    assert missing == []


def test_backend_settings_sections(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        MINIMAL
        + "[native]\nheartbeat_interval_s = 0.5\nheartbeat_timeout_s = 2\n"
        + "[openai_http]\nrelease_policy = 'consume'\napi_key_env = 'VLLM_KEY'\n"
    )
    config = load_config(path, environ={"VLLM_KEY": "sekret"})
    assert config.router.native.heartbeat_interval_s == 0.5
    assert config.router.openai_http.release_policy == "consume"
    assert config.router.openai_http.api_key == "sekret"
    path.write_text(MINIMAL + "[native]\nheartbeat_timeout_s = 0.1\n")
    with pytest.raises(ConfigError, match="native"):
        load_config(path, environ={})


@pytest.mark.parametrize(
    "path",
    sorted((EXAMPLE.parent).rglob("*.toml")),
    ids=lambda p: str(p.relative_to(EXAMPLE.parent)),
)
def test_every_example_config_is_valid(path: Path) -> None:
    from epd_actors.program.check_config import check_topology

    check_topology(load_config(path, environ=ENV))


def test_the_stage_deadlines_are_read(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(MINIMAL + "[deadlines]\nencode_timeout_s = 7\nprefill_timeout_s = 9.5\n")
    deadlines = load_config(path).router.deadlines
    assert (deadlines.encode_timeout_s, deadlines.prefill_timeout_s) == (7.0, 9.5)
    assert deadlines.first_token_timeout_s == 120.0

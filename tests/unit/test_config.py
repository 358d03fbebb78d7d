"""load_settings: the YAML file, then LLM_SUPERVISOR_* variables, then CLI overrides; later wins."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from supervisor.config import ConfigError, DeclaredGpu, Settings, load_settings
from tests.launch import free_port

REPO = Path(__file__).resolve().parents[2]


def config_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "supervisor.yaml"
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def test_no_sources_gives_the_defaults() -> None:
    settings = load_settings(None, environ={})
    assert settings == Settings()
    assert settings.port == 11435
    assert settings.default_keep_alive == 300.0
    assert settings.gpus is None


def test_the_real_environment_is_ignored_when_environ_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_SUPERVISOR_PORT", "1")
    assert load_settings(None, environ={}).port == 11435


def test_the_environment_beats_the_file_and_overrides_beat_both(tmp_path: Path) -> None:
    path = config_file(
        tmp_path,
        """
        host: 0.0.0.0
        port: 1000
        max_queue: 5
        log_level: debug
        """,
    )
    environ = {"LLM_SUPERVISOR_PORT": "2000", "LLM_SUPERVISOR_MAX_QUEUE": "7"}
    settings = load_settings(path, environ=environ, overrides={"port": 3000})
    assert settings.host == "0.0.0.0"  # file only
    assert settings.log_level == "debug"  # file only
    assert settings.max_queue == 7  # environment over file
    assert settings.port == 3000  # override over both


def test_file_alone_and_environment_alone_apply(tmp_path: Path) -> None:
    path = config_file(tmp_path, "port: 1000\n")
    assert load_settings(path, environ={}).port == 1000
    assert load_settings(None, environ={"LLM_SUPERVISOR_PORT": "2000"}).port == 2000


def test_a_none_override_does_not_mask_lower_sources(tmp_path: Path) -> None:
    path = config_file(tmp_path, "port: 1000\nlog_format: json\n")
    settings = load_settings(path, environ={}, overrides={"port": None, "log_format": None, "host": None})
    assert (settings.port, settings.log_format, settings.host) == (1000, "json", "127.0.0.1")


def test_variables_without_the_prefix_are_ignored() -> None:
    assert load_settings(None, environ={"PORT": "1", "SUPERVISOR_PORT": "2"}).port == 11435


def test_gpus_from_the_environment_parse_as_yaml() -> None:
    settings = load_settings(None, environ={"LLM_SUPERVISOR_GPUS": "[{index: 0, total_mib: 8192}]"})
    assert settings.gpus == (DeclaredGpu(index=0, total_mib=8192),)
    assert settings.gpus[0].name == "simulated GPU"


def test_environment_values_are_typed_by_yaml() -> None:
    environ = {
        "LLM_SUPERVISOR_DEFAULT_KEEP_ALIVE": "-1",
        "LLM_SUPERVISOR_QUEUE_TIMEOUT_S": "2.5",
        "LLM_SUPERVISOR_LOG_FORMAT": "json",
    }
    settings = load_settings(None, environ=environ)
    assert settings.default_keep_alive == math.inf
    assert settings.queue_timeout_s == 2.5
    assert settings.log_format == "json"


def test_host_and_paths_from_the_environment_stay_strings() -> None:
    environ = {
        "LLM_SUPERVISOR_HOST": "::1",
        "LLM_SUPERVISOR_MANIFESTS": "123",
        "LLM_SUPERVISOR_STATE_DIR": "null",
    }
    settings = load_settings(None, environ=environ)
    assert settings.host == "::1"
    assert settings.manifests == Path("123")
    assert settings.state_dir == Path("null")


def test_keep_alive_in_the_file_accepts_durations(tmp_path: Path) -> None:
    assert load_settings(
        config_file(tmp_path, "default_keep_alive: 1h30m\n"), environ={}
    ).default_keep_alive == (5400.0)


def test_relative_paths_in_the_file_resolve_against_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "etc"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)
    path = config_file(folder, "manifests: models.d\nstate_dir: run/state\n")
    settings = load_settings(path, environ={})
    assert settings.manifests == folder / "models.d"
    assert settings.state_dir == folder / "run" / "state"


def test_absolute_paths_in_the_file_are_kept(tmp_path: Path) -> None:
    path = config_file(tmp_path, "manifests: /srv/manifests\n")
    assert load_settings(path, environ={}).manifests == Path("/srv/manifests")


def test_paths_from_the_environment_and_overrides_are_not_rebased(tmp_path: Path) -> None:
    path = config_file(tmp_path, "manifests: here\n")
    assert load_settings(path, environ={"LLM_SUPERVISOR_MANIFESTS": "rel"}).manifests == Path("rel")
    settings = load_settings(path, environ={}, overrides={"manifests": Path("cli")})
    assert settings.manifests == Path("cli")


@pytest.mark.parametrize("text", ["", "# only a comment\n"])
def test_an_empty_file_gives_the_defaults(tmp_path: Path, text: str) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text(text, encoding="utf-8")
    assert load_settings(path, environ={}) == Settings()


@pytest.mark.parametrize(
    ("source", "field"),
    [
        ({"file": "port: 70000\n"}, "port"),
        ({"file": "gpu_margin_mib: -1\n"}, "gpu_margin_mib"),
        ({"file": "default_keep_alive: soon\n"}, "default_keep_alive"),
        ({"env": {"LLM_SUPERVISOR_PORT": "http"}}, "port"),
        ({"env": {"LLM_SUPERVISOR_LOG_LEVEL": "loud"}}, "log_level"),
        ({"env": {"LLM_SUPERVISOR_GPUS": "[{index: 0, total_mib: 0}]"}}, "gpus.0.total_mib"),
        ({"env": {"LLM_SUPERVISOR_GPUS": "[{index: -1, total_mib: 1}]"}}, "gpus.0.index"),
        ({"overrides": {"queue_timeout_s": 0}}, "queue_timeout_s"),
        ({"overrides": {"log_format": "xml"}}, "log_format"),
        ({"file": "advertise_url: https://node-a:11435\n"}, "advertise_url"),
        ({"env": {"LLM_SUPERVISOR_ADVERTISE_URL": "node-a:11435"}}, "advertise_url"),
    ],
)
def test_a_bad_value_raises_config_error_naming_the_field(
    tmp_path: Path, source: dict[str, Any], field: str
) -> None:
    path = config_file(tmp_path, source["file"]) if "file" in source else None
    with pytest.raises(ConfigError, match="invalid settings") as info:
        load_settings(path, environ=source.get("env", {}), overrides=source.get("overrides"))
    assert f"{field}:" in str(info.value)


def test_a_config_file_that_is_not_yaml_is_refused_without_quoting_its_lines(tmp_path: Path) -> None:
    """PyYAML quotes the line of its error: here the Redis URL with its password."""
    secret = "redis://:pa55w0rd-for-redis@redis:6379/0"
    path = config_file(tmp_path, f"port: 8080\nredis_url: {secret}: x\n")
    with pytest.raises(ConfigError, match=r"invalid YAML at line 2, column \d+") as info:
        load_settings(path, environ={})
    assert "pa55w0rd" not in str(info.value)


def test_a_path_setting_given_null_in_the_file_is_its_default(tmp_path: Path) -> None:
    """README's example writes `api_keys_file: null`; it became <the config's folder>/None, and the daemon
    refused to start: it could not read that keys file (a review helper)."""
    path = config_file(tmp_path, "api_keys_file: null\nhf_cache: null\nstore_dir: null\n")
    settings = load_settings(path, environ={})
    assert settings.api_keys_file is None
    assert settings.hf_cache is None
    assert settings.store_dir is None


def test_an_unknown_key_in_the_file_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="prot") as info:
        load_settings(config_file(tmp_path, "prot: 8080\n"), environ={})
    assert "Extra inputs are not permitted" in str(info.value)


def test_an_unknown_prefixed_variable_is_rejected() -> None:
    with pytest.raises(ConfigError, match="colour"):
        load_settings(None, environ={"LLM_SUPERVISOR_COLOUR": "blue"})


def test_an_unknown_key_in_a_declared_gpu_is_rejected(tmp_path: Path) -> None:
    path = config_file(tmp_path, "gpus:\n  - {index: 0, total_mib: 1024, vendor: x}\n")
    with pytest.raises(ConfigError, match=r"gpus\.0\.vendor"):
        load_settings(path, environ={})


def test_a_file_that_is_not_a_mapping_is_rejected(tmp_path: Path) -> None:
    path = config_file(tmp_path, "- port: 1\n")
    with pytest.raises(ConfigError, match="must be a mapping") as info:
        load_settings(path, environ={})
    assert str(path) in str(info.value)


def test_invalid_yaml_in_the_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    path = config_file(tmp_path, "port: [1\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert str(path) in str(info.value)


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.yaml"):
        load_settings(tmp_path / "missing.yaml", environ={})


def test_malformed_yaml_in_a_variable_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"LLM_SUPERVISOR_GPUS|gpus"):
        load_settings(None, environ={"LLM_SUPERVISOR_GPUS": "[{index: 0, total_mib: 8192"})


def test_restart_only_settings_are_real_fields() -> None:
    assert set(Settings.RESTART_ONLY) <= set(Settings.model_fields)


@pytest.mark.parametrize(
    "url", ["http://node-a:11435", "http://10.0.0.7", "http://[fd00::7]:8080/", "http://a/b"]
)
def test_an_http_advertise_url_is_accepted(url: str) -> None:
    assert load_settings(None, environ={"LLM_SUPERVISOR_ADVERTISE_URL": url}).advertise_url == url


@pytest.mark.parametrize("name", ["API_KEY", "NODE_KEY"])
def test_a_key_given_directly_is_as_long_as_a_keys_files(name: str) -> None:
    """A keys file's `key` must have 16 characters; `api_key` (an admin key) took one, and with it the
    daemon listened beyond loopback. The refusal does not show the key."""
    with pytest.raises(ConfigError, match="at least 16 characters") as refused:
        load_settings(None, {f"LLM_SUPERVISOR_{name}": "s3cret"})
    assert "s3cret" not in str(refused.value)
    assert load_settings(None, {f"LLM_SUPERVISOR_{name}": "s3cret-0123456789"})


def test_a_bad_value_is_reported_where_it_was_set(tmp_path: Path) -> None:
    """`queue_timeout_s: soon` in the file gave "invalid settings: queue_timeout_s: ...", naming neither
    the file nor the line, and a reload was refused with that alone."""
    config = tmp_path / "config.yaml"
    config.write_text("port: 8080\n\nqueue_timeout_s: soon\n")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(config))}:3: queue_timeout_s: "):
        load_settings(config, environ={})
    with pytest.raises(ConfigError, match=r"\$LLM_SUPERVISOR_MAX_QUEUE: max_queue: "):
        load_settings(None, environ={"LLM_SUPERVISOR_MAX_QUEUE": "many"})


def test_keys_and_the_redis_url_lose_the_newline_a_file_leaves_on_them(tmp_path: Path) -> None:
    """`openssl rand -hex 24 > api-key.txt`, then a Kubernetes Secret or an EnvironmentFile: the key ended
    in a newline that no client can send in a header, and every request was a 401 while /health/ready said
    200. The CLI strips it; so does the daemon now."""
    key = "0123456789abcdef0123456789abcdef"
    settings = load_settings(
        None,
        environ={
            "LLM_SUPERVISOR_API_KEY": key + "\n",
            "LLM_SUPERVISOR_NODE_KEY": key + "\r\n",
            "LLM_SUPERVISOR_REDIS_URL": "redis://127.0.0.1:6379/0\n",
        },
    )
    assert settings.api_key is not None
    assert settings.api_key.get_secret_value() == key
    assert settings.node_key is not None
    assert settings.node_key.get_secret_value() == key
    assert settings.redis_url is not None
    assert settings.redis_url.get_secret_value() == "redis://127.0.0.1:6379/0"


def test_the_client_commands_url_variable_does_not_stop_the_daemon() -> None:
    """README: the client commands take `--url`, default $LLM_SUPERVISOR_URL. Exported for them, it made
    `serve` refuse to start (`url: Extra inputs are not permitted`)."""
    assert (
        load_settings(None, environ={"LLM_SUPERVISOR_URL": "http://127.0.0.1:11435"}).port == Settings().port
    )


@pytest.mark.parametrize("host", ["0.0.0.0:11435", "127.0.0.1:8080", "http://0.0.0.0", "a b", "[::1"])
def test_a_host_with_a_port_or_that_is_no_address_is_refused_in_words(host: str) -> None:
    """`0.0.0.0:11435` (written as OLLAMA_HOST is) ended the daemon in a traceback from urlsplit, or was
    blamed on a missing API key."""
    with pytest.raises(
        ConfigError, match=r"host: .*not an IP address or a host name \(a port goes in `port`\)"
    ):
        load_settings(None, environ={"LLM_SUPERVISOR_HOST": host})


@pytest.mark.parametrize(
    ("given", "kept"), [("[::1]", "::1"), ("::", "::"), ("gpu-box.local", "gpu-box.local"), ("", "")]
)
def test_a_host_may_be_an_address_in_brackets_or_a_name(given: str, kept: str) -> None:
    settings = load_settings(None, environ={"LLM_SUPERVISOR_HOST": given})
    assert settings.host == kept
    assert "[[" not in settings.advertised_url()


def test_config_file_paths_expand_home_and_variables_as_manifest_paths_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`state_dir: ~/llm-state` was the folder `~/llm-state` beside the config."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MODELS_ROOT", str(tmp_path / "models"))
    config = tmp_path / "config.yaml"
    config.write_text("state_dir: ~/llm-state\nmanifests: $MODELS_ROOT/manifests\n")
    settings = load_settings(config, environ={})
    assert settings.state_dir == tmp_path / "home" / "llm-state"
    assert settings.manifests == tmp_path / "models" / "manifests"


def test_host_and_origin_lists_from_the_environment_are_comma_separated() -> None:
    """`LLM_SUPERVISOR_ALLOWED_HOSTS=gpu-box.local` was "Input should be a valid tuple", and
    `*.example.com` (a pattern the README describes) a YAML alias error. A YAML list still works."""
    settings = load_settings(
        None,
        environ={
            "LLM_SUPERVISOR_ALLOWED_HOSTS": "gpu-box.local, *.example.com",
            "LLM_SUPERVISOR_ALLOWED_ORIGINS": '["http://a.example"]',
        },
    )
    assert settings.allowed_hosts == ("gpu-box.local", "*.example.com")
    assert settings.allowed_origins == ("http://a.example",)


def _serve(tmp_path: Path, **config: object) -> subprocess.CompletedProcess[str]:
    (tmp_path / "manifests").mkdir(exist_ok=True)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "manifests": str(tmp_path / "manifests"),
                "state_dir": str(tmp_path / "state"),
                "gpus": [{"index": 0, "total_mib": 4096}],
                **config,
            }
        )
    )
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "serve", "--config", str(cfg), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


@pytest.mark.parametrize(
    "url",
    [
        "redis://:hunter2-password@redis-host:notaport/0",
        "http://:hunter2-password@redis-host:6379/0",
        "redis://:hunter2-password@:6379/0",
    ],
)
def test_a_malformed_redis_url_is_a_one_line_config_error_not_a_traceback(tmp_path: Path, url: str) -> None:
    """A redis_url that redis-py cannot parse passed validation, and the daemon died in Redis.from_url:
    exit 1 and a traceback, where every other bad setting is one `invalid settings` line (exit 2). The
    password is in neither."""
    done = _serve(tmp_path, redis_url=url, node_id="n1")
    output = done.stdout + done.stderr
    assert "Traceback" not in output, output[-1500:]
    assert done.returncode == 2, output[-1500:]
    assert "redis_url" in output
    assert "hunter2-password" not in output

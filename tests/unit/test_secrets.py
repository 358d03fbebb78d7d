"""One rule for secrets, used by every answer and every log event; paths only for those who may see them."""

from __future__ import annotations

import json
import re
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

from supervisor import logs, secrets
from supervisor.api.ollama_models import modelfile
from supervisor.manifests import LlamaServerManifest, VllmManifest
from supervisor.model_info import ModelInfo
from workers.base import Endpoint, LaunchSpec
from workers.process import ChildProcess, reap_orphans


@pytest.mark.parametrize(
    "name",
    [
        "HF_TOKEN",
        "--hf-token",
        "--api-key",
        "x-api-key",
        "apiKey",
        "Authorization",
        "DB_PASSWORD",
        "api_keys",
    ],
)
def test_names_that_say_secret_are_secret(name: str) -> None:
    assert secrets.is_secret_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "max_tokens",
        "prompt_tokens",
        "--max-num-batched-tokens",
        "tokenizer",
        "--api-key-file",
        "key_name",
        "n_keep",
    ],
)
def test_names_that_count_point_at_or_merely_resemble_secrets_are_not(name: str) -> None:
    assert not secrets.is_secret_name(name)


def test_the_value_of_a_secret_flag_is_masked_in_both_spellings() -> None:
    args = ["--api-key", "k1", "--hf-token=k2", "--temp", "0.5", "--hf-token", "--verbose"]
    assert secrets.redact_args(args) == [
        "--api-key",
        "***",
        "--hf-token=***",
        "--temp",
        "0.5",
        "--hf-token",
        "--verbose",  # a flag, not a value: nothing to hide
    ]


def test_a_short_secret_flag_and_a_hugging_face_token_are_masked_too() -> None:
    """llama-server's -hft (its --hf-token) named no secret word: the token showed in /api/show's
    modelfile to any key allowed the model, in the admin document and in the log."""
    token = "hf_" + "a1B2" * 9
    assert secrets.redact_args(["-hft", token, "-c", "512"]) == ["-hft", "***", "-c", "512"]
    assert secrets.redact_args(["--some-flag", f"x{token}"]) == ["--some-flag", "x***"]
    assert token not in secrets.scrub(f"main: -hft {token} -m model.gguf")


def test_every_env_value_is_masked_whatever_its_name() -> None:
    assert secrets.redact_env({"HF_TOKEN": "x", "CUDA_LAUNCH_BLOCKING": "1"}) == {
        "HF_TOKEN": "***",
        "CUDA_LAUNCH_BLOCKING": "***",
    }


def test_free_text_loses_named_values_and_bearer_tokens() -> None:
    text = (
        "argv: --hf-token abc123 HF_TOKEN=def456 {'api_key': 'ghi789'} Authorization: Bearer jkl max_tokens=5"
    )
    scrubbed = secrets.scrub(text)
    for secret in ("abc123", "def456", "ghi789", "jkl"):
        assert secret not in scrubbed
    assert "max_tokens=5" in scrubbed
    assert secrets.scrub("load: EOS token = 2 '</s>'") == "load: EOS token = 2 '</s>'"  # an id, not a secret


def test_a_password_in_a_url_is_masked_and_the_rest_of_the_url_kept() -> None:
    scrubbed = secrets.scrub("at https://u:s3cret@hub.example/x (refused)")
    assert scrubbed == "at https://u:***@hub.example/x (refused)"
    assert secrets.scrub("redis://:pw12345@10.0.0.1:6379/0") == "redis://:***@10.0.0.1:6379/0"
    for kept in ("http://host:8080/path", "see http://a.b:1/x@y", "user@example.com: hi"):
        assert secrets.scrub(kept) == kept


_PIECES = ["Bearer", "basic", "--api-key", "-k", "token", "HF_TOKEN", "abc123", "x", "'", '"', "-", "/"]
_PIECES += [".", ":", "=", " ", "\t", "\u00a0", "\n", "{", "}"]


@given(st.lists(st.sampled_from(_PIECES), max_size=12).map("".join))
def test_text_with_no_space_colon_or_equals_skips_the_patterns_and_loses_nothing(text: str) -> None:
    # The shortcut in scrub: each pattern needs whitespace (any, as \s has it), a `:` or a `=`.
    assert secrets.scrub(text) == secrets.mask_named_values(text)


def test_the_shortcut_tells_every_character_as_the_pattern_does() -> None:
    # Its string methods must say "may name a secret" for every character that \s, `:` or `=` matches,
    # alone and amid printable text: every code point of Unicode.
    pattern = re.compile(r"[\s:=]")
    for point in range(sys.maxunicode + 1):
        char = chr(point)
        if pattern.match(char):
            assert secrets._may_name_a_secret(char), hex(point)
            assert secrets._may_name_a_secret(f"abc{char}def"), hex(point)


@given(st.text(max_size=40))
def test_the_shortcut_agrees_with_the_pattern(text: str) -> None:
    assert secrets._may_name_a_secret(text) == bool(re.search(r"[\s:=]", text))


def test_a_bearer_token_after_a_non_breaking_space_is_still_masked() -> None:
    assert "abc123" not in secrets.scrub("Bearer\u00a0abc123")


def test_a_remembered_secret_is_masked_anywhere_until_forgotten() -> None:
    secrets.remember("the-childs-key-0123")
    try:
        assert secrets.scrub("line with the-childs-key-0123 inside") == "line with *** inside"
    finally:
        secrets.forget("the-childs-key-0123")
    assert "the-childs-key-0123" in secrets.scrub("the-childs-key-0123")


def test_a_log_event_masks_by_field_name_and_shape_but_keeps_counts() -> None:
    event = secrets.redact_event(
        None,
        "info",
        {
            "event": "child_started",
            "argv": ["llama-server", "--hf-token", "tok"],
            "env": {"A": "b"},
            "token": "t",
            "key": "alice",  # the access log names the key; a key itself is masked wherever it appears
            "headers": {"Authorization": "Bearer x", "Accept": "*/*"},
            "api_keys": 3,
            "port": 8080,
        },
    )
    assert event == {
        "event": "child_started",
        "argv": ["llama-server", "--hf-token", "***"],
        "env": {"A": "***"},
        "token": "***",
        "key": "alice",
        "headers": {"Authorization": "***", "Accept": "*/*"},
        "api_keys": 3,
        "port": 8080,
    }


@pytest.fixture
def configured_logs() -> Iterator[None]:
    logs.configure("json", "debug")
    yield
    structlog.reset_defaults()


def test_the_configured_logger_masks_secrets(configured_logs: None) -> None:
    event: Any = {"event": "child_started", "argv": ["x", "--api-key", "sekrit-value"], "env": {"K": "v"}}
    for processor in structlog.get_config()["processors"]:  # the chain as configured, up to the JSON line
        event = processor(None, "info", event)
    line = json.loads(event)
    assert line["argv"] == ["x", "--api-key", "***"]
    assert line["env"] == {"K": "***"}


def test_paths_and_urls_are_cut_for_those_who_may_not_see_internals() -> None:
    document = {"reason": "model file /srv/models/demo.gguf not found", "hub": "https://hub.internal:8080/x"}
    assert secrets.shown(document, sees_internals=False) == {
        "reason": "model file demo.gguf not found",
        "hub": "<url>",
    }
    assert secrets.shown(document, sees_internals=True) == document


def llama(**fields: object) -> LlamaServerManifest:
    return LlamaServerManifest.model_validate(
        {"name": "demo", "engine": "llama-server", "model": "/srv/models/demo.gguf", **fields}
    )


def test_a_manifest_document_masks_env_and_secret_args_and_cuts_paths() -> None:
    manifest = llama(
        env={"HF_TOKEN": "envsecret"},
        args=["--hf-token", "argsecret", "--mmproj", "/srv/models/mmproj.gguf"],
        library_path=["/opt/cuda/lib"],
    )
    document = secrets.manifest_document(manifest, sees_internals=False)
    assert document["env"] == {"HF_TOKEN": "***"}
    assert document["args"] == ["--hf-token", "***", "--mmproj", "mmproj.gguf"]
    assert document["model"] == "demo.gguf"
    assert document["library_path"] == ["lib"]
    admin = secrets.manifest_document(manifest, sees_internals=True)
    assert admin["model"] == "/srv/models/demo.gguf"
    assert admin["env"] == {"HF_TOKEN": "***"}  # secrets stay hidden even from an admin


def test_a_vllm_commands_secret_flag_values_are_masked_as_args_are() -> None:
    """A vLLM manifest's `command` is an argv too: `--hf-token X` split over two items matched none of
    the free-text patterns, so /api/show and /v1/admin/models showed the token until the first start."""
    token = "hf_cmd_s3cret_0123456789"
    manifest = VllmManifest.model_validate(
        {
            "name": "v",
            "engine": "vllm",
            "model": "org/name",
            "command": ["vllm", "serve", "--hf-token", token],
        }
    )
    document = secrets.manifest_document(manifest, sees_internals=True)
    assert document["command"] == ["vllm", "serve", "--hf-token", "***"]


def test_the_modelfile_shows_file_names_and_no_secret() -> None:
    manifest = llama(env={"HF_TOKEN": "envsecret"}, args=["--hf-token=argsecret"])
    text = modelfile(manifest, ModelInfo(), "/etc/llm/manifests/demo.yaml")
    assert "FROM demo.gguf\n" in text
    assert "from demo.yaml;" in text
    assert "/srv" not in text
    assert "/etc" not in text
    assert "envsecret" not in text
    assert "argsecret" not in text
    assert "FROM /srv/models/demo.gguf\n" in modelfile(manifest, ModelInfo(), None, sees_internals=True)


def test_a_hub_repo_id_is_not_a_path() -> None:
    manifest = VllmManifest.model_validate({"name": "v", "engine": "vllm", "model": "org/model"})
    assert "FROM org/model\n" in modelfile(manifest, ModelInfo(), None)


async def test_a_childs_key_file_is_private_and_goes_with_the_child(tmp_path: Path) -> None:
    key_file = tmp_path / "keys" / "k.key"
    spec = LaunchSpec(
        argv=[sys.executable, "-c", "import time; time.sleep(30)", "--hf-token", "argsecret"],
        env={},
        api_key="the-childs-key-4567",
        files={key_file: "the-childs-key-4567\n"},
    )
    child = await ChildProcess.spawn("demo", spec, Endpoint(port=1), tmp_path)
    assert child.api_key == "the-childs-key-4567"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert key_file.read_text() == "the-childs-key-4567\n"
    (record,) = [json.loads(p.read_text()) for p in (tmp_path / "children").glob("*.json")]
    assert "argsecret" not in json.dumps(record)
    assert secrets.scrub("the-childs-key-4567") == "***"  # masked in the log while the child lives
    await child.stop(2.0)
    assert not key_file.exists()
    assert secrets.scrub("the-childs-key-4567") == "the-childs-key-4567"


async def test_reaping_a_dead_daemons_child_removes_its_key_file(tmp_path: Path) -> None:
    key_file = tmp_path / "keys" / "k.key"
    key_file.parent.mkdir()
    key_file.write_text("k")
    (tmp_path / "children").mkdir()
    record = {"pid": 999_999_999, "create_time": 0.0, "model": "demo", "argv": [], "files": [str(key_file)]}
    (tmp_path / "children" / "999999999.json").write_text(json.dumps(record))
    await reap_orphans(tmp_path, 1.0)
    assert not key_file.exists()


def test_a_file_named_like_a_secret_keeps_the_words_after_it() -> None:
    """`api_keys.yaml: cannot read the keys file` was logged as `api_keys.yaml: *** read the keys file`:
    every error about a keys file so named lost its first word."""
    line = "/etc/llm/api_keys.yaml: cannot read the keys file: [Errno 2] No such file"
    assert secrets.scrub(line) == line
    assert secrets.scrub("api_key: hunter2hunter2") == "api_key: ***"

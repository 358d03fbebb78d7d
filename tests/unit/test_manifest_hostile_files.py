"""Manifest files that are not what they seem: a FIFO or a device named *.yaml, an editor's lock file, values
exec() cannot carry, paths of the wrong type, `foo` beside `foo:latest`, YAML merge keys. Each is
refused with its file (and line), or loads as meant; none hangs a reload or grows memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.manifests import (
    LlamaServerManifest,
    ManifestError,
    ManifestLoadError,
    load_directory,
    load_files,
    ollama_name,
    with_stored,
)
from tests.unit.test_manifests import write


def _load_in_child(directory: Path, timeout_s: float) -> tuple[bool, str]:
    """load_directory(directory) in a child process limited to 1 GiB of memory and `timeout_s`:
    (finished, what it printed). A child, not a thread, so that a read that never ends is killed."""
    script = (
        "import resource, sys; from pathlib import Path\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "from supervisor.manifests import load_directory, ManifestLoadError\n"
        "try:\n"
        "    load_directory(Path(sys.argv[1])); print('LOADED')\n"
        "except ManifestLoadError as exc:\n"
        "    print('REFUSED'); print(exc)\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", script, str(directory)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=Path(__file__).resolve().parents[2],
        )
    except subprocess.TimeoutExpired:
        return False, ""
    return True, done.stdout + done.stderr


def test_a_fifo_named_like_a_manifest_is_an_error_not_a_hang(tmp_path: Path) -> None:
    """A FIFO (or a link to /dev/stdin, a character device...) in manifests/ is opened and read like a
    file: the read blocks for ever. At start-up the daemon never listens; on SIGHUP or a watch_manifests
    reload the reload's thread never returns, so the main loop never takes another signal (SIGTERM
    included) and asyncio's default executor can never be shut down."""
    write(tmp_path, "a.yaml", "{name: a, engine: llama-server, model: /a.gguf}\n")
    os.mkfifo(tmp_path / "b.yaml")
    finished, output = _load_in_child(tmp_path, 10)
    assert finished, "load_directory blocked reading a FIFO named b.yaml"
    assert output.startswith("REFUSED"), output
    assert "b.yaml" in output, output


def test_a_link_to_an_endless_device_is_an_error_not_unbounded_memory(tmp_path: Path) -> None:
    """`x.yaml -> /dev/zero` is read to the end: it has none, so the daemon's memory grows until the OOM
    killer ends it (every engine with it). A manifest is small: a size cap (or only regular files)
    keeps a mistake from taking the daemon down."""
    write(tmp_path, "a.yaml", "{name: a, engine: llama-server, model: /a.gguf}\n")
    (tmp_path / "z.yaml").symlink_to("/dev/zero")
    finished, output = _load_in_child(tmp_path, 10)
    assert finished, "load_directory was still reading /dev/zero after 10 s"
    # (Under the child's 1 GiB limit the endless read ends in a MemoryError traceback: the daemon's dies.)
    assert output.startswith("REFUSED"), output[-500:]
    assert "z.yaml" in output, output[-500:]


def test_a_model_and_another_named_with_latest_are_not_both_accepted(tmp_path: Path) -> None:
    """`foo` and `foo:latest` (or an alias `foo:latest` of another model) are accepted as two models, but
    Ollama lists `foo` as `foo:latest`: /api/tags shows two `foo:latest` entries, and either one an
    Ollama client (Open WebUI) picks is served by the other model. Either the load is refused naming
    the file, or every model's Ollama name finds that model."""
    write(tmp_path, "a.yaml", "{name: foo, engine: llama-server, model: /a.gguf}\n")
    write(tmp_path, "b.yaml", "{name: bar, engine: llama-server, model: /b.gguf, aliases: ['foo:latest']}\n")
    write(tmp_path, "c.yaml", "{name: baz, engine: llama-server, model: /c.gguf}\n")
    write(tmp_path, "d.yaml", "{name: 'baz:latest', engine: llama-server, model: /d.gguf}\n")
    with pytest.raises(ManifestLoadError) as refused:
        load_directory(tmp_path)
    assert {e.file.name for e in refused.value.errors} == {"b.yaml", "d.yaml"}


def _refused(tmp_path: Path, line: str) -> list[ManifestError]:
    """The errors of a manifest with `line` (a `field: value`) in place of that field of a plain one."""
    fields = {"name": "m", "engine": "llama-server", "model": "/m.gguf"}
    key = line.split(":", 1)[0]
    write(tmp_path, "m.yaml", "".join(f"{k}: {v}\n" for k, v in fields.items() if k != key) + line + "\n")
    with pytest.raises(ManifestLoadError) as info:
        load_directory(tmp_path)
    return info.value.errors


@pytest.mark.parametrize(
    "line",
    ["model: [a.gguf]", "model: {a: 1}", "binary: [x]", "library_path: [[x]]"],
)
def test_a_path_field_of_the_wrong_type_is_refused_with_its_line(tmp_path: Path, line: str) -> None:
    """Path fields pass any value through str(): `model: [a.gguf]` becomes the file "['a.gguf']" beside
    the manifest, accepted by `check` and by a reload; the error only comes at load time, as 'model file
    .../['a.gguf'] not found', with no file or line. Every other field refuses a wrong type."""
    key = line.split(":", 1)[0]
    assert any(
        e.field is not None and e.field.startswith(key) and e.line is not None
        for e in _refused(tmp_path, line)
    )


@pytest.mark.parametrize(
    "fields",
    [
        'env: {X: "a\\0b"}',
        'env: {"A=B": "1"}',
        'env: {"": "1"}',
        'args: ["--alias", "a\\0b"]',
        'model: "/models/a\\0b.gguf"',
    ],
)
def test_what_the_kernel_cannot_exec_is_refused_with_its_line(tmp_path: Path, fields: str) -> None:
    """A NUL byte in env, args or a path, or an env name with `=` or empty, passed validation. The daemon
    spawns under uvloop, which hands argv and env to exec as C strings: each is cut at the NUL, and
    `A=B` becomes variable A. So the checks that refuse `--api-key`/`--host`/`--port` in args and
    LLAMA_API_KEY in env were bypassed by `--api-key\\0` or `LLAMA_API_KEY=k\\0`. What exec cannot carry
    is refused with the file and line."""
    assert any(e.line is not None for e in _refused(tmp_path, fields))


@pytest.mark.parametrize("field", ["served_model_name", "quantization", "kv_cache_dtype"])
def test_a_nul_in_a_vllm_flag_value_is_refused_with_its_line(tmp_path: Path, field: str) -> None:
    """Each becomes a flag's value on vLLM's command line: a NUL there passed `check` and a reload, and
    the load then failed as a 503 with no file or line."""
    write(tmp_path, "v.yaml", f'{{name: v, engine: vllm, model: org/m, {field}: "a\\0b"}}\n')
    with pytest.raises(ManifestLoadError) as refused:
        load_directory(tmp_path)
    assert [(e.field, e.line) for e in refused.value.errors] == [(field, 1)]


def test_a_yaml_merge_key_override_is_not_a_field_given_twice(tmp_path: Path) -> None:
    """The usual way to share settings between the models of one file (`<<: *base` then the fields
    that differ) is refused: PyYAML flattens the merge into the node, and the duplicate-key check then
    reports `name` as 'given twice; give each field once' on a line that gives it once."""
    write(
        tmp_path,
        "m.yaml",
        """
        - &base
          name: small
          engine: llama-server
          model: /m.gguf
          ctx_size: 2048
        - <<: *base
          name: large
          ctx_size: 8192
        """,
    )
    models = load_directory(tmp_path).models
    assert [(m.name, m.ctx_size) for m in models.values() if isinstance(m, LlamaServerManifest)] == [
        ("small", 2048),
        ("large", 8192),
    ]


def test_an_editor_lock_file_does_not_refuse_every_reload(tmp_path: Path) -> None:
    """Emacs marks a modified buffer of demo.yaml with a dangling link `.#demo.yaml` (to
    user@host.pid:time). Its suffix is .yaml, so while anyone has a manifest open with unsaved changes,
    every SIGHUP is refused ('cannot read .#demo.yaml'), and with watch_manifests the lock's appearance
    itself triggers a refused reload. Hidden files are not manifests (a ConfigMap's own entries are
    `..data` and the like)."""
    write(tmp_path, "demo.yaml", "{name: demo, engine: llama-server, model: /a.gguf}\n")
    (tmp_path / ".#demo.yaml").symlink_to("someone@host.1234:1700000000")
    assert list(load_directory(tmp_path).models) == ["demo"]


@pytest.mark.parametrize("line", ["manifests: [a, b]", "state_dir: {x: 1}", "api_keys_file: [k]"])
def test_a_settings_path_of_the_wrong_type_is_refused_with_its_line(tmp_path: Path, line: str) -> None:
    """The same in the daemon's config: load_settings joins str(value) to the config's folder before
    validation, so `state_dir: {x: 1}` is the folder "{'x': 1}" beside the config (created at start), and
    `manifests: [a, b]` the folder "['a', 'b']"."""
    from supervisor.config import ConfigError, load_settings

    config = write(tmp_path, "config.yaml", line + "\n")
    with pytest.raises(ConfigError) as info:
        load_settings(config, environ={})
    assert "config.yaml:1" in str(info.value)


def write_file(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_pulled_model_and_a_manifest_named_with_latest_are_not_both_served(tmp_path: Path) -> None:
    """`foo` and `foo:latest` are one name between a manifest and a pulled model too: a manifest
    `hf.co/org/repo:latest` and the pulled `hf.co/org/repo` were both kept, and /api/tags listed
    `hf.co/org/repo:latest` twice, served by the manifest's model whichever entry a client picked."""
    files = tmp_path / "manifests"
    files.mkdir()
    registry = load_files(
        [
            write_file(
                files / "a.yaml", "{name: 'hf.co/org/repo:latest', engine: llama-server, model: /a.gguf}\n"
            )
        ]
    )
    stored_file = write_file(
        tmp_path / "stored.yaml", "{name: 'hf.co/org/repo', engine: llama-server, model: /b.gguf}\n"
    )
    stored = load_files([stored_file]).models["hf.co/org/repo"]
    merged = with_stored(registry, [(stored, stored_file, ["hf.co/org/repo", "org/repo"])])
    listed = [ollama_name(name) for name in merged.models]
    assert len(listed) == len(set(listed)), f"/api/tags would list {listed}"

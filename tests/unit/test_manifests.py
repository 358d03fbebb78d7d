"""Manifest loading: YAML files to a Registry, errors located by file, line, model and field; diffs."""

from __future__ import annotations

import json
import math
import os
import textwrap
from pathlib import Path

import pytest

from supervisor import secrets
from supervisor.manifests import (
    LlamaServerManifest,
    ManifestError,
    ManifestLoadError,
    Registry,
    VllmManifest,
    diff,
    json_schema,
    load_directory,
    load_files,
    ollama_name,
)


def write(directory: Path, filename: str, text: str) -> Path:
    path = directory / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def load_errors(directory: Path) -> list[ManifestError]:
    with pytest.raises(ManifestLoadError) as info:
        load_directory(directory)
    assert str(info.value) == "\n".join(str(e) for e in info.value.errors)
    return info.value.errors


def only_error(directory: Path) -> ManifestError:
    errors = load_errors(directory)
    assert len(errors) == 1, errors
    return errors[0]


def manifest(name: str = "m", **fields: object) -> LlamaServerManifest:
    values: dict[str, object] = {"name": name, "engine": "llama-server", "model": "/x.gguf", **fields}
    return LlamaServerManifest.model_validate(values)


# --- loading valid files ---------------------------------------------------------------------------


def test_a_file_with_one_mapping_is_one_model(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "qwen.yaml",
        """
        name: qwen
        engine: llama-server
        model: /models/qwen.gguf
        ctx_size: 4096
        parallel: 2
        args: ["--flash-attn", "on"]
        env: {GGML_VK_VISIBLE_DEVICES: "0"}
        """,
    )
    registry = load_directory(tmp_path)
    assert list(registry.models) == ["qwen"]
    m = registry.models["qwen"]
    assert m.engine == "llama-server"
    assert m.model == Path("/models/qwen.gguf")
    assert m.ctx_size == 4096
    assert m.parallel == 2
    assert m.args == ("--flash-attn", "on")
    assert m.env == {"GGML_VK_VISIBLE_DEVICES": "0"}
    assert m.keep_alive is None
    assert m.priority == 0
    assert not m.pinned
    assert registry.sources == {"qwen": path}


def test_a_file_with_a_list_holds_several_models(tmp_path: Path) -> None:
    write(
        tmp_path,
        "all.yml",
        """
        - name: a
          engine: llama-server
          model: /a.gguf
        - name: b
          engine: llama-server
          model: /b.gguf
          aliases: [bee]
        """,
    )
    registry = load_directory(tmp_path)
    assert sorted(registry.models) == ["a", "b"]
    assert registry.aliases == {"bee": "b"}


@pytest.mark.parametrize("text", ["", "\n\n", "# nothing here yet\n# name: x\n", "[]\n"])
def test_an_empty_or_comment_only_file_holds_no_models(tmp_path: Path, text: str) -> None:
    (tmp_path / "empty.yaml").write_text(text, encoding="utf-8")
    write(tmp_path, "real.yaml", "{name: real, engine: llama-server, model: /r.gguf}\n")
    assert list(load_directory(tmp_path).models) == ["real"]


def test_only_yaml_files_in_the_directory_are_read(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", "{name: a, engine: llama-server, model: /a.gguf}\n")
    write(tmp_path, "b.yml", "{name: b, engine: llama-server, model: /b.gguf}\n")
    write(tmp_path, "notes.txt", "not: [valid yaml\n")
    write(tmp_path, "c.yaml.bak", "name: c\n")
    (tmp_path / "dir.yaml").mkdir()
    assert sorted(load_directory(tmp_path).models) == ["a", "b"]


def test_a_missing_directory_is_an_error(tmp_path: Path) -> None:
    error = only_error(tmp_path / "nope")
    assert error.file == tmp_path / "nope"
    assert error.line is None
    assert "not found" in str(error)


def test_load_files_reads_exactly_the_files_given(tmp_path: Path) -> None:
    a = write(tmp_path, "a.yaml", "{name: a, engine: llama-server, model: /a.gguf}\n")
    write(tmp_path, "b.yaml", "{name: b, engine: llama-server, model: /b.gguf}\n")
    assert list(load_files([a]).models) == ["a"]
    assert load_files([]) == Registry()


# --- errors, located -------------------------------------------------------------------------------


def test_unknown_key_is_rejected_with_its_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "m.yaml",
        """
        # a typo on line 5
        name: m
        engine: llama-server
        model: /m.gguf
        ctx_sise: 4096
        """,
    )
    error = only_error(tmp_path)
    assert (error.file, error.line, error.model, error.field) == (path, 5, "m", "ctx_sise")
    assert str(error).startswith(f"{path}:5:")
    assert "model 'm'" in str(error)
    assert "field 'ctx_sise'" in str(error)
    assert "Extra inputs are not permitted" in str(error)


def test_wrong_type_names_file_line_model_and_field(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "m.yaml",
        """
        - name: ok
          engine: llama-server
          model: /ok.gguf
        - name: big-one
          engine: llama-server
          model: /m.gguf
          ctx_size: big
        """,
    )
    error = only_error(tmp_path)
    assert (error.file, error.line, error.model, error.field) == (path, 7, "big-one", "ctx_size")
    text = str(error)
    assert text.startswith(f"{path}:7:")
    assert "model 'big-one'" in text
    assert "field 'ctx_size'" in text
    assert "integer" in text


def test_a_nested_error_points_at_the_element(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "m.yaml",
        """
        name: m
        engine: llama-server
        model: /m.gguf
        args:
          - --ok
          - [not, a, string]
        """,
    )
    error = only_error(tmp_path)
    assert error.field == "args.1"
    assert error.line == 6
    assert str(error).startswith(f"{path}:6:")


def test_a_missing_required_field_points_at_the_model(tmp_path: Path) -> None:
    write(
        tmp_path,
        "m.yaml",
        """
        - name: a
          engine: llama-server
          model: /a.gguf
        - name: nomodel
          engine: llama-server
        """,
    )
    error = only_error(tmp_path)
    assert (error.line, error.model, error.field) == (4, "nomodel", "model")
    assert "Field required" in str(error)


def test_a_bad_keep_alive_names_the_field(tmp_path: Path) -> None:
    write(tmp_path, "m.yaml", "name: m\nengine: llama-server\nmodel: /m.gguf\nkeep_alive: soon\n")
    error = only_error(tmp_path)
    assert (error.line, error.field) == (4, "keep_alive")
    assert "'soon'" in error.message


def test_every_error_in_every_file_is_reported(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", "name: a\nengine: llama-server\nmodel: /a.gguf\nparallel: 0\nbogus: 1\n")
    write(tmp_path, "b.yaml", "name: b\nengine: nope\nmodel: /b.gguf\n")
    errors = load_errors(tmp_path)
    assert sorted((e.file.name, e.line, e.field) for e in errors) == [
        ("a.yaml", 4, "parallel"),
        ("a.yaml", 5, "bogus"),
        ("b.yaml", 2, "engine"),
    ]


def test_unknown_engine_is_rejected_listing_the_known_ones(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "m.yaml",
        """
        name: m
        model: /m.gguf
        engine: ollama
        """,
    )
    error = only_error(tmp_path)
    assert (error.file, error.line, error.model, error.field) == (path, 3, "m", "engine")
    assert "unknown engine 'ollama'" in str(error)
    assert "llama-server" in str(error)


def test_a_missing_engine_is_said_to_be_missing(tmp_path: Path) -> None:
    """It said "unknown engine None"."""
    (tmp_path / "m.yaml").write_text("# no engine\nname: m\nmodel: /m.gguf\n", encoding="utf-8")
    error = only_error(tmp_path)
    assert (error.line, error.field) == (2, "engine")
    assert error.message.startswith("`engine` is missing; known engines: llama-server")


def test_a_list_entry_that_is_not_a_mapping_is_rejected(tmp_path: Path) -> None:
    write(tmp_path, "m.yaml", "- name: a\n  engine: llama-server\n  model: /a.gguf\n- just a string\n")
    error = only_error(tmp_path)
    assert error.line == 4
    assert "mapping" in error.message


def test_invalid_yaml_syntax_gives_file_and_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "m.yaml",
        """
        name: m
        engine: llama-server
        model: "/m.gguf
        ctx_size: 4096
        """,
    )
    error = only_error(tmp_path)
    assert error.file == path
    assert error.line is not None
    assert error.line >= 3
    assert str(error).startswith(f"{path}:{error.line}: invalid YAML")


def test_a_bad_indent_is_invalid_yaml_on_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, "m.yaml", "name: m\nengine: llama-server\n  model: /m.gguf\n")
    error = only_error(tmp_path)
    assert (error.file, error.line) == (path, 3)
    assert "invalid YAML" in error.message


def test_several_yaml_documents_in_one_file_are_rejected(tmp_path: Path) -> None:
    write(tmp_path, "m.yaml", "name: a\n---\nname: b\n")
    error = only_error(tmp_path)
    assert "invalid YAML" in error.message


def test_a_file_that_is_not_utf8_cannot_be_read(tmp_path: Path) -> None:
    (tmp_path / "m.yaml").write_bytes(b"name: \xff\xfe\n")
    error = only_error(tmp_path)
    assert "cannot read" in error.message


def test_duplicate_name_across_two_files_names_both(tmp_path: Path) -> None:
    first = write(tmp_path, "1.yaml", "{name: dup, engine: llama-server, model: /a.gguf}\n")
    second = write(tmp_path, "2.yaml", "{name: dup, engine: llama-server, model: /b.gguf}\n")
    error = only_error(tmp_path)
    assert error.file == second
    assert error.model == "dup"
    assert "'dup' is already used by model 'dup'" in error.message
    assert str(first) in error.message


def test_an_alias_colliding_with_another_models_name_names_both(tmp_path: Path) -> None:
    first = write(tmp_path, "1.yaml", "{name: llama, engine: llama-server, model: /a.gguf}\n")
    second = write(
        tmp_path, "2.yaml", "{name: qwen, engine: llama-server, model: /b.gguf, aliases: [llama]}\n"
    )
    error = only_error(tmp_path)
    assert error.file == second
    text = str(error)
    assert "model 'qwen'" in text
    assert "already used by model 'llama'" in text
    assert str(first) in text


def test_a_name_colliding_with_an_earlier_alias_names_the_alias_owner(tmp_path: Path) -> None:
    first = write(tmp_path, "1.yaml", "{name: qwen, engine: llama-server, model: /a.gguf, aliases: [chat]}\n")
    write(tmp_path, "2.yaml", "{name: chat, engine: llama-server, model: /b.gguf}\n")
    error = only_error(tmp_path)
    assert error.model == "chat"
    assert "'chat' is already used by model 'qwen'" in error.message
    assert str(first) in error.message


def test_two_models_sharing_an_alias_is_an_error(tmp_path: Path) -> None:
    write(tmp_path, "1.yaml", "{name: a, engine: llama-server, model: /a.gguf, aliases: [chat]}\n")
    write(tmp_path, "2.yaml", "{name: b, engine: llama-server, model: /b.gguf, aliases: [chat]}\n")
    error = only_error(tmp_path)
    assert (error.model, error.file.name) == ("b", "2.yaml")
    assert "'chat' is already used by model 'a'" in error.message


@pytest.mark.parametrize("name", ["", "-leading-dash", "has space", "x" * 201])
def test_bad_model_names_are_rejected(tmp_path: Path, name: str) -> None:
    write(tmp_path, "m.yaml", f"{{name: {json.dumps(name)}, engine: llama-server, model: /m.gguf}}\n")
    assert only_error(tmp_path).field == "name"


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--api-key", "sekrit"], "--api-key"),
        (["--api-key=sekrit"], "--api-key"),
        (["--api-key-file", "sekrit.txt"], "--api-key-file"),
        # llama-server reads a long flag's `_` as `-`: these passed the check and set the child's key.
        (["--api_key", "sekrit"], "--api_key"),
        (["--api_key_file", "sekrit.txt"], "--api_key_file"),
    ],
)
def test_a_key_in_args_is_refused_because_the_daemon_owns_it(
    tmp_path: Path, args: list[str], flag: str
) -> None:
    """A key of the manifest's own would lock the daemon out of its child (every Ollama route a 401)."""
    write(
        tmp_path, "m.yaml", f"{{name: m, engine: llama-server, model: /m.gguf, args: {json.dumps(args)}}}\n"
    )
    error = only_error(tmp_path)
    assert error.field == "args"
    assert f"args must not set {flag}; the daemon gives each child its own key" in error.message
    assert "sekrit" not in str(error)
    # As the daemon logs it (reload_rejected): `--api-key: the daemon ...` read as a secret's field,
    # and the log said `--api-key: *** daemon gives each child its own key`.
    assert secrets.scrub(error.message) == error.message


@pytest.mark.parametrize("args", [["--host", "0.0.0.0"], ["--port=8080"]])
def test_where_llama_server_listens_is_the_daemons_to_say(tmp_path: Path, args: list[str]) -> None:
    """A `--host` or `--port` of the manifest's own would win over the daemon's, which then never reaches
    its child; on 0.0.0.0 it would open the child to the network."""
    write(
        tmp_path, "m.yaml", f"{{name: m, engine: llama-server, model: /m.gguf, args: {json.dumps(args)}}}\n"
    )
    error = only_error(tmp_path)
    assert error.field == "args"
    assert "the supervisor picks where the child listens" in error.message


@pytest.mark.parametrize("name", ["LLAMA_API_KEY", "LLAMA_ARG_API_KEY_FILE", "VLLM_API_KEY"])
def test_an_engine_key_in_env_is_refused(tmp_path: Path, name: str) -> None:
    write(tmp_path, "m.yaml", f"{{name: m, engine: llama-server, model: /m.gguf, env: {{{name}: sekrit}}}}\n")
    error = only_error(tmp_path)
    assert error.field == "env"
    assert f"env must not set {name}" in error.message
    assert "sekrit" not in str(error)
    assert secrets.scrub(error.message) == error.message


# --- paths, durations --------------------------------------------------------------------------------


def test_relative_model_path_resolves_against_the_manifests_directory(tmp_path: Path) -> None:
    write(
        tmp_path / "manifests",
        "m.yaml",
        """
        name: m
        engine: llama-server
        model: ../models/m.gguf
        binary: bin/llama-server
        library_path: lib
        """,
    )
    m = load_directory(tmp_path / "manifests").models["m"]
    assert m.model == tmp_path / "models" / "m.gguf"
    assert m.binary == tmp_path / "manifests" / "bin" / "llama-server"
    assert m.library_path == (tmp_path / "manifests" / "lib",)


def test_absolute_model_path_is_kept(tmp_path: Path) -> None:
    write(tmp_path, "m.yaml", "{name: m, engine: llama-server, model: /srv/m.gguf}\n")
    assert load_directory(tmp_path).models["m"].model == Path("/srv/m.gguf")


def test_home_and_variables_expand_in_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MODELS_UNDER_TEST", str(tmp_path / "store"))
    write(
        tmp_path,
        "m.yaml",
        """
        - {name: a, engine: llama-server, model: ~/a.gguf}
        - {name: b, engine: llama-server, model: $MODELS_UNDER_TEST/b.gguf}
        """,
    )
    models = load_directory(tmp_path).models
    assert models["a"].model == tmp_path / "home" / "a.gguf"
    assert models["b"].model == tmp_path / "store" / "b.gguf"


@pytest.mark.parametrize(
    ("raw", "seconds"), [("5m", 300.0), ("1h30m", 5400.0), ("-1", math.inf), ("0", 0.0), ("90", 90.0)]
)
def test_keep_alive_strings_are_parsed_to_seconds(tmp_path: Path, raw: str, seconds: float) -> None:
    write(tmp_path, "m.yaml", f'{{name: m, engine: llama-server, model: /m.gguf, keep_alive: "{raw}"}}\n')
    assert load_directory(tmp_path).models["m"].keep_alive == seconds


def test_keep_alive_numbers_are_seconds(tmp_path: Path) -> None:
    write(tmp_path, "m.yaml", "{name: m, engine: llama-server, model: /m.gguf, keep_alive: -1}\n")
    assert load_directory(tmp_path).models["m"].keep_alive == math.inf


# --- the registry ------------------------------------------------------------------------------------


def registry_of(*manifests: LlamaServerManifest) -> Registry:
    return Registry(
        models={m.name: m for m in manifests},
        aliases={a: m.name for m in manifests for a in m.aliases},
        sources={m.name: Path(f"/manifests/{m.name}.yaml") for m in manifests},
    )


def test_resolve_finds_a_model_by_name_alias_and_latest_tag() -> None:
    qwen = manifest("qwen2.5:7b", aliases=("chat",))
    other = manifest("other")
    registry = registry_of(qwen, other)
    assert registry.resolve("qwen2.5:7b") is qwen
    assert registry.resolve("chat") is qwen
    assert registry.resolve("qwen2.5:7b:latest") is qwen
    assert registry.resolve("chat:latest") is qwen
    assert registry.resolve("other:latest") is other
    assert registry.resolve("qwen2.5") is None
    assert registry.resolve("missing") is None
    assert registry.resolve("") is None


def test_a_name_ending_in_latest_resolves_to_itself() -> None:
    tagged = manifest("m:latest")
    assert registry_of(tagged).resolve("m:latest") is tagged


def test_resolve_finds_a_name_in_any_case_unless_it_names_two_models() -> None:
    # A pulled model answers to the hub's spelling and to the lower-case name it was pulled by: two names
    # of one model that fold alike. A lookup in yet another case finds it.
    pulled = manifest("hf.co/Org/Repo:Q4_K_M", aliases=("Org/Repo:Q4_K_M", "hf.co/org/repo:Q4_K_M"))
    registry = registry_of(pulled)
    assert registry.resolve("hf.co/org/repo:q4_k_m") is pulled
    assert registry.resolve("HF.CO/ORG/REPO:Q4_K_M") is pulled
    assert registry.resolve("org/repo:q4_k_m") is pulled
    # Two models whose names fold alike: neither is found by a third spelling.
    upper, lower = manifest("Demo"), manifest("demo")
    both = registry_of(upper, lower)
    assert both.resolve("Demo") is upper
    assert both.resolve("demo") is lower
    assert both.resolve("DEMO") is None


def test_resolve_works_on_a_loaded_registry(tmp_path: Path) -> None:
    write(tmp_path, "m.yaml", "{name: m, engine: llama-server, model: /m.gguf, aliases: [mm, em]}\n")
    registry = load_directory(tmp_path)
    m = registry.models["m"]
    assert registry.resolve("mm") is m
    assert registry.resolve("em:latest") is m


# --- diff ------------------------------------------------------------------------------------------


def test_diff_of_identical_registries_is_empty() -> None:
    old = registry_of(manifest("a"), manifest("b"))
    new = registry_of(manifest("a"), manifest("b"))
    d = diff(old, new)
    assert (d.added, d.removed, d.restarted, d.updated) == ((), (), (), ())


def test_diff_classifies_added_removed_restarted_and_updated() -> None:
    old = registry_of(
        manifest("gone"),
        manifest("same"),
        manifest("ctx", ctx_size=2048),
        manifest("live", keep_alive=300, priority=0, aliases=("x",)),
    )
    new = registry_of(
        manifest("same"),
        manifest("ctx", ctx_size=4096),
        manifest("live", keep_alive="10m", priority=5, aliases=("y", "z")),
        manifest("fresh"),
    )
    d = diff(old, new)
    assert d.added == ("fresh",)
    assert d.removed == ("gone",)
    assert d.restarted == ("ctx",)
    assert d.updated == ("live",)


@pytest.mark.parametrize(
    "change",
    [
        {"keep_alive": 60},
        {"priority": 3},
        {"aliases": ("a2",)},
        {"description": "now described"},
        {"pinned": True},
    ],
)
def test_changing_only_a_live_field_is_an_update(change: dict[str, object]) -> None:
    d = diff(registry_of(manifest("m")), registry_of(manifest("m", **change)))
    assert (d.restarted, d.updated) == ((), ("m",))


@pytest.mark.parametrize(
    "change",
    [
        {"ctx_size": 8192},
        {"parallel": 2},
        {"model": "/other.gguf"},
        {"args": ("--flash-attn", "on")},
        {"env": {"A": "1"}},
        {"vram_mib": 1024},
        {"binary": "/opt/llama-server"},
        {"start_timeout_s": 5},
        {"cpus": str(min(os.sched_getaffinity(0)))},
    ],
)
def test_changing_how_the_child_is_launched_is_a_restart(change: dict[str, object]) -> None:
    d = diff(registry_of(manifest("m")), registry_of(manifest("m", **change)))
    assert (d.restarted, d.updated) == (("m",), ())


def test_a_launch_change_with_a_live_change_is_still_a_restart() -> None:
    d = diff(registry_of(manifest("m")), registry_of(manifest("m", ctx_size=1, priority=9)))
    assert (d.restarted, d.updated) == (("m",), ())


def test_diff_output_is_sorted() -> None:
    old = registry_of(*(manifest(n) for n in "dcba"))
    new = registry_of(*(manifest(n, ctx_size=1) for n in "cadb"), manifest("z"), manifest("y"))
    d = diff(old, new)
    assert d.restarted == ("a", "b", "c", "d")
    assert d.added == ("y", "z")


# --- schema ------------------------------------------------------------------------------------------


def test_json_schema_is_serialisable_and_describes_llama_server() -> None:
    schema = json_schema()
    text = json.dumps(schema)
    assert json.loads(text) == schema
    assert "llama-server" in text
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert {"type": "array"}.items() <= schema["anyOf"][1].items()


def test_json_schema_lists_every_manifest_field() -> None:
    llama, vllm = json_schema()["anyOf"][0]["oneOf"]
    assert set(llama["properties"]) == set(LlamaServerManifest.model_fields)
    assert set(vllm["properties"]) == set(VllmManifest.model_fields)
    for one in (llama, vllm):
        assert {"name", "engine", "model"} <= set(one["required"])
        assert one["additionalProperties"] is False


# --- finding a model by the name a client sends ------------------------------------------------------


def test_a_name_is_found_exactly_with_or_without_latest_and_in_any_case() -> None:
    """As Ollama finds names: `:latest` optional, case ignored when no name matches exactly (a name two
    models share when folded matches neither)."""
    registry = Registry(
        models={m.name: m for m in (manifest("hf.co/Org/Repo:Q4_K_M"), manifest("demo"), manifest("A"))}
        | {"a": manifest("a")},
        aliases={"tiny": "demo"},
    )
    found = {
        sent: None if (m := registry.resolve(sent)) is None else m.name
        for sent in ("demo", "demo:latest", "Demo", "DEMO:Latest", "Tiny", "hf.co/org/repo:q4_k_m", "A", "a")
    }
    assert found == {
        "demo": "demo",
        "demo:latest": "demo",
        "Demo": "demo",
        "DEMO:Latest": "demo",
        "Tiny": "demo",
        "hf.co/org/repo:q4_k_m": "hf.co/Org/Repo:Q4_K_M",
        "A": "A",
        "a": "a",
    }
    assert registry.resolve("nothing") is None
    assert registry.resolve("ａ") is None  # a fullwidth letter is another name
    assert ollama_name("demo") == "demo:latest"
    assert ollama_name("hf.co/Org/Repo:Q4_K_M") == "hf.co/Org/Repo:Q4_K_M"


# --- what a review of the control plane found ----------------------------------------------------------


def test_a_manifest_link_whose_target_is_gone_is_an_error_not_a_model_removed(tmp_path: Path) -> None:
    """A link in manifests/ to a file that moved was left out without a word: `check` said all was
    valid, and a SIGHUP reload drained and removed the model instead of being refused."""
    write(tmp_path, "a.yaml", "{name: a, engine: llama-server, model: /a.gguf}\n")
    (tmp_path / "b.yaml").symlink_to(tmp_path / "moved" / "b.yaml")
    error = only_error(tmp_path)
    assert error.file == tmp_path / "b.yaml"
    assert "cannot read" in error.message


def test_a_field_given_twice_is_an_error_on_the_line_of_the_repeat(tmp_path: Path) -> None:
    """YAML keeps the last of two equal keys: the model served was `d`, with ctx_size 256."""
    write(
        tmp_path,
        "c.yaml",
        """
        name: c
        engine: llama-server
        model: /x.gguf
        ctx_size: 4096
        ctx_size: 256
        name: d
        """,
    )
    errors = load_errors(tmp_path)
    assert [(e.line, e.field) for e in errors] == [(5, "ctx_size"), (6, "name")]
    assert all("given twice" in e.message for e in errors)


def test_a_name_already_used_names_the_line_of_the_name_or_alias(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", "{name: a, engine: llama-server, model: /a.gguf}\n")
    many = "".join(f"- name: m{i}\n  engine: llama-server\n  model: /x.gguf\n" for i in range(5))
    write(tmp_path, "b.yaml", many + "- name: a\n  engine: llama-server\n  model: /x.gguf\n")
    write(tmp_path, "c.yaml", "name: c\nengine: llama-server\nmodel: /x.gguf\naliases: [m3]\n")
    assert sorted((e.file.name, e.line) for e in load_errors(tmp_path)) == [("b.yaml", 16), ("c.yaml", 4)]


def test_a_manifests_setting_naming_a_file_says_so(tmp_path: Path) -> None:
    """`serve --manifests demo.yaml` (as `check` takes a file) said "manifest directory not found" of a
    file that was there."""
    one = write(tmp_path, "demo.yaml", "{name: demo, engine: llama-server, model: /a.gguf}\n")
    with pytest.raises(ManifestLoadError, match="is a file, not a directory of manifests"):
        load_directory(one)

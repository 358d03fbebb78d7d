"""`llm-supervisor check` and `llm-supervisor schema`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supervisor import __version__
from supervisor.cli import main


def run_main(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as info:
        main(argv)
    code = info.value.code
    assert isinstance(code, int)
    return code


def test_check_accepts_valid_manifests_and_lists_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    (tmp_path / "a.yaml").write_text(
        "name: present\nengine: llama-server\nmodel: model.gguf\n", encoding="utf-8"
    )
    (tmp_path / "b.yaml").write_text(
        "- {name: absent, engine: llama-server, model: /nowhere/absent.gguf}\n", encoding="utf-8"
    )
    assert run_main(["check", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == f"ok  present  [llama-server]  {tmp_path / 'a.yaml'}"
    assert lines[1].startswith(f"ok  absent  [llama-server]  {tmp_path / 'b.yaml'}")
    assert "warning: /nowhere/absent.gguf does not exist yet" in lines[1]
    assert lines[2] == f"2 model(s) valid in {tmp_path}"
    assert err == ""


def test_check_of_an_empty_directory_is_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main(["check", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"0 model(s) valid in {tmp_path}\n"


def test_check_reports_every_error_with_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: m\nengine: llama-server\nmodel: /m.gguf\nctx_size: big\nextra: 1\n", encoding="utf-8"
    )
    broken = tmp_path / "broken.yml"
    broken.write_text("name: [unclosed\n", encoding="utf-8")
    (tmp_path / "good.yaml").write_text("{name: g, engine: llama-server, model: /g.gguf}\n", encoding="utf-8")
    assert run_main(["check", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert any(line.startswith(f"{bad}:4: model 'm' field 'ctx_size':") for line in lines)
    assert any(line.startswith(f"{bad}:5: model 'm' field 'extra':") for line in lines)
    assert any(line.startswith(f"{broken}:") and "invalid YAML" in line for line in lines)
    assert lines[-1] == f"3 error(s) in {tmp_path}"


def test_check_of_a_missing_directory_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    assert run_main(["check", str(missing)]) == 1
    err = capsys.readouterr().err
    assert f"{missing}: manifest directory not found" in err


def test_check_defaults_to_the_manifests_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "manifests").mkdir()
    (tmp_path / "manifests" / "m.yaml").write_text(
        "{name: m, engine: llama-server, model: /m.gguf}\n", encoding="utf-8"
    )
    assert run_main(["check"]) == 0
    assert "1 model(s) valid in manifests" in capsys.readouterr().out


def test_schema_prints_the_manifest_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    main(["schema"])
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "llm-supervisor manifest"
    assert "llama-server" in json.dumps(schema)


def test_a_command_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main([]) == 2
    assert "required" in capsys.readouterr().err


def test_version_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"llm-supervisor {__version__}"

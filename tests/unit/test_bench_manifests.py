"""The bench scripts write the daemon's manifests with bench/proxy_overhead.py's `prepare_model`, each
from its own command line. The tests do not run `make bench`, so a script whose parser lacks an option
the writer reads would fail only there: these parse each script's defaults and write its manifests."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import yaml

from bench import ollama_translation, proxy_overhead
from bench.proxy_overhead import EMBED_NAME, MODEL_NAME, prepare_model, prepare_models

ParseArgs = Callable[[Sequence[str] | None], argparse.Namespace]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")  # only its path is written; nothing reads it here
    return path


def _manifest(workdir: Path, name: str) -> dict[str, object]:
    return dict(yaml.safe_load((workdir / "manifests" / f"{name}.yaml").read_text()))


@pytest.mark.parametrize("parse_args", [proxy_overhead.parse_args, ollama_translation.parse_args])
def test_each_bench_writes_its_models_manifest_from_its_own_arguments(
    parse_args: ParseArgs, model: Path, tmp_path: Path
) -> None:
    workdir = tmp_path / "run"
    workdir.mkdir()
    assert prepare_model(parse_args(["--model", str(model)]), workdir) == model.resolve()
    manifest = _manifest(workdir, MODEL_NAME)
    assert manifest["model"] == str(model.resolve())
    assert "max_inflight" not in manifest  # the engine's slots, as a user's manifest would have


def test_max_inflight_reaches_both_of_the_benchs_models(model: Path, tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    workdir.mkdir()
    prepare_models(proxy_overhead.parse_args(["--model", str(model), "--max-inflight", "10"]), workdir)
    assert [_manifest(workdir, name)["max_inflight"] for name in (MODEL_NAME, EMBED_NAME)] == [10, 10]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to split")
def test_proxy_cpus_puts_both_of_the_benchs_models_on_the_other_cpus(model: Path, tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    workdir.mkdir()
    cpus = sorted(os.sched_getaffinity(0))
    args = proxy_overhead.parse_args(["--model", str(model), "--proxy-cpus", "auto"])
    assert args.proxy_cpus == (cpus[0],)
    prepare_models(args, workdir)
    assert [_manifest(workdir, name)["cpus"] for name in (MODEL_NAME, EMBED_NAME)] == [cpus[1:], cpus[1:]]


def test_without_proxy_cpus_the_benchs_models_name_no_cpus(model: Path, tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    workdir.mkdir()
    prepare_models(proxy_overhead.parse_args(["--model", str(model)]), workdir)
    assert ["cpus" in _manifest(workdir, name) for name in (MODEL_NAME, EMBED_NAME)] == [False, False]

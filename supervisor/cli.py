"""`llm-supervisor serve | check | schema`."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import structlog

from supervisor import __version__, logs
from supervisor.config import ConfigError, Settings, load_settings
from supervisor.manifests import ManifestLoadError, json_schema, load_directory


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llm-supervisor",
        description="Serve many local LLMs from a fixed pool of GPUs behind one OpenAI-compatible endpoint.",
    )
    parser.add_argument("--version", action="version", version=f"llm-supervisor {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the daemon")
    serve.add_argument("--config", type=Path, help="daemon settings (YAML)")
    serve.add_argument("--host", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port (default 11435)")
    serve.add_argument("--manifests", type=Path, help="directory of model manifests (default manifests/)")
    serve.add_argument("--state-dir", type=Path, help="where child pid files live (default .state/)")
    serve.add_argument("--log-format", choices=["console", "json"])
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])

    check = commands.add_parser("check", help="validate manifests and exit non-zero on any error")
    check.add_argument("directory", type=Path, nargs="?", default=Path("manifests"))

    commands.add_parser("schema", help="print the JSON schema of a manifest, for editors")
    return parser


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("host", "port", "manifests", "state_dir", "log_format", "log_level")
    return {k: getattr(args, k) for k in keys}


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.command == "schema":
        print(json.dumps(json_schema(), indent=2))
        return
    if args.command == "check":
        sys.exit(check(args.directory))
    sys.exit(serve(args))


def check(directory: Path) -> int:
    try:
        registry = load_directory(directory)
    except ManifestLoadError as exc:
        for error in exc.errors:
            print(error, file=sys.stderr)
        print(f"{len(exc.errors)} error(s) in {directory}", file=sys.stderr)
        return 1
    for name, manifest in registry.models.items():
        weights = manifest.local_weights()
        missing = "" if weights is None or weights.exists() else f"  (warning: {weights} does not exist yet)"
        print(f"ok  {name}  [{manifest.engine}]  {registry.sources[name]}{missing}")
    print(f"{len(registry.models)} model(s) valid in {directory}")
    return 0


def serve(args: argparse.Namespace) -> int:
    def settings() -> Settings:
        return load_settings(args.config, overrides=_overrides(args))

    try:
        current = settings()
    except ConfigError as exc:
        print(f"llm-supervisor: {exc}", file=sys.stderr)
        return 2
    logs.configure(current.log_format, current.log_level)
    structlog.get_logger("cli").info(
        "starting", version=__version__, settings=current.model_dump(mode="json")
    )
    from supervisor.app import serve as run  # imported late: `check` and `schema` need none of aiohttp

    return asyncio.run(run(current, settings))


if __name__ == "__main__":
    main()

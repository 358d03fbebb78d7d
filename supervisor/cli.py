"""`llm-supervisor serve | check | schema`, and the client commands `list | ps | rm | pull`.

The client commands talk to a running daemon over HTTP (Ollama's /api routes), at --url or
$LLM_SUPERVISOR_URL, and print what `ollama list` / `ollama ps` / `ollama rm` / `ollama pull` print.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
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

    url = os.environ.get("LLM_SUPERVISOR_URL") or DEFAULT_URL
    client = argparse.ArgumentParser(add_help=False)
    client.add_argument(
        "--url", default=url, help=f"the daemon (default $LLM_SUPERVISOR_URL or {DEFAULT_URL})"
    )
    client.add_argument(
        "--api-key",
        default=os.environ.get("LLM_SUPERVISOR_API_KEY"),
        help="the key the daemon asks for, if any (default $LLM_SUPERVISOR_API_KEY)",
    )
    commands.add_parser("list", parents=[client], help="list the models the daemon can serve")
    commands.add_parser("ps", parents=[client], help="list the loaded models")
    rm = commands.add_parser("rm", parents=[client], help="delete models from the local store")
    rm.add_argument("models", nargs="+", metavar="MODEL")
    pull = commands.add_parser("pull", parents=[client], help="download a model into the local store")
    pull.add_argument("model", metavar="MODEL")
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
    if args.command in _CLIENT_COMMANDS:
        if args.api_key:
            _HEADERS["Authorization"] = f"Bearer {args.api_key}"
        sys.exit(asyncio.run(_CLIENT_COMMANDS[args.command](args)))
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

    # Until the event loop takes the signals over, remember them: a SIGTERM while we import and read the
    # config must not kill us before the daemon can clean up (it acts on them once start-up is done).
    early: list[signal.Signals] = []
    for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: early.append(signal.Signals(signum)))
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

    return asyncio.run(run(current, settings, early))


# --- client commands ----------------------------------------------------------------------------------

DEFAULT_URL = "http://127.0.0.1:11435"
_TIMEOUT = aiohttp.ClientTimeout(total=60)
# A pull streams for as long as the download takes; only a silent connection is an error.
_PULL_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=300)


ClientCommand = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]
# Sent with every client command's request: the API key, when one is given.
_HEADERS: dict[str, str] = {}


class ClientError(Exception):
    """A client command failed; the message is the one line printed on stderr."""


async def _call(url: str, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    """(status, JSON body or None) of one request to the daemon; ClientError when it cannot be reached."""
    try:
        async with (
            aiohttp.ClientSession(timeout=_TIMEOUT, headers=_HEADERS) as session,
            session.request(method, url.rstrip("/") + path, json=body) as response,
        ):
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ClientError(_unreachable(url, exc)) from None
    try:
        return response.status, json.loads(text) if text.strip() else None
    except ValueError:
        raise ClientError(f"{url} answered {path} with {response.status}, not JSON: {text[:200]!r}") from None


def _unreachable(url: str, exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, ConnectionRefusedError):
        reason = "connection refused (is `llm-supervisor serve` running?)"
    else:
        reason = str(exc) or type(exc).__name__
    return f"could not reach the daemon at {url}: {reason}"


def _error_of(status: int, body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return str(body["error"])
    if isinstance(body, dict) and isinstance(body.get("error"), dict):  # an OpenAI-shaped error body
        return str(body["error"].get("message"))
    return f"the daemon answered {status}"


async def _get_models(url: str, path: str) -> list[dict[str, Any]]:
    status, body = await _call(url, "GET", path)
    if status != 200:
        raise ClientError(_error_of(status, body))
    models = body.get("models") if isinstance(body, dict) else None
    if not isinstance(models, list):
        raise ClientError(f"{url}{path} did not answer a model list")
    return [m for m in models if isinstance(m, dict)]


def _reported(
    command: Callable[[argparse.Namespace], Coroutine[Any, Any, int]],
) -> Callable[..., Coroutine[Any, Any, int]]:
    """Turn a ClientError into its one line on stderr and exit status 1."""

    async def run(args: argparse.Namespace) -> int:
        try:
            return await command(args)
        except ClientError as exc:
            print(f"llm-supervisor: {exc}", file=sys.stderr)
            return 1

    return run


@_reported
async def list_command(args: argparse.Namespace) -> int:
    models = await _get_models(args.url, "/api/tags")
    now = time.time()
    rows = [["NAME", "ID", "SIZE", "MODIFIED"]]
    for model in models:
        size = model.get("size")
        rows.append(
            [
                str(model.get("name", "")),
                short_digest(model.get("digest")),
                human_bytes(size) if isinstance(size, int) and size > 0 else "-",
                human_time(_epoch(model.get("modified_at")), now),
            ]
        )
    print(table(rows))
    return 0


@_reported
async def ps_command(args: argparse.Namespace) -> int:
    models = await _get_models(args.url, "/api/ps")
    now = time.time()
    rows = [["NAME", "ID", "SIZE", "PROCESSOR", "GPUS", "CONTEXT", "UNTIL"]]
    for model in models:
        raw_size, raw_gpus = model.get("size"), model.get("gpus")
        size = raw_size if isinstance(raw_size, int) else 0
        gpus = raw_gpus if isinstance(raw_gpus, list) else []
        state = model.get("state")
        if state == "loading":
            until = "Loading..."
        elif state == "draining":
            until = "Stopping..."
        else:
            until = human_time(_epoch(model.get("expires_at")), now)
        rows.append(
            [
                str(model.get("name", "")),
                short_digest(model.get("digest")),
                human_bytes(size) if size else "-",
                processor(size, model.get("size_vram")),
                ",".join(str(g) for g in gpus) or "-",
                str(model.get("context_length") or "-"),
                until,
            ]
        )
    print(table(rows))
    return 0


@_reported
async def rm_command(args: argparse.Namespace) -> int:
    code = 0
    for model in args.models:
        status, body = await _call(args.url, "DELETE", "/api/delete", {"model": model})
        if status == 200:
            print(f"deleted '{model}'")
        else:
            print(f"llm-supervisor: {_error_of(status, body)}", file=sys.stderr)
            code = 1
    return code


@_reported
async def pull_command(args: argparse.Namespace) -> int:
    """Stream Ollama's pull progress (NDJSON: status, digest, total, completed) as one bar per digest."""
    from tqdm import tqdm  # type: ignore[import-untyped]  # late: only `pull` draws progress bars

    bars: dict[str, Any] = {}
    succeeded = False
    url = args.url.rstrip("/") + "/api/pull"
    try:
        async with (
            aiohttp.ClientSession(timeout=_PULL_TIMEOUT, headers=_HEADERS) as session,
            session.post(url, json={"model": args.model, "stream": True}) as response,
        ):
            if response.status != 200:
                text = await response.text()
                try:
                    body = json.loads(text)
                except ValueError:
                    body = None
                raise ClientError(_error_of(response.status, body))
            async for raw in response.content:
                if not raw.strip():
                    continue
                try:
                    event = json.loads(raw)
                except ValueError:
                    raise ClientError(f"{url} sent a line that is not JSON: {raw[:200]!r}") from None
                if not isinstance(event, dict):
                    continue
                if event.get("error"):
                    raise ClientError(str(event["error"]))
                digest, total = event.get("digest"), event.get("total")
                if isinstance(digest, str) and digest and isinstance(total, int):
                    bar = bars.get(digest)
                    if bar is None:
                        bar = bars[digest] = tqdm(
                            total=total,
                            desc=f"pulling {short_digest(digest)}",
                            unit="B",
                            unit_scale=True,
                            unit_divisor=1024,
                            file=sys.stderr,
                            leave=True,
                        )
                    completed = event.get("completed")
                    if isinstance(completed, int) and completed > bar.n:
                        bar.update(completed - bar.n)
                elif event.get("status") == "success":
                    succeeded = True
                elif isinstance(event.get("status"), str):
                    print(event["status"], file=sys.stderr)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ClientError(_unreachable(args.url, exc)) from None
    finally:
        for bar in bars.values():
            bar.close()
    if not succeeded:
        raise ClientError(f"the pull of '{args.model}' ended before the daemon said success")
    print("success")
    return 0


_CLIENT_COMMANDS: dict[str, ClientCommand] = {
    "list": list_command,
    "ps": ps_command,
    "rm": rm_command,
    "pull": pull_command,
}


def table(rows: list[list[str]]) -> str:
    """Left-aligned columns, three spaces apart, as `ollama list` prints them."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "   ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def short_digest(digest: object) -> str:
    """The 12 hex digits `ollama list` shows as ID; "-" when the daemon does not know the digest yet."""
    if not isinstance(digest, str) or not digest:
        return "-"
    return digest.removeprefix("sha256:")[:12]


def human_bytes(size: int) -> str:
    """Decimal units as Ollama prints them: 4.7 GB, 627 KB, 12 MB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if size >= scale:
            value = size / scale
            if value >= 10 or value == int(value):
                return f"{int(value)} {unit}"
            return f"{value:.1f} {unit}"
    return f"{size} B"


def processor(size: int, size_vram: object) -> str:
    """Ollama's PROCESSOR column: where the loaded model's memory is."""
    vram = size_vram if isinstance(size_vram, int) else 0
    if size <= 0:
        return "-"
    gpu = round(100 * min(vram, size) / size)
    if gpu == 100:
        return "100% GPU"
    if gpu == 0:
        return "100% CPU"
    return f"{100 - gpu}%/{gpu}% CPU/GPU"


def _epoch(stamp: object) -> float | None:
    if not isinstance(stamp, str) or not stamp:
        return None
    try:
        return datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return None


def human_time(at: float | None, now: float) -> str:
    """`at` relative to `now` as Ollama says it: "2 days ago", "4 minutes from now", "Forever"."""
    if at is None:
        return "-"
    delta = at - now
    if delta > 100 * 365 * 86400:
        return "Forever"
    suffix = "from now" if delta > 0 else "ago"
    return f"{_human_duration(abs(delta))} {suffix}"


def _human_duration(seconds: float) -> str:
    if seconds < 1:
        return "Less than a second"
    if seconds < 2:
        return "1 second"
    if seconds < 60:
        return f"{int(seconds)} seconds"
    if seconds < 120:
        return "About a minute"
    if seconds < 3600:
        return f"{int(seconds // 60)} minutes"
    if seconds < 7200:
        return "About an hour"
    if seconds < 48 * 3600:
        return f"{int(seconds // 3600)} hours"
    days = seconds / 86400
    if days < 14:
        return f"{int(days)} days"
    if days < 60:
        return f"{int(days // 7)} weeks"
    if days < 730:
        return f"{int(days // 30)} months"
    return f"{int(days // 365)} years"


if __name__ == "__main__":
    main()

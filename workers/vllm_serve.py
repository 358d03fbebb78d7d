"""`vllm serve` children: argv from the manifest, the lease and the model's tool-call and reasoning parsers
(supervisor/capabilities.py detects them), readiness from /health and /v1/models.

vLLM runs an API server process plus `VLLM::EngineCore` (and, per GPU, `VLLM::Worker`) grandchildren in
the same process group; ChildProcess.stop ends all of them. The API server exits on its own when its
EngineCore dies, which the scheduler then sees as a crash.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

import aiohttp

from supervisor.capabilities import vllm_parsers
from supervisor.manifests import Manifest, VllmManifest
from workers import sockets
from workers.base import (
    LOOPBACK,
    ChildKey,
    Endpoint,
    GpuPlacement,
    LaunchError,
    LaunchSpec,
    http_ok,
    probe_headers,
)


def gpu_memory_utilization(placement: GpuPlacement) -> float:
    """vLLM's --gpu-memory-utilization is a fraction of each GPU's *total* memory; give it the lease's.

    Rounded down, so vLLM never takes more than was leased; never vLLM's default (0.92 in 0.32), which
    would take memory leased to other models.
    """
    return max(0.0001, math.floor(placement.share_of_total() * 10_000) / 10_000)


def _hub_cache(env: Mapping[str, str]) -> Path:
    """Where huggingface_hub keeps downloaded repos, by the same variables it reads."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return Path(env[name]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    cache = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return cache / "huggingface" / "hub"


def model_architectures(manifest: VllmManifest, env: Mapping[str, str]) -> tuple[str, ...]:
    """config.json's `architectures` of the local model directory, or of the hub repo's snapshot in the
    Hugging Face cache (`env` says where that is); () when there is no readable config.json (yet)."""
    if (weights := manifest.local_weights()) is not None:
        config = weights / "config.json"
    else:
        repo = _hub_cache(env) / f"models--{manifest.model.replace('/', '--')}"
        try:
            revision = (repo / "refs" / "main").read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return ()
        config = repo / "snapshots" / revision / "config.json"
    try:
        found = json.loads(config.read_text(encoding="utf-8")).get("architectures")
    except (OSError, ValueError, AttributeError):  # missing, unreadable, not JSON, not an object
        return ()
    return tuple(a for a in found if isinstance(a, str)) if isinstance(found, list) else ()


class VllmWorker:
    def endpoint(self, manifest: Manifest) -> Endpoint:
        return sockets.endpoint_for(manifest.listen)

    def launch_spec(
        self, manifest: Manifest, endpoint: Endpoint, placement: GpuPlacement, key: ChildKey
    ) -> LaunchSpec:
        assert isinstance(manifest, VllmManifest)
        weights = manifest.local_weights()
        if weights is not None and not weights.is_dir():
            # Caught here, a wrong path costs nothing; vLLM itself would fail after a minute of start-up.
            raise LaunchError(f"model directory {weights} not found")
        command = list(manifest.command)
        argv = [*command, manifest.model] if command[-1] == "serve" else [*command, "--model", manifest.model]
        # On a Unix socket only the daemon's user can open: vLLM checks its key on the /v1 routes only.
        if endpoint.socket is not None:
            argv += ["--uds", str(endpoint.socket)]
        else:
            argv += ["--host", LOOPBACK, "--port", str(endpoint.port)]
        argv += ["--served-model-name", manifest.served_name]
        argv += ["--gpu-memory-utilization", f"{gpu_memory_utilization(placement):.4f}"]
        if manifest.tensor_parallel_size > 1:
            argv += ["--tensor-parallel-size", str(manifest.tensor_parallel_size)]
        options = {
            "--max-model-len": manifest.max_model_len,
            "--dtype": manifest.dtype,
            "--quantization": manifest.quantization,
            "--kv-cache-dtype": manifest.kv_cache_dtype,
            "--kv-cache-memory-bytes": manifest.kv_cache_memory_bytes,
            "--max-num-seqs": manifest.max_num_seqs,
        }
        for flag, value in options.items():
            if value is not None:
                argv += [flag, str(value)]
        if manifest.enforce_eager:
            argv.append("--enforce-eager")
        if manifest.speculative is not None:
            argv += ["--speculative-config", json.dumps(manifest.speculative, separators=(",", ":"))]
        # Tool calling and reasoning work out of the box: the parsers the manifest names, or the model's.
        parsers = vllm_parsers(manifest, model_architectures(manifest, os.environ | manifest.env))
        if parsers.tool is not None:
            argv += ["--enable-auto-tool-choice", "--tool-call-parser", parsers.tool]
        if parsers.reasoning is not None:
            argv += ["--reasoning-parser", parsers.reasoning]
        argv += manifest.args

        # From the environment, not `--api-key`: argv is readable by every local user (ps). vLLM guards
        # only the /v1 routes with it (hence the socket). Set after the manifest's env, so it is the only
        # key there is.
        env = placement.child_env(manifest.env)
        env["VLLM_API_KEY"] = key.value
        return LaunchSpec(
            argv=argv,
            env=env,
            api_key=key.value,
            leaves=endpoint.leaves,
            secret_values=tuple(manifest.env.values()),
        )

    async def is_ready(
        self, session: aiohttp.ClientSession, manifest: Manifest, endpoint: Endpoint, api_key: str
    ) -> bool:
        """/health answers 200 once the engine is up; /v1/models must also list the served name."""
        assert isinstance(manifest, VllmManifest)
        if not await http_ok(session, endpoint, "/health", api_key=api_key):
            return False
        try:
            async with session.get(
                endpoint.url + "/v1/models",
                timeout=aiohttp.ClientTimeout(total=2),
                headers=probe_headers(api_key),
            ) as response:
                if response.status != 200:
                    return False
                listed = await response.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return False
        entries = listed.get("data") if isinstance(listed, dict) else None
        return isinstance(entries, list) and any(
            isinstance(e, dict) and e.get("id") == manifest.served_name for e in entries
        )

"""`vllm serve` children: argv from the manifest and the lease, readiness from /health and /v1/models.

vLLM runs an API server process plus `VLLM::EngineCore` (and, per GPU, `VLLM::Worker`) grandchildren in
the same process group; ChildProcess.stop ends all of them. The API server exits on its own when its
EngineCore dies, which the scheduler then sees as a crash.
"""

from __future__ import annotations

import json
import math

import aiohttp

from supervisor.manifests import Manifest, VllmManifest
from workers.base import LOOPBACK, ChildKey, GpuPlacement, LaunchError, LaunchSpec, bearer, http_ok


def gpu_memory_utilization(placement: GpuPlacement) -> float:
    """vLLM's --gpu-memory-utilization is a fraction of each GPU's *total* memory; give it the lease's.

    Rounded down, so vLLM never takes more than was leased; never vLLM's default (0.92 in 0.32), which
    would take memory leased to other models.
    """
    return max(0.0001, math.floor(placement.share_of_total() * 10_000) / 10_000)


class VllmWorker:
    def launch_spec(
        self, manifest: Manifest, port: int, placement: GpuPlacement, key: ChildKey
    ) -> LaunchSpec:
        assert isinstance(manifest, VllmManifest)
        weights = manifest.local_weights()
        if weights is not None and not weights.is_dir():
            # Caught here, a wrong path costs nothing; vLLM itself would fail after a minute of start-up.
            raise LaunchError(f"model directory {weights} not found")
        command = list(manifest.command)
        argv = [*command, manifest.model] if command[-1] == "serve" else [*command, "--model", manifest.model]
        argv += ["--host", LOOPBACK, "--port", str(port), "--served-model-name", manifest.served_name]
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
        argv += manifest.args

        # From the environment, not `--api-key`: argv is readable by every local user (ps). vLLM guards
        # only the /v1 routes with it. Set after the manifest's env, so it is the only key there is.
        env = placement.child_env(manifest.env)
        env["VLLM_API_KEY"] = key.value
        return LaunchSpec(argv=argv, env=env, api_key=key.value)

    async def is_ready(
        self, session: aiohttp.ClientSession, manifest: Manifest, port: int, api_key: str
    ) -> bool:
        """/health answers 200 once the engine is up; /v1/models must also list the served name."""
        assert isinstance(manifest, VllmManifest)
        if not await http_ok(session, port, "/health", api_key=api_key):
            return False
        try:
            async with session.get(
                f"http://{LOOPBACK}:{port}/v1/models",
                timeout=aiohttp.ClientTimeout(total=2),
                headers=bearer(api_key),
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

"""Ollama's model routes: /api/tags, /api/ps, /api/show, /api/version, and the `/` probe.

They only read: the registry says which models exist, the scheduler's slots and leases say which are
loaded and where, and supervisor.model_info says what the weights are (cached, read in threads).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from datetime import UTC, datetime
from importlib import metadata
from typing import Any

import structlog
import yaml
from aiohttp import web

from supervisor import __version__, access, errors, secrets
from supervisor.api import fleet_view
from supervisor.api.context import SCHEDULER
from supervisor.bodies import parse_object
from supervisor.capabilities import capabilities, flag_value
from supervisor.manifests import LlamaServerManifest, Manifest, VllmManifest, ollama_name
from supervisor.model_info import ModelCatalog, ModelInfo, catalog_for
from supervisor.ollama_translate import context_limit
from supervisor.scheduler import Scheduler
from supervisor.slots import ModelSlot, SlotState, aggregate_state

log = structlog.get_logger("api.ollama")
routes = web.RouteTableDef()

MIB = 1024 * 1024
# What Ollama reports as expires_at for a model that never unloads (keep_alive -1, pinned).
NEVER = "2318-08-23T00:00:00Z"
_LOADED = (SlotState.LOADING, SlotState.READY, SlotState.DRAINING)
# llama-server sampling flags that Ollama would show as a model's PARAMETERs.
_LLAMA_SAMPLING_FLAGS = {
    "--temp": "temperature",
    "--top-k": "top_k",
    "--top-p": "top_p",
    "--min-p": "min_p",
    "--repeat-penalty": "repeat_penalty",
    "--repeat-last-n": "repeat_last_n",
    "--seed": "seed",
    "--n-predict": "num_predict",
}


def rfc3339(epoch_s: float | None) -> str | None:
    """`created_at`'s format: always six digits of microseconds, then Z."""
    if epoch_s is None:
        return None
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def expires_at_text(epoch_s: float | None, draining: bool) -> str:
    """/api/ps's `expires_at`, as Ollama writes it (its Go client reads only this): now for a model
    unloading, Ollama's far date for one that never unloads (None), else when keep-alive ends."""
    if draining:
        return str(rfc3339(time.time()))
    try:
        return NEVER if epoch_s is None else str(rfc3339(epoch_s))
    except (OverflowError, OSError, ValueError):  # past what a date can hold (another node's record)
        return NEVER


async def describe(catalog: ModelCatalog, manifest: Manifest) -> ModelInfo:
    """What the manifest's weights are; empty (but the format) when they are not here or not readable."""
    fallback_format = "gguf" if isinstance(manifest, LlamaServerManifest) else "safetensors"
    try:
        weights = manifest.local_weights()
        repo_id = manifest.model if isinstance(manifest, VllmManifest) and weights is None else None
        info = await catalog.describe(weights, repo_id)
    except Exception as exc:  # one model's odd weights must not break the listing of the others
        log.warning("model_info_failed", model=manifest.name, error=repr(exc))
        info = ModelInfo()
    return info if info.format else replace(info, format=fallback_format)


def context_length(manifest: Manifest, info: ModelInfo) -> int | None:
    """The context one request can use: what /api/chat accepts as num_ctx, so a client that echoes it
    back is never refused; the model's own length when the manifest leaves it to the engine."""
    limit = context_limit(manifest)
    return limit[0] if limit is not None else info.context_length


def _slot_loaded(slot: ModelSlot | None) -> bool:
    return slot is not None and slot.state in _LOADED and slot.process is not None


@routes.get("/api/tags")
async def tags(request: web.Request) -> web.Response:
    """Every model the daemon can serve, loaded or not, with what its weights are."""
    scheduler = request.app[SCHEDULER]
    catalog = catalog_for(scheduler.settings.state_dir)
    who = access.caller(request)
    manifests = [m for m in scheduler.registry.models.values() if who.allows_model(m.name, *m.aliases)]
    infos = await asyncio.gather(*(describe(catalog, m) for m in manifests))
    fleet = fleet_view.nodes(request.app)
    models = []
    for manifest, info in zip(manifests, infos, strict=True):
        entry = {
            "name": ollama_name(manifest.name),
            "model": ollama_name(manifest.name),
            "modified_at": rfc3339(info.modified_at),
            "size": info.size,
            "digest": info.digest,
            "details": info.details(),
            "loaded": any(_slot_loaded(r) for r in scheduler.group(manifest.name)),
            "engine": manifest.engine,
            "aliases": list(manifest.aliases),
        }
        models.append(fleet_view.annotate(entry, manifest.name, fleet))
    return web.json_response({"models": models})


@routes.get("/api/ps")
async def running(request: web.Request) -> web.Response:
    """Models with a child: loading, ready or draining, with their lease and when keep-alive unloads them."""
    scheduler = request.app[SCHEDULER]
    catalog = catalog_for(scheduler.settings.state_dir)
    who = access.caller(request)
    slots = [
        s
        for s in scheduler.slots.values()
        if any(_slot_loaded(r) for r in scheduler.group(s.name))
        and who.allows_model(s.name, *s.manifest.aliases)
    ]
    infos = await asyncio.gather(*(describe(catalog, s.manifest) for s in slots))
    fleet = fleet_view.nodes(request.app)
    here = [
        fleet_view.annotate(_ps_entry(scheduler, s, i), s.name, fleet)
        for s, i in zip(slots, infos, strict=True)
    ]
    elsewhere = fleet_view.running_elsewhere(fleet, who.allows_model, expires_at_text)
    return web.json_response({"models": here + elsewhere})


def _ps_entry(scheduler: Scheduler, model: ModelSlot, info: ModelInfo) -> dict[str, Any]:
    """One row per model: its loaded replicas' leases summed, `replicas` how many there are."""
    loaded = [r for r in scheduler.group(model.name) if _slot_loaded(r)]
    leases = [lease for r in loaded if (lease := scheduler.leases.get(r.key)) is not None]
    leased = sum(sum(lease.mib_by_gpu.values()) for lease in leases) * MIB
    gpus = sorted({gpu for lease in leases for gpu in lease.gpu_indices})
    on_cpu = bool(leases) and _on_cpu(scheduler, gpus)
    size_vram = 0 if on_cpu else leased
    slot = model if model in loaded else loaded[0]
    draining = slot.state == SlotState.DRAINING
    expires_at = expires_at_text(None if draining else scheduler.expires_at(slot), draining)
    return {
        "name": ollama_name(slot.name),
        "model": ollama_name(slot.name),
        # Ollama's size is the memory the loaded model takes; ours is what it leased, else its weights.
        "size": leased or info.size,
        "digest": info.digest,
        "details": info.details(),
        "expires_at": expires_at,
        "size_vram": size_vram,
        "context_length": context_length(slot.launch_in_effect(), info),  # with its load's overrides
        "gpus": gpus,
        "state": str(aggregate_state(loaded)),
        "inflight": sum(r.inflight for r in loaded),
        "replicas": len(loaded),
        "engine": slot.manifest.engine,
        "processor": "CPU" if on_cpu else "GPU",
    }


def _on_cpu(scheduler: Scheduler, gpu_indices: list[int]) -> bool:
    """The lease is only on simulated GPUs with no device behind them (no NVML): the engine runs on the
    CPU. A budget declared on a GPU NVML sees is still that GPU."""
    by_index = {gpu.index: gpu for gpu in scheduler.inventory.gpus}
    gpus = [by_index[i] for i in gpu_indices if i in by_index]
    return bool(gpus) and all(g.simulated and g.physical_total_mib is None for g in gpus)


@routes.post("/api/show")
async def show(request: web.Request) -> web.Response:
    """Ollama's model card: details, model_info from the weights, template, parameters and capabilities."""
    payload = parse_object(await request.read())
    # `name` is the field's name before Ollama 0.1.33; older clients still send it.
    requested = payload.get("model") or payload.get("name")
    if not isinstance(requested, str) or not requested:
        raise errors.bad_request("'model' is required: a string naming the model (GET /api/tags)")
    scheduler = request.app[SCHEDULER]
    manifest = scheduler.registry.resolve(requested)
    if manifest is None:
        raise errors.model_not_found(requested)
    access.caller(request).check_model(manifest.name, manifest.aliases, requested)
    info = await describe(catalog_for(scheduler.settings.state_dir), manifest)
    source = scheduler.registry.sources.get(manifest.name)
    license_text = info.model_info.get("general.license")
    return web.json_response(
        {
            "license": license_text if isinstance(license_text, str) else "",
            "modelfile": modelfile(
                manifest, info, str(source) if source else None, access.caller(request).sees_internals
            ),
            "parameters": parameters(manifest, info),
            "template": info.template,
            "details": info.details(),
            "model_info": dict(info.model_info),
            "capabilities": capabilities(manifest, info),
            "modified_at": rfc3339(info.modified_at),
            "engine": manifest.engine,
            "aliases": list(manifest.aliases),
        }
    )


def _parameter_pairs(manifest: Manifest, info: ModelInfo) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    if (ctx := context_length(manifest, info)) is not None:
        pairs.append(("num_ctx", str(ctx)))
    if isinstance(manifest, LlamaServerManifest):
        for flag, name in _LLAMA_SAMPLING_FLAGS.items():
            if (value := flag_value(manifest.args, flag)) is not None:
                pairs.append((name, value))
    pairs.extend(("stop", json.dumps(word)) for word in info.stop)
    return pairs


def parameters(manifest: Manifest, info: ModelInfo) -> str:
    """Ollama's text form of a model's parameters: one `name value` line each, names padded to 30."""
    return "\n".join(f"{name:<30} {value}" for name, value in _parameter_pairs(manifest, info))


def modelfile(manifest: Manifest, info: ModelInfo, source: str | None, sees_internals: bool = False) -> str:
    """A Modelfile-like view of the manifest: FROM the weights, PARAMETERs, and the manifest as comments.

    Secrets never show; absolute paths show as file names unless the caller may see internals.
    """
    weights = str(manifest.local_weights() or manifest.model)
    if not sees_internals:
        weights, source = secrets.hide_internals(weights), source and secrets.hide_internals(source)
    lines = [
        f"# Generated by llm-supervisor from {source or 'its manifest'}; the daemon serves the manifest."
    ]
    fields = yaml.safe_dump(secrets.manifest_document(manifest, sees_internals), sort_keys=False)
    lines += [f"#   {line}" for line in fields.splitlines()]
    lines.append(f"FROM {weights}")
    # No TEMPLATE line: the engine applies the model's own Jinja chat template (see `template`), which a
    # Modelfile's Go-template TEMPLATE could not hold.
    lines += [f"PARAMETER {name} {value}" for name, value in _parameter_pairs(manifest, info)]
    return "\n".join(lines) + "\n"


# The Ollama API level these routes follow (tools, structured outputs, thinking). Clients compare
# `version` with Ollama's releases to decide what they may use, so ours would read as an ancient Ollama.
OLLAMA_API_VERSION = "0.12.0"


@routes.get("/api/version")
async def version(request: web.Request) -> web.Response:
    try:
        ours = metadata.version("llm-supervisor")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        ours = __version__
    return web.json_response({"version": OLLAMA_API_VERSION, "llm_supervisor": ours})


# Ollama clients and UIs (Open WebUI, the `ollama` CLI, editors' plugins) probe `GET /` or `HEAD /` for
# this exact text to decide that an Ollama server is there before they call anything else.
@routes.get("/")
async def root(request: web.Request) -> web.Response:
    return web.Response(text="Ollama is running")

"""Ollama's model routes (/api/tags, /api/ps, /api/show, /api/version, /) through the real `ollama` client.

One daemon serves every test in this module, in order: `ps` is empty until the test that makes a
request (with the openai client) loads the demo model through a real llama-server child.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import ollama
import pytest
import pytest_asyncio

from supervisor.api.ollama_models import OLLAMA_API_VERSION
from tests.integration.conftest import DEMO
from tests.integration.harness import Daemon, run_cli

pytestmark = pytest.mark.asyncio(loop_scope="module")

MIB = 1024 * 1024


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Daemon]:
    root = tmp_path_factory.mktemp("ollama-models")
    garbage = root / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + os.urandom(4096))
    daemon = Daemon(root, {})
    daemon.write_manifest(
        "demo", **{**DEMO, "model": str(demo_gguf), "aliases": ["demo-alias"], "args": ["--temp", "0.7"]}
    )
    daemon.write_manifest("embedder", **{**DEMO, "model": str(demo_gguf), "args": ["--embeddings"]})
    daemon.write_manifest("broken", model=str(garbage), vram_mib=100)
    daemon.write_manifest("missing", model=str(root / "not-downloaded.gguf"), vram_mib=100)
    daemon.write_manifest("hub", engine="vllm", model="nobody/not-downloaded-here", vram_mib=100)
    await daemon.start()
    yield daemon
    leftovers = await daemon.close()
    assert not leftovers, f"engine processes outlived their daemon: {leftovers}"


@pytest.fixture(scope="module")
def demo_digest(demo_gguf: Path) -> str:
    return hashlib.sha256(demo_gguf.read_bytes()).hexdigest()


def client(daemon: Daemon) -> ollama.AsyncClient:
    return ollama.AsyncClient(host=daemon.url)


async def test_ps_is_empty_before_any_request(daemon: Daemon) -> None:
    assert (await client(daemon).ps()).models == []


async def test_list_shows_every_model_with_what_its_weights_are(
    daemon: Daemon, demo_gguf: Path, demo_digest: str
) -> None:
    listed = {m.model: m for m in (await client(daemon).list()).models}
    # Every name with its tag, as Ollama lists them: Open WebUI adds `:latest` to a name without one and
    # then looks it up in this list.
    assert set(listed) == {"demo:latest", "embedder:latest", "broken:latest", "missing:latest", "hub:latest"}
    demo = listed["demo:latest"]
    assert demo.details is not None
    assert demo.details.format == "gguf"
    assert demo.details.family == "llama"
    assert demo.details.families == ["llama"]
    assert demo.details.quantization_level == "F32"
    assert demo.details.parameter_size == "153.3K"
    assert demo.size == os.stat(demo_gguf).st_size
    assert demo.digest == demo_digest
    assert demo.modified_at == datetime.fromtimestamp(os.stat(demo_gguf).st_mtime, UTC)
    # Weights that are not here, or not readable, are listed all the same.
    assert listed["hub:latest"].size == 0
    assert listed["hub:latest"].details is not None
    assert listed["hub:latest"].details.format == "safetensors"
    assert listed["missing:latest"].size == 0
    assert listed["broken:latest"].size == 4100
    assert listed["broken:latest"].details is not None
    assert listed["broken:latest"].details.family == ""

    status, raw = await daemon.get("/api/tags")
    assert status == 200
    ours = {m["name"]: m for m in raw["models"]}
    assert ours["demo:latest"]["aliases"] == ["demo-alias"]
    assert ours["demo:latest"]["engine"] == "llama-server"
    assert ours["hub:latest"]["engine"] == "vllm"
    assert not any(m["loaded"] for m in raw["models"])


async def test_a_model_in_use_shows_in_ps_with_its_lease_and_expiry(daemon: Daemon) -> None:
    await daemon.chat("demo-alias")
    running = (await client(daemon).ps()).models
    assert [m.model for m in running] == ["demo:latest"]
    demo = running[0]
    assert demo.size == DEMO["vram_mib"] * MIB
    assert demo.size_vram == 0  # the declared GPU is simulated (no NVML): the model runs on the CPU
    assert demo.context_length == DEMO["ctx_size"] // DEMO["parallel"]  # per request: what num_ctx may ask
    assert demo.expires_at is not None
    assert demo.expires_at > datetime.now(UTC)  # the default keep-alive of 5 minutes is running
    assert demo.details is not None
    assert demo.details.family == "llama"

    status, raw = await daemon.get("/api/ps")
    assert status == 200
    (entry,) = raw["models"]
    assert entry["gpus"] == [0]
    assert entry["state"] == "ready"
    assert entry["inflight"] == 0
    loaded = {m["name"]: m["loaded"] for m in (await daemon.get("/api/tags"))[1]["models"]}
    assert loaded == {
        "demo:latest": True,
        "embedder:latest": False,
        "broken:latest": False,
        "missing:latest": False,
        "hub:latest": False,
    }
    # A listed name is a name the daemon serves, in any case (Ollama matches names case-insensitively).
    assert (await client(daemon).chat(model="DEMO:latest", messages=[{"role": "user", "content": "hi"}])).done


async def test_show_returns_model_info_template_parameters_and_capabilities(daemon: Daemon) -> None:
    shown = await client(daemon).show("demo-alias")
    assert shown.modelinfo is not None
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == 4096
    assert shown.modelinfo["general.parameter_count"] > 0
    assert shown.template is not None
    assert "add_generation_prompt" in shown.template
    assert shown.parameters is not None
    parameters = [line.split(None, 1) for line in shown.parameters.splitlines()]
    assert ["num_ctx", str(DEMO["ctx_size"] // DEMO["parallel"])] in parameters
    assert ["temperature", "0.7"] in parameters
    assert any(name == "stop" for name, _ in parameters)
    assert shown.capabilities == ["completion", "chat"]  # its template names neither tools nor thinking
    assert shown.details is not None
    assert shown.details.quantization_level == "F32"
    assert shown.modelfile is not None
    assert "FROM " in shown.modelfile

    assert (await client(daemon).show("embedder")).capabilities == ["completion", "chat", "embedding"]
    # Clients from before Ollama 0.1.33 name the model in `name`.
    status, body, _ = await daemon.post("/api/show", {"name": "demo"})
    assert status == 200
    assert body["details"]["family"] == "llama"


async def test_an_unknown_model_is_a_404_and_a_missing_name_a_400(daemon: Daemon) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        await client(daemon).show("no-such-model")
    assert raised.value.status_code == 404
    assert raised.value.error.startswith("model 'no-such-model' not found")  # Ollama's words, then a hint
    status, body, _ = await daemon.post("/api/show", {})
    assert status == 400
    assert "model" in body["error"]


async def test_version_and_the_root_probe_answer_as_ollama_does(daemon: Daemon) -> None:
    # The ollama Python client 0.6.3 has no version(); tools call the route directly.
    status, body = await daemon.get("/api/version")
    assert status == 200
    assert body == {"version": OLLAMA_API_VERSION, "llm_supervisor": metadata.version("llm-supervisor")}
    assert daemon.http is not None
    async with daemon.http.get(daemon.url + "/") as response:
        assert response.status == 200
        assert await response.text() == "Ollama is running"
    async with daemon.http.head(daemon.url + "/") as response:
        assert response.status == 200


async def test_copy_create_push_and_blobs_are_a_501_that_says_what_to_do(daemon: Daemon) -> None:
    """They answered 404 "no route POST /api/copy", which reads like a wrong base URL or model."""
    ollama_client = client(daemon)
    calls: dict[str, Callable[[], Awaitable[object]]] = {
        "/api/copy": lambda: ollama_client.copy("demo", "demo2"),
        "/api/create": lambda: ollama_client.create("mine", from_="demo", system="be brief"),
        "/api/push": lambda: ollama_client.push("demo"),
    }
    for route, call in calls.items():
        with pytest.raises(ollama.ResponseError) as raised:
            await call()
        assert raised.value.status_code == 501
        assert raised.value.error.startswith(f"{route} is not supported by this server: ")
    assert "`aliases` in its manifest" in (await daemon.post("/api/copy", {}))[1]["error"]
    status, body, _ = await daemon.post("/api/blobs/sha256:" + "0" * 64, raw=b"weights")
    assert status == 501
    assert body["error"].startswith("/api/blobs is not supported by this server: ")
    assert daemon.http is not None
    async with daemon.http.head(daemon.url + "/api/blobs/sha256:" + "0" * 64) as response:
        assert response.status == 501


async def test_cli_list_and_ps_print_the_daemons_models(daemon: Daemon, demo_digest: str) -> None:
    digest = demo_digest
    code, out, err = await run_cli("list", "--url", daemon.url)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "ID", "SIZE", "MODIFIED"]
    demo = next(line.split() for line in lines if line.startswith("demo:latest "))
    assert demo[:3] == ["demo:latest", digest[:12], "627"]
    assert len(lines) == 6

    await daemon.chat("demo")  # loaded still (or again) for ps
    code, out, err = await run_cli("ps", "--url", daemon.url)
    assert (code, err) == (0, "")
    header, *rows = out.splitlines()
    assert header.split() == ["NAME", "ID", "SIZE", "PROCESSOR", "GPUS", "CONTEXT", "UNTIL"]
    assert [row.split()[:8] for row in rows] == [
        [
            "demo:latest",
            digest[:12],
            "536",
            "MB",
            "100%",
            "CPU",
            "0",
            str(DEMO["ctx_size"] // DEMO["parallel"]),
        ]
    ]
    assert rows[0].endswith("minutes from now")

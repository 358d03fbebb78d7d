"""The admin client commands (`status`, `load`, `unload`, `pin`, `unpin`) run as a user runs them, against a
real daemon with API keys; and what the CLI reads: where /api/ps says a model runs, /v1/models' `loaded`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ollama
import pytest
import yaml

from tests.integration.conftest import DEMO, MakeDaemon
from tests.integration.harness import Daemon, run_cli
from tests.integration.test_nvml_fake import child_memory, nvml_daemon

ADMIN = "admin-key-0123456789abcdef"
USER = "user-key-0123456789abcdefg"  # inference only
MIB = 2**20


def rows(table: str) -> dict[str, list[str]]:
    """A status table by model name: the cells after the name (split on runs of 3+ spaces)."""
    header, *lines = table.splitlines()
    assert header.split() == ["MODEL", "STATE", "REPLICAS", "IN", "FLIGHT", "QUEUED", "VRAM", "UNTIL"]
    cells = [[cell.strip() for cell in line.split("   ") if cell.strip()] for line in lines]
    return {row[0]: row[1:] for row in cells}


@pytest.fixture
async def keyed(make_daemon: MakeDaemon, tmp_path: Path) -> Daemon:
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        yaml.safe_dump([{"name": "ops", "key": ADMIN, "role": "admin"}, {"name": "user", "key": USER}])
    )
    return await make_daemon(
        models={"demo": {"keep_alive": "5m"}, "other": {"vram_mib": 700}},
        config={"api_keys_file": str(keys)},
    )


async def test_status_load_pin_unpin_unload_drive_the_daemon_with_an_admin_key(keyed: Daemon) -> None:
    url = ("--url", keyed.url)
    code, out, err = await run_cli("status", *url)
    assert (code, out) == (1, "")
    assert err.startswith("llm-supervisor: error: invalid_api_key: ")
    assert err.count("\n") == 1
    code, out, err = await run_cli("status", *url, "--api-key", USER)
    assert (code, out) == (1, "")
    assert err.startswith("llm-supervisor: error: forbidden: ")

    code, out, err = await run_cli("status", *url, key=ADMIN)
    assert (code, err) == (0, "")
    assert rows(out) == {
        "demo": ["unloaded", "0", "0", "0", "512 MiB", "-"],
        "other": ["unloaded", "0", "0", "0", "700 MiB", "-"],
    }

    code, out, err = await run_cli("load", "demo", "--keep-alive", "10m", "--json", *url, "--api-key", ADMIN)
    assert (code, err) == (0, "")
    loaded = json.loads(out)
    assert (loaded["name"], loaded["state"], loaded["keep_alive"]) == ("demo", "ready", 600)
    (child,) = keyed.children()
    assert loaded["replicas"][0]["pid"] == child.pid

    code, out, err = await run_cli("status", *url, key=ADMIN)
    assert (code, err) == (0, "")
    demo = rows(out)["demo"]
    assert demo[:5] == ["ready", "1", "0", "0", "512 MiB"]
    assert demo[5].endswith("minutes from now")

    code, out, err = await run_cli("pin", "demo", *url, key=ADMIN)
    assert (code, err) == (0, "")
    assert rows(out) == {"demo": ["ready (pinned)", "1", "0", "0", "512 MiB", "Forever"]}
    code, out, _ = await run_cli("status", "--json", *url, key=ADMIN)
    by_name = {m["name"]: m for m in json.loads(out)["models"]}
    assert by_name["demo"]["pinned"] is True
    assert by_name["other"]["state"] == "unloaded"

    code, out, err = await run_cli("unpin", "demo", "--json", *url, key=ADMIN)
    assert (code, err) == (0, "")
    assert json.loads(out)["pinned"] is False

    # Refusals: the daemon's code and message on one line, exit 1; --json also prints the error body.
    code, out, err = await run_cli("load", "nope", *url, key=ADMIN)
    assert (code, out) == (1, "")
    assert err.startswith("llm-supervisor: error: model_not_found: model 'nope' not found")
    assert err.count("\n") == 1
    code, out, err = await run_cli("load", "demo", "--ctx-size", "-1", "--json", *url, key=ADMIN)
    assert code == 1
    assert json.loads(out)["error"]["code"] == "invalid_load_request"
    assert err.startswith("llm-supervisor: error: invalid_load_request: ")
    assert err.count("\n") == 1

    code, out, err = await run_cli("unload", "demo", "--cancel-queued", "--json", *url, key=ADMIN)
    assert (code, err) == (0, "")
    assert json.loads(out)["state"] == "unloaded"
    assert not keyed.children()

    code, out, err = await run_cli("load", "other", "--no-wait", *url, key=ADMIN)
    assert (code, err) == (0, "")
    assert rows(out)["other"][0] in ("unloaded", "loading", "ready")
    await keyed.wait_state("other", "ready")
    code, out, err = await run_cli("unload", "other", *url, key=ADMIN)
    assert (code, err) == (0, "")
    assert rows(out) == {"other": ["unloaded", "0", "0", "0", "700 MiB", "-"]}


async def test_list_and_ps_print_json_with_a_key(keyed: Daemon) -> None:
    code, out, err = await run_cli("list", "--json", "--url", keyed.url, key=USER)
    assert (code, err) == (0, "")
    assert sorted(m["name"] for m in json.loads(out)["models"]) == ["demo:latest", "other:latest"]
    code, out, err = await run_cli("ps", "--json", "--url", keyed.url, "--api-key", USER)
    assert (code, err) == (0, "")
    assert json.loads(out) == {"models": []}


async def _ps_entry(daemon: Daemon) -> dict[str, Any]:
    status, body = await daemon.get("/api/ps")
    assert status == 200
    (entry,) = body["models"]
    return entry  # type: ignore[no-any-return]


async def test_on_simulated_gpus_ps_says_the_model_runs_on_the_cpu(daemon: Daemon) -> None:
    await daemon.chat()
    entry = await _ps_entry(daemon)
    assert (entry["size"], entry["size_vram"], entry["processor"]) == (DEMO["vram_mib"] * MIB, 0, "CPU")
    assert entry["gpus"] == [0]  # the lease is still on the simulated GPU: it is what the budget counts
    (listed,) = (await ollama.AsyncClient(host=daemon.url).ps()).models  # Ollama's client reads it
    assert (listed.size, listed.size_vram) == (DEMO["vram_mib"] * MIB, 0)
    code, out, err = await run_cli("ps", "--url", daemon.url)
    assert (code, err) == (0, "")
    assert out.splitlines()[1].split()[4:6] == ["100%", "CPU"]


@pytest.mark.parametrize("declared", [False, True], ids=["nvml", "budget-declared-on-an-nvml-gpu"])
async def test_on_a_gpu_nvml_sees_ps_says_gpu(make_daemon: MakeDaemon, declared: bool) -> None:
    config: dict[str, Any] = {"gpus": [{"index": 0, "total_mib": 2048}]} if declared else {}
    daemon, _ = await nvml_daemon(
        make_daemon, {"demo": {"vram_mib": 1000}}, [child_memory("demo", 700)], **config
    )
    await daemon.chat()
    entry = await _ps_entry(daemon)
    assert (entry["size_vram"], entry["processor"]) == (1000 * MIB, "GPU")
    code, out, err = await run_cli("ps", "--url", daemon.url)
    assert (code, err) == (0, "")
    assert out.splitlines()[1].split()[4:6] == ["100%", "GPU"]


async def test_v1_models_says_which_models_are_loaded(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(models={"demo": {"aliases": ["demo-alias"]}, "other": {}})

    async def loaded() -> dict[str, bool]:
        status, body = await daemon.get("/v1/models")
        assert status == 200
        return {m["id"]: m["loaded"] for m in body["data"]}

    assert await loaded() == {"demo": False, "demo-alias": False, "other": False}
    await daemon.chat("demo-alias")
    assert await loaded() == {"demo": True, "demo-alias": True, "other": False}
    status, _, _ = await daemon.post("/v1/admin/models/demo/unload")
    assert status == 200
    assert await loaded() == {"demo": False, "demo-alias": False, "other": False}


async def test_a_key_with_a_carriage_return_works_and_a_control_character_is_a_clear_error(
    make_daemon: MakeDaemon,
) -> None:
    """A key file saved with CRLF line ends leaves a carriage return in `$(cat key)`: the CLI printed
    aiohttp's traceback (a review helper). Around the key whitespace is dropped, as the daemon drops it;
    a control character inside it is a one-line usage error."""
    key = "a-long-random-admin-key-0123"
    daemon = await make_daemon(config={"api_key": key})
    code, _, err = await run_cli("ps", "--url", daemon.url, key=key + "\r")
    assert code == 0, err
    code, _, err = await run_cli("ps", "--url", daemon.url, key=key[:5] + "\x01" + key[5:])
    assert code == 2
    assert err.startswith("llm-supervisor: error: the API key holds a control character"), err
    assert "Traceback" not in err

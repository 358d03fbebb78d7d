"""Start-up memory: the model readers (gguf, and so numpy), the hub client and the API description load
when first used."""

from __future__ import annotations

import json
import subprocess
import sys

# Imports that cost ~20 MB (gguf + numpy) and ~14 MB (huggingface_hub's client) of an idle daemon's RSS.
HEAVY = ("gguf", "numpy", "huggingface_hub.errors")

MODULES = (
    "supervisor.pulls",
    "supervisor.store",
    "supervisor.model_info",
    "supervisor.estimates",
    "supervisor.capabilities",
)

# VmRSS, not ru_maxrss: Linux carries ru_maxrss over exec, so it would report pytest's own peak.
_PROBE = """
import json, re, sys
import {modules}
status = open("/proc/self/status").read()
print(json.dumps({{
    "loaded": [m for m in {heavy!r} if m in sys.modules],
    "rss_kib": int(re.search(r"VmRSS:\\s+(\\d+)", status).group(1)),
}}))
"""


def test_importing_the_model_and_pull_modules_loads_neither_gguf_nor_the_hub_client() -> None:
    probe = _PROBE.format(modules=", ".join(MODULES), heavy=HEAVY)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"RSS after importing {', '.join(MODULES)}: {found['rss_kib'] / 1024:.1f} MiB")
    assert found["loaded"] == []


# The API description (its builder and every body's pydantic model, about 1 MiB): not before
# /openapi.json is asked for.
_DESCRIPTION_PROBE = """
import sys
import supervisor.app, supervisor.cli
described = ("supervisor.api.schemas", "supervisor.api.openapi_document")
print("LOADED", [name for name in described if name in sys.modules])
"""


def test_the_api_description_is_not_imported_until_asked_for() -> None:
    probe = [sys.executable, "-c", _DESCRIPTION_PROBE]
    done = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "LOADED []"

"""The process entry point (`python -m supervisor`, the `llm-supervisor` script) and what it leaves out
of the daemon's memory."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.memory import give_back_free_heap

# Runs the entry point the way the console script does, in a process of its own (it changes sys.modules),
# then reports which of the optional imports structlog would have made are loaded.
_PROBE = """
import sys
sys.argv = ["llm-supervisor", "schema"]
from supervisor.__main__ import main
main()
import structlog.dev
print("LOADED", [name for name in ("rich", "greenlet") if sys.modules.get(name) is not None])
"""


def test_the_daemon_process_does_not_load_what_structlog_would_take_unasked() -> None:
    # rich and greenlet are installed here (the test tools need them), as they are on many hosts.
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "LOADED []"
    assert '"oneOf"' in done.stdout  # and the command itself ran


# In a process of its own: the objects frozen would stay out of this one's collections for good.
_FREEZE_PROBE = """
import gc
import supervisor.app
from supervisor.memory import freeze_long_lived
freeze_long_lived()
ring = [[]]
ring[0].append(ring)  # a cycle made after the freeze
del ring
print(gc.get_freeze_count(), gc.collect())
"""


def test_the_long_lived_objects_are_frozen_and_later_cycles_still_collected() -> None:
    done = subprocess.run([sys.executable, "-c", _FREEZE_PROBE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    frozen, collected = map(int, done.stdout.split())
    assert frozen > 10_000  # the package's modules and what they built
    assert collected >= 2


def test_giving_back_the_free_heap_is_harmless_to_call_any_time() -> None:
    give_back_free_heap()
    give_back_free_heap()


# The daemon's entry point (`serve`, stopped at --help), then what aiohttp's default TLS contexts hold
# and the variable as the rest of the process sees it.
_TLS_PROBE = """
import os, sys
sys.argv = ["llm-supervisor", sys.argv[1], "--help"]
from supervisor.__main__ import main
try:
    main()
except SystemExit:
    pass
import aiohttp.connector as connector
print("CA", connector._SSL_CONTEXT_VERIFIED.cert_store_stats()["x509_ca"], os.environ.get("SSL_CERT_FILE"))
"""


@pytest.mark.parametrize("before", [None, "/etc/ssl/certs/ca-certificates.crt"])
def test_the_daemon_leaves_the_ca_bundle_unparsed_and_the_environment_as_it_was(before: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SSL_CERT_FILE"}
    if before is not None:
        env["SSL_CERT_FILE"] = before
    done = subprocess.run(
        [sys.executable, "-c", _TLS_PROBE, "serve"], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"CA 0 {before}"
    # The certificate directory stays: where the system has one, the contexts can still verify.
    assert ssl.get_default_verify_paths().capath is not None


def test_a_client_command_keeps_the_ca_bundle() -> None:
    if not Path(ssl.get_default_verify_paths().cafile or "/nonexistent").is_file():
        pytest.skip("this system has no CA bundle file to load")
    env = {k: v for k, v in os.environ.items() if k != "SSL_CERT_FILE"}
    done = subprocess.run(
        [sys.executable, "-c", _TLS_PROBE, "pull"], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    count, variable = done.stdout.splitlines()[-1].split()[1:]
    assert int(count) > 0
    assert variable == "None"

"""The process entry point (`python -m supervisor`, the `llm-supervisor` script) and what it leaves out
of the daemon's memory."""

from __future__ import annotations

import subprocess
import sys

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

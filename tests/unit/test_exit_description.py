"""describe_exit: what a child's return code means, in the words an operator needs at 3 a.m."""

from __future__ import annotations

import signal

from workers.process import describe_exit


def test_a_plain_exit_gives_the_code() -> None:
    assert describe_exit(1) == "exited with code 1"


def test_a_signal_is_named() -> None:
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"


def test_sigill_says_the_build_does_not_fit_the_cpu() -> None:
    # Seen here: a llama-server wheel built with AVX-512 dies with SIGILL on an AVX2-only host.
    assert "CPU instructions" in describe_exit(-signal.SIGILL)


def test_an_unknown_signal_still_reads_well() -> None:
    assert describe_exit(-99) == "killed by signal 99"

"""The requests this node forwarded to other nodes, while their answers are relayed: a shutdown drains them
as it drains its own (they hold no ticket here), then ends what is left with the API's error.

Each one is tracked by its hop's `gone` future (routing.watched): setting it ends the hop as a node that
left the fleet ends it (an SSE error event, an Ollama error line, else a cut connection), its result the
reason the error names.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

log = structlog.get_logger("fleet")

SHUTTING_DOWN = "this node is shutting down"
# After the cut, how long the relays get to write their error and end: they only need the loop.
_END_GRACE_S = 5.0


class Forwarded:
    def __init__(self) -> None:
        self._hops: set[asyncio.Future[str]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._abandoned = asyncio.Event()

    def __len__(self) -> int:
        return len(self._hops)

    def add(self, gone: asyncio.Future[str]) -> None:
        self._hops.add(gone)
        self._idle.clear()

    def discard(self, gone: asyncio.Future[str]) -> None:
        self._hops.discard(gone)
        if not self._hops:
            self._idle.set()

    def abandon(self) -> None:
        """A second SIGTERM/SIGINT: a running drain stops waiting and ends what is left now."""
        self._abandoned.set()

    async def drain(self, timeout_s: float) -> None:
        """Wait for the forwarded requests to end, up to `timeout_s` or abandon(); then end the rest."""
        if not self._hops:
            return
        log.info("forwarded_draining", inflight=len(self._hops))
        idle = asyncio.ensure_future(self._idle.wait())
        abandoned = asyncio.ensure_future(self._abandoned.wait())
        try:
            await asyncio.wait((idle, abandoned), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
            abandoned.cancel()
        if not self._hops:
            return
        log.warning(
            "forwarded_drain_abandoned" if self._abandoned.is_set() else "forwarded_drain_timeout",
            inflight=len(self._hops),
        )
        for gone in list(self._hops):
            if not gone.done():
                gone.set_result(SHUTTING_DOWN)
        # Their relays write the error and return before the listeners close (which would cut them bare).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), _END_GRACE_S)

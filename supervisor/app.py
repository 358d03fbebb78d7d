"""Wire the daemon together: the aiohttp app, its long-lived parts, and the signal handlers."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import structlog
from aiohttp import web

from supervisor import logs, proxy, systemd
from supervisor.access import AccessControl, fleet_key_refusal, unauthenticated_refusal
from supervisor.api import (
    admin,
    health,
    nodes,
    ollama_chat,
    ollama_models,
    ollama_store,
    openai,
    openapi,
    status,
    ui,
)
from supervisor.api.context import (
    ACCESS,
    CATALOG,
    DATA_POOL,
    EVENTS,
    FLEET,
    METRICS,
    PULLS,
    SCHEDULER,
    STORE,
    UPSTREAM,
)
from supervisor.api.middleware import (
    access_gate,
    close_after_unframed_body,
    cors_headers,
    errors_and_access_log,
    front_refusals,
    server_header,
    timing_headers,
)
from supervisor.config import ConfigError, Settings
from supervisor.dataplane import relay
from supervisor.dataplane.front import FrontServer
from supervisor.dataplane.handoff import new_handler
from supervisor.dataplane.upstream import Address, UpstreamPool
from supervisor.events import EventBus
from supervisor.gpus import GpuInventory, NvmlInitError
from supervisor.keys import KeyRing, KeysFileError
from supervisor.manifests import ManifestLoadError, Registry, load_directory
from supervisor.memory import freeze_long_lived, give_back_free_heap
from supervisor.metrics import Metrics
from supervisor.pulls import Pulls
from supervisor.scheduler import Scheduler
from supervisor.slots import SlotState
from supervisor.store import Catalog, Store, default_hf_cache
from supervisor.watch import ManifestWatcher
from workers import sockets
from workers.process import reap_orphans

log = structlog.get_logger("app")


# Idle keep-alive connections close after this; a client also has this long to send a request's head.
KEEPALIVE_TIMEOUT_S = 75.0


def build_app(settings: Settings, registry: Registry, keys: KeyRing) -> web.Application:
    """The aiohttp application; its scheduler and upstream session live and die with it.

    `registry` is the manifest files'; the scheduler serves it together with the model store's models.
    """
    app = web.Application(
        client_max_size=settings.max_body_mib * 2**20,
        middlewares=[front_refusals, errors_and_access_log, access_gate],
    )
    app[ACCESS] = AccessControl(settings, keys)
    app[health.START_UP] = start_up = health.StartUp()
    app.on_response_prepare.append(timing_headers)
    app.on_response_prepare.append(cors_headers)
    app.on_response_prepare.append(server_header)
    app.on_response_prepare.append(close_after_unframed_body)
    app.add_routes(openai.routes)
    app.add_routes(health.routes)
    app.add_routes(admin.routes)
    app.add_routes(nodes.routes)
    app.add_routes(ollama_chat.routes)
    app.add_routes(ollama_models.routes)
    app.add_routes(ollama_store.routes)
    app.add_routes(status.routes)
    app.add_routes(ui.routes)
    app.add_routes(openapi.routes)
    metrics = Metrics()
    app[METRICS] = metrics
    store = Store(
        settings.hf_cache or default_hf_cache(),
        settings.store_dir or settings.state_dir / "store",
    )
    catalog = Catalog(store, registry, settings)
    pulls = Pulls(store, on_stored=catalog.refresh, settings=settings, files_in_use=catalog.files_in_use)
    app[STORE] = store
    app[CATALOG] = catalog
    app[PULLS] = pulls
    events = app[EVENTS] = pulls.events = EventBus()
    app.on_shutdown.append(admin.end_event_streams)  # before the server waits for open handlers

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        reaped = await reap_orphans(settings.state_dir, settings.stop_grace_s)
        sockets.remove_left_listener(settings.state_dir)
        if reaped:
            log.warning("orphans_reaped", count=len(reaped))
        try:
            inventory = await asyncio.to_thread(GpuInventory.detect, settings.gpus)  # NVML calls block
        except NvmlInitError as exc:
            log.error("nvml_init_failed", error=str(exc))
            raise
        log.info(
            "gpus",
            source=inventory.source,
            gpus=[{"index": g.index, "total_mib": g.total_mib, "name": g.name} for g in inventory.gpus],
        )
        pool = app[DATA_POOL] = UpstreamPool()
        app.on_cleanup.append(lambda _: _close_pool(pool))
        async with proxy.new_upstream_session() as session:
            await pulls.recover()  # the pulls the last run left unfinished, before the store is read
            served = await asyncio.to_thread(catalog.registry)
            log.info(
                "store_loaded",
                cache=str(store.cache_dir),
                models=sorted(set(served.models) - set(registry.models)),
            )
            # The fleet (redis_url): shared GPUs lease through it, so it exists before the scheduler.
            fleet = None
            if settings.redis_url is not None:
                from supervisor.fleet.fleet import Fleet  # with redis: loaded only for a fleet

                fleet = Fleet(settings, metrics, inventory.gpus)
            shared = fleet.shared if fleet is not None else None
            scheduler = Scheduler(settings, served, inventory, session, metrics, events, shared)
            catalog.scheduler = scheduler
            app[UPSTREAM] = session
            app[SCHEDULER] = scheduler
            metrics.watch(lambda: scheduler)
            if fleet is not None:
                app[FLEET] = fleet
                await fleet.start(scheduler)
            scheduler.load_pinned()
            # Created right after the keepers, so it sees each pinned model's first load task.
            pinned = asyncio.ensure_future(_first_pinned_loads(scheduler, start_up))
            try:
                yield
            finally:
                pinned.cancel()
                await pulls.close()
                await scheduler.shutdown()
                if fleet is not None:
                    await fleet.close()  # after the shutdown released our shared leases
                inventory.close()

    app.cleanup_ctx.append(lifetime)
    return app


async def _close_pool(pool: UpstreamPool) -> None:
    pool.close()


async def _first_pinned_loads(scheduler: Scheduler, start_up: health.StartUp) -> None:
    """Set `start_up.pinned_settled` once every pinned model is READY or its first load has ended.

    A failed first load counts as ended: its keeper retries it, and the other models are served meanwhile.
    """
    loads: dict[str, asyncio.Future[Any]] = {}  # slot key -> the first load seen for it
    while True:
        waiting = [
            slot
            for slot in scheduler.slots.values()
            if slot.manifest.pinned
            and slot.state != SlotState.READY
            and slot.last_error is None
            and not (slot.key in loads and loads[slot.key].done())
        ]
        start_up.waiting_for = sorted(slot.name for slot in waiting)
        if not waiting:
            start_up.pinned_settled.set()
            return
        for slot in waiting:
            if slot.key not in loads and slot.load_task is not None:
                loads[slot.key] = slot.load_task
        changes: list[asyncio.Future[Any]] = [asyncio.ensure_future(slot.changed.wait()) for slot in waiting]
        pending = [loads[slot.key] for slot in waiting if slot.key in loads]
        try:  # the timeout only picks up a pinned model that a reload added meanwhile
            await asyncio.wait([*changes, *pending], timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for change in changes:
                change.cancel()


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_HANDLED_SIGNALS = (signal.SIGHUP, *_STOP_SIGNALS)


class SignalQueue:
    """Signal handlers only queue the signal; the main loop acts on it at a safe point (gunicorn's arbiter).

    Installed first thing, so a signal during start-up waits for start-up to end instead of killing the
    daemon with its children half set up. `stops` counts SIGTERM/SIGINT: the second one cuts the drain.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, early: Sequence[signal.Signals] = ()) -> None:
        self.queue: asyncio.Queue[signal.Signals] = asyncio.Queue()
        self.stops: list[signal.Signals] = []
        self._loop = loop
        self._previous = {sig: signal.getsignal(sig) for sig in _HANDLED_SIGNALS}
        for sig in _HANDLED_SIGNALS:
            loop.add_signal_handler(sig, self._received, sig)
        for sig in early:  # caught by the CLI before there was a loop
            self._received(sig)

    def _received(self, sig: signal.Signals) -> None:
        if sig in _STOP_SIGNALS:
            self.stops.append(sig)
        self.queue.put_nowait(sig)

    def request_reload(self, _changed: Sequence[str] = ()) -> None:
        """A changed manifest asks for a reload as SIGHUP does: one queue keeps reloads one at a time."""
        self.queue.put_nowait(signal.SIGHUP)

    def close(self) -> None:
        """Give the signals back to the handlers found at install (the CLI's: remember, never die)."""
        for sig, previous in self._previous.items():
            self._loop.remove_signal_handler(sig)
            if previous is not None:
                signal.signal(sig, previous)


async def serve(
    settings: Settings, reload_settings: Callable[[], Settings], early_signals: Sequence[signal.Signals] = ()
) -> int:
    """Run until SIGTERM/SIGINT; SIGHUP reloads. `reload_settings` re-reads file, environment and flags.

    `early_signals` arrived before the loop ran; they are acted on as if they came now. Under systemd
    (`NOTIFY_SOCKET`) it reports READY/RELOADING/STOPPING and keeps the watchdog fed.
    """
    signals = SignalQueue(asyncio.get_running_loop(), early_signals)
    notifier = systemd.Notifier.from_environ()
    watchdog = asyncio.ensure_future(notifier.keep_watchdog())
    try:
        return await _serve(settings, reload_settings, signals, notifier)
    finally:
        watchdog.cancel()
        signals.close()


async def _serve(
    settings: Settings,
    reload_settings: Callable[[], Settings],
    signals: SignalQueue,
    notifier: systemd.Notifier,
) -> int:
    try:
        registry = load_directory(settings.manifests)
    except ManifestLoadError as exc:
        for error in exc.errors:
            log.error("manifest_invalid", error=str(error))
        return 2
    log.info("manifests_loaded", directory=str(settings.manifests), models=sorted(registry.models))
    try:
        keys = KeyRing.from_settings(settings)
    except KeysFileError as exc:
        log.error("api_keys_invalid", error=str(exc))
        return 2
    if (refusal := unauthenticated_refusal(settings, keys)) is not None:
        log.error("unauthenticated_listener_refused", host=settings.host, reason=refusal)
        return 2
    if (refusal := fleet_key_refusal(settings, keys)) is not None:
        log.error("node_key_missing", reason=refusal)
        return 2
    app = build_app(settings, registry, keys)
    gate = app[ACCESS]  # holds the settings as last reloaded
    # Where no key is needed, a Host name that is not this machine's gets 403 (DNS rebinding): say which
    # are, for an operator whose clients or proxy use another (allowed_hosts).
    hosts = gate.hosts_answered() if gate.host_checked else None
    log.info("access", api_keys=len(keys), host_check=gate.host_checked, hosts_allowed=hosts)
    watcher = ManifestWatcher(
        directory=lambda: gate.settings.manifests,
        enabled=lambda: gate.settings.watch_manifests,
        on_change=signals.request_reload,
    )
    background: list[asyncio.Future[None]] = [asyncio.ensure_future(watcher.run())]  # first look: baseline
    stop_timing_gc = app[METRICS].time_gc()
    try:
        return await _run(app, settings, reload_settings, signals, notifier, background)
    finally:
        stop_timing_gc()
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)


async def _run(
    app: web.Application,
    settings: Settings,
    reload_settings: Callable[[], Settings],
    signals: SignalQueue,
    notifier: systemd.Notifier,
    background: list[asyncio.Future[None]],
) -> int:
    """Start up, listen, act on signals and reloads until stopped, shut down; the exit code."""
    start_up = app[health.START_UP]
    # handler_cancellation: a client that disconnects cancels its handler, and so its upstream request.
    # Header lines, header count and idle connections are bounded (aiohttp's limits, made explicit).
    # Bodies are never unpacked: a compressed one is refused (gate.check_body_encoding), and one that
    # got past that must not grow to 1000 times what was counted against max_buffered_mib.
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        auto_decompress=False,
        access_log=None,
        keepalive_timeout=KEEPALIVE_TIMEOUT_S,
        max_line_size=8190,
        max_field_size=8190,
        max_headers=100,
    )
    front: FrontServer | None = None
    listener: asyncio.Server | None = None
    freeze_long_lived()  # the app as built: before any request, load or child exists
    try:  # orphan reaping, GPUs, the scheduler, pinned loads: a signal now waits in the queue
        await runner.setup()
    except NvmlInitError:
        return 2  # logged (nvml_init_failed) where it was found
    if signals.stops:
        # Stopped during start-up: never listen; the normal shutdown stops whatever start-up began.
        log.info("shutdown_started", signal=signals.stops[0].name, during="start-up")
        notifier.stopping()
    else:
        assert runner.server is not None
        # aiohttp's own listener, which the front tunnels other routes' requests to: a Unix socket in the
        # daemon's private directory, as the children's are. On a loopback port any local process could
        # reach it past the front's bounds on heads and connections.
        internal_socket = sockets.new_endpoint().socket
        internal_address: Address
        if internal_socket is not None:
            await web.UnixSite(runner, str(internal_socket)).start()
            sockets.record_listener(settings.state_dir, internal_socket)
            internal_address = str(internal_socket)
        else:  # the temporary directory's path is too long for a socket
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            internal_address = (runner.addresses[0][0], runner.addresses[0][1])
        # aiohttp's handler for the connections the front hands over, with its own errors in the API's shape
        handoff = functools.partial(new_handler, runner.server)
        front = FrontServer(app, handoff, app[DATA_POOL], relay.serve, KEEPALIVE_TIMEOUT_S, internal_address)
        try:
            listener = await asyncio.get_running_loop().create_server(
                front, settings.host, settings.port, reuse_address=True
            )
        except OSError as exc:
            log.error(
                "listen_failed",
                host=settings.host,
                port=settings.port,
                error=str(exc),
                hint="another process may hold the port: choose another with --port or LLM_SUPERVISOR_PORT",
            )
            await runner.cleanup()
            return 1
        log.info(
            "listening",
            addresses=[_url(s.getsockname()) for s in listener.sockets],
            state_dir=str(settings.state_dir),
        )
        background.append(asyncio.ensure_future(_announce_ready(start_up, notifier)))
        while not signals.stops:
            if await signals.queue.get() == signal.SIGHUP and not signals.stops:
                announced = start_up.done  # systemd hears RELOADING only from a service it saw READY
                if announced:
                    notifier.reloading()
                await reload(app[CATALOG], app[ACCESS], reload_settings, app[PULLS])
                if announced:
                    notifier.ready()
        log.info("shutdown_started", signal=signals.stops[0].name)
        notifier.stopping()
    await _shut_down(app, signals)
    # Until now new requests were answered `shutting_down` (and /health 503), as probes expect.
    if listener is not None:
        listener.close()
    if front is not None:
        front.stop_tunnelling()
    await runner.cleanup()  # ends aiohttp's streams (events, logs) cleanly, through the front's tunnels
    if front is not None:
        front.close_all()
        if isinstance(front.internal, str):  # the listener's socket file outlives its close
            with contextlib.suppress(OSError):
                os.unlink(front.internal)
            sockets.forget_listener(settings.state_dir)
    sockets.remove_directory()  # last: the children's sockets went with them, the listener's just now
    log.info("shutdown_complete")
    return 0


def _url(address: Any) -> str:
    host, port = address[0], address[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def _announce_ready(start_up: health.StartUp, notifier: systemd.Notifier) -> None:
    """Listening already; once the pinned models' first loads have ended, /health/ready turns 200 and
    systemd hears READY=1."""
    if not start_up.pinned_settled.is_set():
        notifier.status("loading pinned models")
    await start_up.pinned_settled.wait()
    start_up.done = True
    log.info("start_up_complete")
    give_back_free_heap()
    notifier.ready()


async def _shut_down(app: web.Application, signals: SignalQueue) -> None:
    """Drain and stop every child, with pulls cancelled alongside; a second SIGTERM/SIGINT cuts the drain.

    The scheduler's shutdown is started first: it stops accepting at its very start, so /health turns
    503 and new requests get `shutting_down` at once, whatever the pulls take to close.
    """
    scheduler = app[SCHEDULER]
    # Tasks start in the order they are created: the scheduler's `accepting = False` runs first, so the
    # fleet learns at once that this node takes nothing new (its record says healthy: false).
    closing = [scheduler.shutdown(), app[PULLS].close()]
    fleet = app.get(FLEET)
    if fleet is not None:
        closing.append(fleet.leaving())  # and drains the requests forwarded to other nodes
    stopping: asyncio.Future[Any] = asyncio.gather(*closing)
    abandoned = False
    while True:
        if len(signals.stops) > 1 and not abandoned:
            abandoned = True
            log.warning("second_stop_signal", signal=signals.stops[-1].name)
            scheduler.abandon_drain()  # logs drain_abandoned with what was still in flight
            if fleet is not None:
                fleet.forwarded.abandon()
        if stopping.done():
            break
        waiting: asyncio.Future[Any] = asyncio.ensure_future(signals.queue.get())
        await asyncio.wait([stopping, waiting], return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()  # a signal it took is already counted in `signals.stops`
    await stopping


async def reload(
    catalog: Catalog,
    gate: AccessControl,
    reload_settings: Callable[[], Settings],
    pulls: Pulls | None = None,
) -> None:
    """Re-read settings, keys, manifests and the store; on any error keep everything as it was and say why."""

    def read() -> tuple[Settings, Settings, KeyRing, Registry]:  # file I/O: in a thread, so the loop serves
        settings = reload_settings()
        # A restart-only setting keeps the value the daemon runs with until it restarts (the scheduler
        # logs which changed: reload_needs_restart), everywhere: the gate and the keys read it from
        # `running`. Taken from the new file, a node key changed on every node broke forwarding until
        # each restarted, and allow_unauthenticated took effect while the log said it had not.
        running = settings.model_copy(update={k: getattr(gate.settings, k) for k in Settings.RESTART_ONLY})
        return settings, running, KeyRing.from_settings(running), load_directory(running.manifests)

    try:
        settings, running, keys, registry = await asyncio.to_thread(read)
    except ConfigError as exc:
        log.error("reload_rejected", reason="invalid settings", error=str(exc))
        return
    except KeysFileError as exc:
        log.error("reload_rejected", reason="invalid api keys", error=str(exc))
        return
    except ManifestLoadError as exc:
        log.error("reload_rejected", reason="invalid manifests", errors=[str(e) for e in exc.errors])
        return
    except Exception as exc:  # a bug in reading them: still no reason to stop serving what runs
        log.error("reload_rejected", reason="internal error", error=repr(exc), exc_info=exc)
        return
    if (refusal := unauthenticated_refusal(running, keys)) is not None:
        log.error("reload_rejected", reason="no api key left", error=refusal)
        return
    if (refusal := fleet_key_refusal(running, keys)) is not None:
        log.error("reload_rejected", reason="no node key", error=refusal)
        return
    gate.replace(running, keys)
    if pulls is not None:
        pulls.reload(running)
    logs.configure(running.log_format, running.log_level)
    await catalog.refresh(registry, settings)  # the scheduler's reload says which restart-only ones changed

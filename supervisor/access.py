"""Who is calling, and what they may do: API keys, roles, model filters, browser Origin and Host checks.

The gate (supervisor/api/gate.py) asks this module about every request before any route runs; routes
never check keys themselves. They ask `caller(request)` what the caller may use. The keys come from
supervisor/keys.py.
"""

from __future__ import annotations

import fnmatch
import hashlib
import ipaddress
import os
import socket
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal
from urllib.parse import urlsplit

import structlog
from aiohttp import web

from supervisor.config import Settings
from supervisor.errors import SupervisorError, model_not_found

if TYPE_CHECKING:
    from supervisor.keys import KeyRing

log = structlog.get_logger("access")

Role = Literal["inference", "admin"]

# Set on every request by the gate (api/gate.py identify_caller), for either server.
REQUEST_CALLER: Final = "llm_supervisor.caller"

# Routes anyone may call, with or without a key: orchestrators' probes, Ollama clients' discovery, and
# the API's description.
OPEN_ROUTES: Final = frozenset(
    {
        ("GET", "/health"),
        ("GET", "/health/live"),
        ("GET", "/health/ready"),
        ("GET", "/"),
        ("HEAD", "/"),
        ("GET", "/api/version"),
        ("GET", "/openapi.json"),
    }
)
# Browsers on the user's own machine; any port.
_LOOPBACK_NAMES: Final = ("localhost", "127.0.0.1", "[::1]")
_LOOPBACK_ORIGINS: Final = tuple(
    f"{scheme}://{name}" for scheme in ("http", "https") for name in _LOOPBACK_NAMES
)


@dataclass(frozen=True)
class Caller:
    """The identity a request proved, or the anonymous caller when no key is configured at all."""

    name: str | None  # the key's name (never the key); None when keys are off
    role: Role
    models: tuple[str, ...] = ("*",)  # globs of model names this caller may use
    max_priority: int | None = None
    max_concurrent: int | None = None
    keys_configured: bool = False
    node: bool = False  # proved with the fleet's node key: another node forwarding a checked request

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def sees_internals(self) -> bool:
        """Absolute paths and internal URLs go only to an admin who proved it with a key."""
        return self.keys_configured and self.is_admin

    def allows_model(self, *names: str) -> bool:
        """True when any of `names` (a model's name and aliases) matches one of this caller's globs."""
        if "*" in self.models:
            return True
        return any(fnmatch.fnmatchcase(n, pattern) for n in names for pattern in self.models)

    def check_model(self, name: str, aliases: Iterable[str] = (), requested: str | None = None) -> None:
        """Raise 404 `model_not_found`, as for a name no model has, unless this caller may use the model
        (`requested`: the name as the request gave it). A 403 naming the model told a key which models it
        could not see existed, by guessing, and under which spelling; OpenAI answers 404 alike. The
        operator's log says why (`model_not_allowed`)."""
        if not self.allows_model(name, *aliases):
            log.info("model_not_allowed", key=self.name, model=name)
            raise model_not_found(requested if requested is not None else name)

    def cap_priority(self, priority: int | None) -> int | None:
        """The priority this caller may ask for: clamped to its key's `max_priority`."""
        if self.max_priority is None or priority is None:
            return priority
        return min(self.max_priority, priority)


ANONYMOUS: Final = Caller(name=None, role="admin")


def caller(request: web.Request) -> Caller:
    """The caller the access middleware proved for this request (anonymous admin when keys are off)."""
    found = request.get(REQUEST_CALLER)
    return found if isinstance(found, Caller) else ANONYMOUS


def presented_key(request: web.Request) -> str | None:
    """The key a request carries: `Authorization: Bearer <key>`, else `x-api-key`."""
    auth = request.headers.get("Authorization")
    if auth is not None:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    return request.headers.get("x-api-key") or None


def required_role(method: str, path: str, metrics_public: bool) -> Role | None:
    """None for open routes; else the role a route needs."""
    if (method, path) in OPEN_ROUTES:
        return None
    if method in ("GET", "HEAD") and (path == "/ui" or path.startswith("/ui/")):
        return None  # the dashboard's static files hold no data; its calls go to admin routes
    if path == "/metrics":
        return "inference" if metrics_public else "admin"
    if (
        path.startswith(("/v1/admin/", "/api/pull"))
        or path in ("/api/status", "/api/delete")
        or (method == "DELETE" and path.startswith("/api/"))
    ):
        return "admin"
    return "inference"


def is_loopback_host(host: str) -> bool:
    """True for a listen address only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def origin_allowed(origin: str, extra: Iterable[str], host: str | None = None) -> bool:
    """Pages served from this machine (http(s)://localhost, 127.0.0.1, [::1] on any port), a glob, or
    the daemon's own pages (the Origin names the Host the request was sent to: /ui on a LAN address).

    The same-origin rule cannot be used for DNS rebinding: where no key is needed (a loopback listener,
    or `allow_unauthenticated`) the Host check refuses a rebound name first, and elsewhere every route
    that does anything needs a key the rebinding page does not have.
    """
    if host is not None and origin.lower() in (f"http://{host.lower()}", f"https://{host.lower()}"):
        return True
    for base in _LOOPBACK_ORIGINS:
        if origin == base or (origin.startswith(base + ":") and origin[len(base) + 1 :].isdigit()):
            return True
    return any(fnmatch.fnmatchcase(origin, pattern) for pattern in extra)


# Host headers found to name this machine: every request carries one, nearly always the same few. Whatever
# `allowed_hosts` says, these stay allowed, so they are kept (bounded); a name allowed by a glob is not.
_OWN_HOSTS_SEEN: Final[set[str]] = set()
_OWN_HOSTS_MAX: Final = 64
# The machine's own name (`http://gpu-box:11435` from the LAN): a rebinding page's name is the attacker's.
_HOSTNAME: Final = socket.gethostname()
_THIS_MACHINE: Final = _HOSTNAME.lower()


def host_allowed(host_header: str, extra: Iterable[str]) -> bool:
    """Whether a Host header names this machine (any port): a loopback name, an IP address, the
    machine's own name, or an `allowed_hosts` glob. A DNS-rebinding page is served from a name its
    author controls and the browser sends that name; an IP address in Host means the page came from
    that address, which is the daemon's own."""
    if host_header in _OWN_HOSTS_SEEN:
        return True
    host = host_header.strip().lower()
    if host.startswith("["):
        name = host[: host.find("]") + 1] if "]" in host else host
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    if name.endswith("."):
        name = name[:-1]
    if name in _LOOPBACK_NAMES or (name == _THIS_MACHINE and name != "") or _is_address(name):
        if len(_OWN_HOSTS_SEEN) < _OWN_HOSTS_MAX:
            _OWN_HOSTS_SEEN.add(host_header)
        return True
    return any(fnmatch.fnmatchcase(name, pattern.lower()) for pattern in extra)


def _is_address(name: str) -> bool:
    """An IPv4 address, or an IPv6 one in brackets (as a Host header writes it)."""
    if name.startswith("["):
        if not name.endswith("]"):
            return False
        name = name[1:-1]
    elif ":" in name:
        return False
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def unauthenticated_refusal(settings: Settings, keys: KeyRing) -> str | None:
    """Why the daemon must not start: listening beyond loopback with nobody required to prove who they are."""
    if keys.configured or settings.allow_unauthenticated or is_loopback_host(settings.host):
        return None
    return (
        f"refusing to listen on {settings.host} without an API key, since anyone who can reach it could "
        "load, pull and delete models. Set `api_keys_file` or `api_key` (env LLM_SUPERVISOR_API_KEY), "
        "or `allow_unauthenticated: true` if something in front of the daemon already authenticates"
    )


def fleet_key_refusal(settings: Settings, keys: KeyRing) -> str | None:
    """Why a fleet node must not run with these keys: with API keys and no `node_key`, a request it
    forwards carries no key the other node accepts, so every forwarded request would be refused there."""
    if settings.redis_url is None or not keys.configured or settings.node_key is not None:
        return None
    return (
        "a fleet node (redis_url) with API keys needs `node_key` (env LLM_SUPERVISOR_NODE_KEY), the same on "
        "every node: the nodes prove themselves with it when they forward a request to each other"
    )


class AccessControl:
    """The daemon's keys and the limits it enforces before a route runs; SIGHUP replaces the keys."""

    def __init__(self, settings: Settings, keys: KeyRing) -> None:
        self.settings = settings
        self.keys = keys
        self.loopback_listener = is_loopback_host(settings.host)
        # What vLLM prefix-cache salts are made from (cache_salt): from the node key when there is one, so
        # that a key's salt is the same on every node of a fleet, and its requests forwarded to a node share
        # a cache with those sent there directly; else one made at start. The node key is restart-only.
        node_key = settings.node_key
        self._salt_secret = (
            hashlib.sha256(b"llm-supervisor cache salt\0" + node_key.get_secret_value().encode()).digest()
            if node_key is not None
            else os.urandom(32)
        )
        self.inflight: Counter[str] = Counter()  # requests in progress per key name
        self.buffered_bytes = 0  # request bodies held in memory now, over all requests

    @property
    def settings(self) -> Settings:
        return self._settings

    @settings.setter
    def settings(self, settings: Settings) -> None:
        # The body limits in bytes, kept with the settings: every request reads them, and a pydantic
        # model's attribute costs a few hundred instructions to read.
        self._settings = settings
        # The name this daemon gives itself (advertise_url, the listen address) is one of its own: a
        # fleet peer's forwarded request comes under it.
        advertised = urlsplit(settings.advertised_url()).hostname
        self.allowed_hosts = settings.allowed_hosts + ((advertised,) if advertised else ())
        self.max_body_bytes = settings.max_body_mib * 2**20
        self.max_buffered_bytes = settings.max_buffered_mib * 2**20

    def replace(self, settings: Settings, keys: KeyRing) -> None:
        """A SIGHUP's new keys and settings (their restart-only ones the running daemon's: app.reload)."""
        self.keys = keys
        self.settings = settings

    def cache_salt(self, key_name: str) -> str:
        """A key's vLLM prefix-cache salt: stable for the key, and no client can make another's."""
        return hashlib.sha256(self._salt_secret + key_name.encode()).hexdigest()

    @property
    def host_checked(self) -> bool:
        """Whether requests' Host names are checked (DNS rebinding): on a loopback listener, and on any
        listener without keys (`allow_unauthenticated`), where a rebinding page would need nothing more.
        Beyond loopback with keys every route that does anything needs a key, which such a page lacks."""
        return self.loopback_listener or not self.keys.configured

    def hosts_answered(self) -> list[str]:
        """The Host names `host_allowed` takes, in words, for an operator whose clients or proxy use
        another (the start-up log)."""
        own = [_HOSTNAME] if _HOSTNAME else []
        return ["localhost", "IP addresses", *own, *self.allowed_hosts]

    def still_admits(self, request: web.Request) -> bool:
        """Whether the request's key still opens its route, with the keys as they are now: a stream
        opened before a SIGHUP removed its key (or its admin role) ends."""
        try:
            self.identify(request)
        except SupervisorError:
            return False
        return True

    def identify(self, request: web.Request) -> Caller:
        """Who sent this request, or a 401/403 SupervisorError; anonymous admin when keys are off."""
        if not self.keys.configured:
            return ANONYMOUS
        need = required_role(request.method, request.path, self.settings.metrics_public)
        key = presented_key(request)
        who = self.keys.identify(key) if key is not None else None
        if who is None:
            if need is None:
                return Caller(name=None, role="inference", models=(), keys_configured=True)
            raise SupervisorError(
                "invalid_api_key",
                "a valid API key is required: send `Authorization: Bearer <key>` (or `x-api-key`)"
                if key is None
                else "the API key is not valid",
                401,
            )
        if need == "admin" and not who.is_admin:
            # A valid key, refused for its role: the access log names the key that tried (an audit trail
            # of attempts to act beyond it), as it does for the requests its key may send.
            request[REQUEST_CALLER] = who
            raise SupervisorError(
                "forbidden", f"{request.method} {request.path} needs an admin key; '{who.name}' is not", 403
            )
        return who

"""Shared GPU leases in Redis: one VRAM budget per GPU for every supervisor and GPU service that uses it.

A shared GPU is named `<gpu_host>:<index>`. Its keys:

- `llmsup:gpu:<gpu>` (hash): `capacity_mib` (total minus margin), `total_mib`, `registered_by`; written by
  each supervisor that declares the GPU shared.
- `llmsup:leases:<gpu>` (hash): lease id -> JSON {id, gpu, owner, mib, priority, kind, taken_at,
  expires_at} (times in ms of Redis's clock, so hosts' clocks never matter).
- `llmsup:wants:<gpu>` (hash): want id -> JSON {id, gpu, owner, mib, priority, expires_at}: a take that
  did not fit and is still waiting, so supervisors can see it (and evict for it if allowed).
- `llmsup:lease-gpu` (hash): lease id -> gpu, so a lease can be renewed or released by its id alone.
- `llmsup:gpus` (set): every GPU that has been registered or leased.

Every write is one Lua script (atomic in Redis): a take purges expired leases, sums the rest and refuses
if the sum plus its MiB would exceed the capacity, so two holders are never over it together. A holder
renews its lease (every TTL/3) while it holds the memory; one that dies stops renewing and its lease
expires. These functions raise Redis errors; callers that serve requests go through RedisLink.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Literal

import structlog
from redis.asyncio import Redis

PREFIX = "llmsup:"
GPUS_KEY = PREFIX + "gpus"
LEASE_INDEX_KEY = PREFIX + "lease-gpu"


log = structlog.get_logger("fleet")


def gpu_key(gpu_host: str, index: int) -> str:
    """The name two supervisors (and any other service) on one machine use for the same GPU."""
    return f"{gpu_host}:{index}"


def _info_key(gpu: str) -> str:
    return f"{PREFIX}gpu:{gpu}"


def _leases_key(gpu: str) -> str:
    return f"{PREFIX}leases:{gpu}"


def _wants_key(gpu: str) -> str:
    return f"{PREFIX}wants:{gpu}"


def new_id(prefix: str = "lease") -> str:
    return f"{prefix}-{secrets.token_hex(8)}"


class LeaseLost(Exception):
    """A lease that expired (its holder renewed it too late) and whose room others hold now."""


@dataclass(frozen=True)
class SharedLease:
    id: str
    gpu: str
    owner: str
    mib: int
    priority: int
    kind: str
    taken_at_ms: int
    expires_at_ms: int

    @classmethod
    def from_json(cls, raw: str) -> SharedLease:
        d = json.loads(raw)
        return cls(
            str(d["id"]),
            str(d["gpu"]),
            str(d["owner"]),
            int(d["mib"]),
            int(d.get("priority", 0)),
            str(d.get("kind", "external")),
            int(d.get("taken_at", 0)),
            int(d["expires_at"]),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "gpu": self.gpu,
            "owner": self.owner,
            "mib": self.mib,
            "priority": self.priority,
            "kind": self.kind,
            "taken_at": self.taken_at_ms / 1000,
            "expires_at": self.expires_at_ms / 1000,
        }


@dataclass(frozen=True)
class Want:
    """A take that did not fit yet: who waits for how much, at which priority."""

    id: str
    gpu: str
    owner: str
    mib: int
    priority: int
    expires_at_ms: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "gpu": self.gpu,
            "owner": self.owner,
            "mib": self.mib,
            "priority": self.priority,
            "expires_at": self.expires_at_ms / 1000,
        }


@dataclass(frozen=True)
class TakeResult:
    outcome: Literal["ok", "refused", "unregistered", "never_fits"]
    # What was left for others after this take (ok) or before it (refused); never_fits: the capacity.
    free_mib: int
    lease: SharedLease | None = None


@dataclass(frozen=True)
class GpuBudget:
    """One shared GPU as Redis sees it now."""

    gpu: str
    capacity_mib: int | None  # None: no supervisor registered it
    leases: list[SharedLease]
    wants: list[Want]

    @property
    def leased_mib(self) -> int:
        return sum(lease.mib for lease in self.leases)

    @property
    def free_mib(self) -> int | None:
        return None if self.capacity_mib is None else self.capacity_mib - self.leased_mib

    def as_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "capacity_mib": self.capacity_mib,
            "leased_mib": self.leased_mib,
            "free_mib": self.free_mib,
            "leases": [lease.as_dict() for lease in self.leases],
            "wants": [want.as_dict() for want in self.wants],
        }


# Milliseconds of Redis's own clock; scripts replicate their effects (Redis >= 5), so reading TIME is fine.
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# An entry (a lease or a want) decoded, or nil when it is not one: not JSON, or without the fields every
# reader needs. One bad value (a stray HSET) made cjson.decode raise in every script on that GPU, and the
# GPU was unusable; such an entry is now dropped, as an expired one is.
_ENTRY = """
local function entry(raw)
  local ok, e = pcall(cjson.decode, raw)
  if not ok or type(e) ~= 'table' or type(e.id) ~= 'string' or type(e.gpu) ~= 'string'
      or type(e.owner) ~= 'string' or type(e.mib) ~= 'number' or type(e.expires_at) ~= 'number'
      or (e.priority ~= nil and type(e.priority) ~= 'number')
      or (e.taken_at ~= nil and type(e.taken_at) ~= 'number') then
    return nil
  end
  return e
end
"""

# Drop expired and unreadable leases (and their index entries) from KEYS[1]; sum the live ones into
# `used`; the fields of the unreadable ones in `dropped`.
_PURGE = (
    _ENTRY
    + """
local used = 0
local dropped = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local lease = entry(all[i + 1])
  if lease == nil then table.insert(dropped, all[i]) end
  if lease == nil or lease.expires_at <= now then
    redis.call('HDEL', KEYS[1], all[i])
    redis.call('HDEL', KEYS[3], all[i])
  else
    used = used + lease.mib
  end
end
"""
)

# KEYS: leases, gpu info, lease index, wants, gpus set.
# ARGV: gpu, lease id, owner, mib, ttl ms, priority, kind, capacity if unregistered ('' = none),
#       want id ('' = record no want), want ttl ms.
_TAKE = (
    _NOW
    + _PURGE
    + """
local cap = redis.call('HGET', KEYS[2], 'capacity_mib')
if not cap then
  if ARGV[8] == '' then return {'unregistered', 0} end
  cap = ARGV[8]
end
cap = tonumber(cap)
local mib = tonumber(ARGV[4])
if mib > cap then return {'never_fits', cap} end
if used + mib > cap then
  if ARGV[9] ~= '' then
    redis.call('HSET', KEYS[4], ARGV[9], cjson.encode({id = ARGV[9], gpu = ARGV[1], owner = ARGV[3],
      mib = mib, priority = tonumber(ARGV[6]), expires_at = now + tonumber(ARGV[10])}))
  end
  return {'refused', cap - used}
end
local lease = cjson.encode({id = ARGV[2], gpu = ARGV[1], owner = ARGV[3], mib = mib,
  priority = tonumber(ARGV[6]), kind = ARGV[7], taken_at = now, expires_at = now + tonumber(ARGV[5])})
redis.call('HSET', KEYS[1], ARGV[2], lease)
redis.call('HSET', KEYS[3], ARGV[2], ARGV[1])
redis.call('SADD', KEYS[5], ARGV[1])
if ARGV[9] ~= '' then redis.call('HDEL', KEYS[4], ARGV[9]) end
return {'ok', cap - used - mib, lease}
"""
)

# KEYS: leases, gpu info, lease index.  ARGV: lease id, ttl ms, restore JSON ('' = none).
# A lease that is gone (expired, or Redis lost it) is put back as given when `restore` is passed: the
# holder still has the memory, so leaving it out would let another take it twice. Unless the room went
# meanwhile: a holder that renewed too late (paused past its TTL) while another took its place has lost
# it ('conflict'), and must give the memory up; putting it back would lease the GPU over its capacity.
_RENEW = (
    _NOW
    + _PURGE
    + """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
local lease
if raw then
  lease = entry(raw)
  if lease ~= nil and lease.expires_at <= now then lease = nil end
end
local outcome = 'ok'
if not lease then
  if ARGV[3] == '' then
    redis.call('HDEL', KEYS[1], ARGV[1])
    redis.call('HDEL', KEYS[3], ARGV[1])
    return {'missing', ''}
  end
  lease = cjson.decode(ARGV[3])
  local cap = redis.call('HGET', KEYS[2], 'capacity_mib')
  if cap and used + tonumber(lease.mib) > tonumber(cap) then
    return {'conflict', ''}
  end
  outcome = 'restored'
end
lease.expires_at = now + tonumber(ARGV[2])
local encoded = cjson.encode(lease)
redis.call('HSET', KEYS[1], ARGV[1], encoded)
redis.call('HSET', KEYS[3], ARGV[1], lease.gpu)
return {outcome, encoded}
"""
)

# KEYS: leases, (unused), lease index.  ARGV: lease id ('' = by owner), owner.
_RELEASE = (
    _NOW
    + _PURGE
    + """
local released = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local lease = entry(all[i + 1])  -- readable: _PURGE dropped the rest
  if (ARGV[1] ~= '' and all[i] == ARGV[1]) or (ARGV[1] == '' and lease.owner == ARGV[2]) then
    redis.call('HDEL', KEYS[1], all[i])
    redis.call('HDEL', KEYS[3], all[i])
    table.insert(released, all[i + 1])
  end
end
return released
"""
)

# KEYS: leases, (unused), lease index, wants.  Purges expired and unreadable leases and wants; returns
# {leases, wants, the fields of the unreadable leases, of the unreadable wants}.
_READ = (
    _NOW
    + _PURGE
    + """
local wants = {}
local bad_wants = {}
local all = redis.call('HGETALL', KEYS[4])
for i = 1, #all, 2 do
  local want = entry(all[i + 1])
  if want == nil then table.insert(bad_wants, all[i]) end
  if want == nil or want.expires_at <= now then
    redis.call('HDEL', KEYS[4], all[i])
  else
    table.insert(wants, all[i + 1])
  end
end
return {redis.call('HVALS', KEYS[1]), wants, dropped, bad_wants}
"""
)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class SharedLeases:
    """The operations on shared leases, over any redis.asyncio client. Raises Redis errors as they come."""

    def __init__(self, client: Redis) -> None:
        self.client = client
        self._take = client.register_script(_TAKE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._read = client.register_script(_READ)

    @staticmethod
    def _keys(gpu: str) -> list[str]:
        return [_leases_key(gpu), _info_key(gpu), LEASE_INDEX_KEY, _wants_key(gpu), GPUS_KEY]

    async def register(self, gpu: str, total_mib: int, margin_mib: int, by: str) -> None:
        """Declare a GPU shared with this budget (total minus margin); the last to register sets it."""
        await self.client.hset(
            _info_key(gpu),
            mapping={
                "capacity_mib": max(0, total_mib - margin_mib),
                "total_mib": total_mib,
                "registered_by": by,
            },
        )
        await self.client.sadd(GPUS_KEY, gpu)

    async def take(
        self,
        gpu: str,
        mib: int,
        owner: str,
        ttl_s: float,
        priority: int = 0,
        kind: str = "external",
        capacity_mib: int | None = None,
        lease_id: str | None = None,
        want_id: str | None = None,
        want_ttl_s: float | None = None,
    ) -> TakeResult:
        """Lease `mib` on `gpu` for `ttl_s`, atomically: refused when the live leases plus `mib` exceed
        the capacity. An unregistered GPU needs `capacity_mib`. With `want_id`, a refusal is recorded as a
        want (for `want_ttl_s`, default `ttl_s`) and a success removes it."""
        if mib < 0:
            raise ValueError("a lease cannot be negative")
        result = await self._take(
            keys=self._keys(gpu),
            args=[
                gpu,
                lease_id or new_id(),
                owner,
                mib,
                int(ttl_s * 1000),
                priority,
                kind,
                "" if capacity_mib is None else capacity_mib,
                want_id or "",
                int((want_ttl_s if want_ttl_s is not None else ttl_s) * 1000),
            ],
        )
        outcome = _text(result[0])
        lease = SharedLease.from_json(_text(result[2])) if outcome == "ok" else None
        return TakeResult(outcome, int(result[1]), lease)  # type: ignore[arg-type]

    async def renew(
        self, lease_id: str, ttl_s: float, restore: SharedLease | None = None
    ) -> SharedLease | None:
        """Push a lease's expiry to now + ttl_s. None when it is gone (expired, released); with `restore`
        a gone lease is put back as it was (the holder still has that memory), or LeaseLost when others
        hold that room now."""
        gpu = restore.gpu if restore is not None else await self.client.hget(LEASE_INDEX_KEY, lease_id)
        if gpu is None:
            return None
        restored = "" if restore is None else json.dumps(_lease_json(restore))
        result = await self._renew(
            keys=self._keys(_text(gpu))[:3], args=[lease_id, int(ttl_s * 1000), restored]
        )
        if _text(result[0]) == "missing":
            return None
        if _text(result[0]) == "conflict":
            raise LeaseLost(lease_id)
        return SharedLease.from_json(_text(result[1]))

    async def release(
        self, gpu: str | None = None, lease_id: str | None = None, owner: str | None = None
    ) -> list[SharedLease]:
        """Release one lease by id, or every lease of `owner` on `gpu` (or on every GPU); what went."""
        if lease_id is None and owner is None:
            raise ValueError("release needs a lease id or an owner")
        if gpu is None and lease_id is not None:
            found = await self.client.hget(LEASE_INDEX_KEY, lease_id)
            if found is None:
                return []
            gpus = [_text(found)]
        elif gpu is None:
            gpus = sorted(_text(g) for g in await self.client.smembers(GPUS_KEY))
        else:
            gpus = [gpu]
        released: list[SharedLease] = []
        for g in gpus:
            raw = await self._release(keys=self._keys(g)[:3], args=[lease_id or "", owner or ""])
            released += [SharedLease.from_json(_text(r)) for r in raw]
        return released

    async def budget(self, gpu: str) -> GpuBudget:
        """The GPU's capacity, live leases and pending wants (expired ones are purged on the way)."""
        capacity = await self.client.hget(_info_key(gpu), "capacity_mib")
        leases, wants, dropped, bad_wants = await self._read(keys=self._keys(gpu)[:4], args=[])
        for kind, fields in (("lease", dropped), ("want", bad_wants)):
            if fields:  # the field names only: a value is whatever someone wrote there
                log.warning("shared_entry_dropped", gpu=gpu, kind=kind, fields=sorted(map(_text, fields)))
        return GpuBudget(
            gpu,
            None if capacity is None else int(capacity),
            sorted((SharedLease.from_json(_text(x)) for x in leases), key=lambda x: (x.taken_at_ms, x.id)),
            sorted((_want(_text(x)) for x in wants), key=lambda w: (-w.priority, w.expires_at_ms)),
        )

    async def gpus(self) -> list[str]:
        return sorted(_text(g) for g in await self.client.smembers(GPUS_KEY))

    async def withdraw_want(self, gpu: str, want_id: str) -> None:
        await self.client.hdel(_wants_key(gpu), want_id)


def _want(raw: str) -> Want:
    d = json.loads(raw)
    return Want(
        str(d["id"]), str(d["gpu"]), str(d["owner"]), int(d["mib"]), int(d["priority"]), int(d["expires_at"])
    )


def _lease_json(lease: SharedLease) -> dict[str, Any]:
    return {
        "id": lease.id,
        "gpu": lease.gpu,
        "owner": lease.owner,
        "mib": lease.mib,
        "priority": lease.priority,
        "kind": lease.kind,
        "taken_at": lease.taken_at_ms,
        "expires_at": lease.expires_at_ms,
    }

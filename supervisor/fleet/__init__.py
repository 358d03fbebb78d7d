"""The fleet: several daemons sharing one Redis (node records, shared GPU leases, routing)."""

from supervisor.proxy import HOP_BY_HOP

# The node that forwarded a request: a request that carries it is served where it lands (one hop).
HOP_HEADER = "X-LLM-Supervisor-Hop"

# Between nodes the scheduling headers go along (the other node schedules the request); the client's
# key, a hop header the client may have sent, our request id (set anew) and hop-by-hop headers do not.
NOT_TO_NODE = frozenset(HOP_BY_HOP | {"authorization", "x-api-key", "x-request-id", HOP_HEADER.lower()})

"""The fleet: several daemons sharing one Redis (node records, shared GPU leases, routing)."""

# The node that forwarded a request: a request that carries it is served where it lands (one hop).
HOP_HEADER = "X-LLM-Supervisor-Hop"

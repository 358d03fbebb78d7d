"""Move a request to a child on 127.0.0.1:<port> and its response back, as it arrives.

Bytes pass untouched (no decompression, no re-encoding), so SSE events reach the client as the engine
writes them. The client going away cancels the handler, which closes the upstream connection, which is
how llama-server and vLLM learn to stop generating.
"""

from __future__ import annotations

import json

import aiohttp
import structlog
from aiohttp import web
from multidict import CIMultiDict

from supervisor import errors

log = structlog.get_logger("proxy")

# RFC 9110 hop-by-hop headers, plus those the proxy itself must set for its own connection.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_NOT_FROM_UPSTREAM = _HOP_BY_HOP - {"content-length"} | {"date", "server"}
# Scheduling headers of ours (see api/openai.py); the engine never sees them.
_NOT_TO_UPSTREAM = _HOP_BY_HOP | {"x-priority", "x-client-id"}
# Bodies up to this size with a known length are answered in one write, which is faster than streaming.
_SMALL_BODY = 1 << 20


# llama-server (cpp-httplib) drops a connection after 5 s idle; closing ours sooner means a pooled
# connection is never one the child has already given up on.
_UPSTREAM_KEEPALIVE_S = 3.0


def new_upstream_session() -> aiohttp.ClientSession:
    """The one session for all upstream traffic: keep-alive pool with no cap, bytes left as they are."""
    connector = aiohttp.TCPConnector(
        limit=0, keepalive_timeout=_UPSTREAM_KEEPALIVE_S, enable_cleanup_closed=True
    )
    return aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,
        # No total timeout: a generation may run for many minutes; a dead child ends the stream instead.
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
    )


def forwarded_headers(request: web.Request) -> CIMultiDict[str]:
    """The client's end-to-end headers, with those named in its Connection header dropped too."""
    named = {t.strip().lower() for t in request.headers.get("Connection", "").split(",")}
    return CIMultiDict(
        (k, v)
        for k, v in request.headers.items()
        if k.lower() not in _NOT_TO_UPSTREAM and k.lower() not in named
    )


async def send(
    session: aiohttp.ClientSession, method: str, url: str, body: bytes, headers: CIMultiDict[str]
) -> aiohttp.ClientResponse:
    """The upstream response's head; one retry when a pooled connection turns out to be closed.

    A keep-alive connection can be closed by the child while the request is on its way. No answer was
    started on it, so sending again on a fresh connection is safe and the client never sees the race.
    A refused connection is not retried: the child is gone, and the scheduler will notice.
    """
    try:
        return await session.request(method, url, data=body, headers=headers)
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        if isinstance(exc, aiohttp.ClientConnectorError):
            raise
        log.debug("upstream_retry", url=url, error=repr(exc))
        return await session.request(method, url, data=body, headers=headers)


async def open_upstream(
    session: aiohttp.ClientSession,
    method: str,
    port: int,
    path_qs: str,
    body: bytes,
    headers: CIMultiDict[str],
    model: str,
    stream: bool,
) -> aiohttp.ClientResponse:
    """The child's response head, or a 502 `upstream_error` when the request cannot reach it.

    llama-server closes the connection after a streamed answer while still advertising keep-alive, so a
    streamed request asks for `Connection: close` and its connection never goes back to the pool.
    """
    if stream:
        headers = CIMultiDict(headers)
        headers["Connection"] = "close"
    try:
        return await send(session, method, f"http://127.0.0.1:{port}{path_qs}", body, headers)
    except aiohttp.ClientError as exc:
        raise errors.upstream_failed(model, str(exc) or type(exc).__name__) from exc


async def forward(
    session: aiohttp.ClientSession,
    request: web.Request,
    port: int,
    body: bytes,
    model: str,
    stream: bool,
    if_missing: errors.SupervisorError | None = None,
) -> web.StreamResponse:
    """Send `body` to the child and stream its answer back to `request`'s client.

    `stream` says the client asked for SSE. `if_missing` is raised instead of passing on the child's
    404, for routes not every engine serves.
    """
    upstream = await open_upstream(
        session, request.method, port, request.path_qs, body, forwarded_headers(request), model, stream
    )
    async with upstream:
        if upstream.status == 404 and if_missing is not None:
            raise if_missing
        headers = CIMultiDict(
            (k, v) for k, v in upstream.headers.items() if k.lower() not in _NOT_FROM_UPSTREAM
        )
        length = upstream.content_length
        if length is not None and length <= _SMALL_BODY:
            try:
                payload = await upstream.read()
            except aiohttp.ClientError as exc:
                raise errors.model_crashed(model, f"response cut short: {exc}") from exc
            return web.Response(status=upstream.status, reason=upstream.reason, body=payload, headers=headers)

        response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
        await response.prepare(request)
        while True:
            try:
                chunk = await upstream.content.readany()
            except aiohttp.ClientError as exc:
                # The child died mid-stream: end the stream with an error the client can see, not a hang.
                log.warning("upstream_cut", model=model, error=repr(exc))
                if upstream.content_type == "text/event-stream":
                    event = errors.model_crashed(model, "the stream was cut short").openai_body()
                    await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                break
            if not chunk:
                break
            # A client that went away makes this raise, which closes the upstream connection too.
            await response.write(chunk)
        await response.write_eof()
        return response

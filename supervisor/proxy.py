"""Move a request to a child on 127.0.0.1:<port> and its response back, as it arrives.

Bytes pass untouched (no decompression, no re-encoding), so SSE events reach the client as the engine
writes them. The client going away cancels the handler, which closes the upstream connection, which is
how llama-server and vLLM learn to stop generating.
"""

from __future__ import annotations

import asyncio
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
# CORS is the daemon's to answer (llama-server reflects any Origin): none of the child's reaches a client.
_CORS_PREFIX = "access-control-"
# Scheduling headers of ours (see api/openai.py), and the client's credentials (for the daemon, not for
# the child, which gets the daemon's key instead); the engine never sees them.
_NOT_TO_UPSTREAM = _HOP_BY_HOP | {"x-priority", "x-client-id", "authorization", "x-api-key"}
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


def response_headers(upstream: aiohttp.ClientResponse) -> CIMultiDict[str]:
    """The child's end-to-end response headers, without its CORS headers."""
    return CIMultiDict(
        (k, v)
        for k, v in upstream.headers.items()
        if k.lower() not in _NOT_FROM_UPSTREAM and not k.lower().startswith(_CORS_PREFIX)
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
    *,
    api_key: str | None,
) -> aiohttp.ClientResponse:
    """The child's response head, or a 502 `upstream_error` when the request cannot reach it.

    `api_key` is the child's own key (ModelSlot.api_key), sent as a bearer token.

    llama-server closes the connection after a streamed answer while still advertising keep-alive, so a
    streamed request asks for `Connection: close` and its connection never goes back to the pool.
    """
    headers = CIMultiDict(headers)
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if stream:
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
    *,
    api_key: str | None,
    timeout_s: float | None = None,
) -> web.StreamResponse:
    """Send `body` to the child and stream its answer back to `request`'s client.

    `stream` says the client asked for SSE. `if_missing` is raised instead of passing on the child's
    404, for routes not every engine serves. `timeout_s` (a manifest's request_timeout_s) ends a
    generation that runs longer: leaving `async with upstream` closes the connection, which stops it.
    """
    deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
    try:
        async with asyncio.timeout_at(deadline):
            upstream = await open_upstream(
                session,
                request.method,
                port,
                request.path_qs,
                body,
                forwarded_headers(request),
                model,
                stream,
                api_key=api_key,
            )
    except TimeoutError:
        raise errors.generation_timeout(model, timeout_s or 0) from None
    async with upstream:
        if upstream.status == 404 and if_missing is not None:
            raise if_missing
        headers = response_headers(upstream)
        length = upstream.content_length
        if length is not None and length <= _SMALL_BODY:
            try:
                async with asyncio.timeout_at(deadline):
                    payload = await upstream.read()
            except aiohttp.ClientError as exc:
                raise errors.model_crashed(model, f"response cut short: {exc}") from exc
            except TimeoutError:
                raise errors.generation_timeout(model, timeout_s or 0) from None
            return web.Response(status=upstream.status, reason=upstream.reason, body=payload, headers=headers)

        response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
        await response.prepare(request)
        sse = upstream.content_type == "text/event-stream"
        try:
            async with asyncio.timeout_at(deadline):
                await _relay(upstream, response, model, sse)
        except TimeoutError:
            log.warning("generation_timeout", model=model, limit_s=timeout_s)
            if sse:
                await _write_error_event(response, errors.generation_timeout(model, timeout_s or 0))
        await response.write_eof()
        return response


async def _relay(
    upstream: aiohttp.ClientResponse, response: web.StreamResponse, model: str, sse: bool
) -> None:
    """Copy the child's body to the client chunk by chunk, as it arrives."""
    while True:
        try:
            chunk = await upstream.content.readany()
        except aiohttp.ClientError as exc:
            # The child died mid-stream: end the stream with an error the client can see, not a hang.
            log.warning("upstream_cut", model=model, error=repr(exc))
            if sse:
                await _write_error_event(response, errors.model_crashed(model, "the stream was cut short"))
            return
        if not chunk:
            return
        # A client that went away makes this raise, which closes the upstream connection too.
        await response.write(chunk)


async def _write_error_event(response: web.StreamResponse, error: errors.SupervisorError) -> None:
    await response.write(b"data: " + json.dumps(error.openai_body()).encode() + b"\n\n")

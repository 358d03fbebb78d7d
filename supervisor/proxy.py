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
# Bodies up to this size with a known length are answered in one write, which is faster than streaming.
_SMALL_BODY = 1 << 20


def new_upstream_session() -> aiohttp.ClientSession:
    """The one session for all upstream traffic: keep-alive pool with no cap, bytes left as they are."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30, enable_cleanup_closed=True)
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
        (k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP and k.lower() not in named
    )


async def forward(
    session: aiohttp.ClientSession, request: web.Request, port: int, body: bytes, model: str
) -> web.StreamResponse:
    """Send `body` to the child and stream its answer back to `request`'s client."""
    url = f"http://127.0.0.1:{port}{request.path_qs}"
    try:
        upstream = await session.request(request.method, url, data=body, headers=forwarded_headers(request))
    except aiohttp.ClientError as exc:
        raise errors.model_crashed(model, f"cannot reach it: {exc}") from exc
    async with upstream:
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

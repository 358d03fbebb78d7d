"""GET /ui: the dashboard's static files, shipped in the package (supervisor/ui/).

The files hold no data, so they are open (`access.required_role`); every call the page makes goes to the
admin routes with the admin key. Only the files named in `_FILES` are served, whatever the path says.
"""

from __future__ import annotations

import asyncio
import hashlib
from importlib import resources

from aiohttp import web

routes = web.RouteTableDef()

_FILES = {
    "index.html": "text/html",
    "app.js": "text/javascript",
    "style.css": "text/css",
}
# The page runs only its own script and style, talks only to this daemon, and is never framed.
CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    # Revalidated on every load (the ETag makes that cheap), so a daemon upgrade shows its new page.
    "Cache-Control": "no-cache",
}


def _read(name: str) -> bytes:
    return (resources.files("supervisor") / "ui" / name).read_bytes()


async def _serve(request: web.Request, name: str) -> web.Response:
    content_type = _FILES.get(name)
    if content_type is None:
        raise web.HTTPNotFound()
    body = await asyncio.to_thread(_read, name)
    etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
    headers = {**SECURITY_HEADERS, "ETag": etag}
    if request.headers.get("If-None-Match") == etag:
        return web.Response(status=304, headers=headers)
    return web.Response(body=body, content_type=content_type, charset="utf-8", headers=headers)


@routes.get("/ui")
@routes.get("/ui/")
async def index(request: web.Request) -> web.Response:
    return await _serve(request, "index.html")


@routes.get("/ui/{file}")
async def static_file(request: web.Request) -> web.Response:
    return await _serve(request, request.match_info["file"])

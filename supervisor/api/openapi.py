"""GET /openapi.json: the OpenAPI 3.1 document of every route (supervisor/api/openapi_document.py).

The document describes every body with pydantic models (supervisor/api/schemas.py) that nothing else in
the daemon uses: about 1 MiB of an idle daemon's memory. They are imported, and the document built, on
the first call, once per app (the router is frozen once the app serves).
"""

from __future__ import annotations

import json
import weakref

from aiohttp import web

routes = web.RouteTableDef()

JSON = "application/json"

_DOCUMENTS: weakref.WeakKeyDictionary[web.Application, bytes] = weakref.WeakKeyDictionary()


@routes.get("/openapi.json")
async def openapi_document(request: web.Request) -> web.Response:
    body = _DOCUMENTS.get(request.app)
    if body is None:
        from supervisor.api.openapi_document import build_document

        body = _DOCUMENTS[request.app] = json.dumps(build_document(request.app.router)).encode()
    return web.Response(body=body, content_type=JSON)

"""The data plane: the inference routes' bytes, moved with as little work per request and per chunk as the
daemon can manage.

`front.py` accepts every connection on the daemon's port. Requests to the OpenAI inference routes are
served here; any other request hands its connection, bytes and all, to the aiohttp application, which
serves the rest of the API as before. `upstream.py` keeps warm connections to the children and relays
their answers to the client from the socket callbacks themselves: no task switch and no parsing of a
stream's events per chunk.
"""

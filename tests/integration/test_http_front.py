"""What a review of the HTTP front (supervisor/dataplane/front.py) as an attacker and a confused client
found, against a real daemon over raw sockets: a body that escaped the gate's checks, compressed bodies,
a key's concurrency counted past its answer, other HTTP versions, the answers aiohttp writes.

The child is bench/stand_in_engine.py (see test_dataplane.py), which can echo the headers it got.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from tests.integration.conftest import MakeDaemon
from tests.integration.harness import Daemon
from tests.integration.test_access import write_keys
from tests.integration.test_dataplane import MODELS, _chat, _http_answer

ALICE = "alice-key-0123456789abcdef"  # inference, one request at a time


@pytest.fixture
async def standin(make_daemon: MakeDaemon) -> Daemon:
    return await make_daemon(models=MODELS)


async def _keyed(make_daemon: MakeDaemon, tmp_path: Path, **config: Any) -> Daemon:
    keys = write_keys(tmp_path / "keys", [{"name": "alice", "key": ALICE, "max_concurrent": 1}])
    return await make_daemon(models=MODELS, config={"api_keys_file": str(keys), **config})


async def _answer_to(daemon: Daemon, data: bytes, timeout_s: float = 10) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()


def _head(target: bytes, *lines: bytes, version: bytes = b"1.1") -> bytes:
    fields = b"".join(line + b"\r\n" for line in lines)
    return b"POST %s HTTP/%s\r\nHost: localhost\r\n%s\r\n" % (target, version, fields)


async def test_a_length_with_spaces_gets_the_gate_before_its_body(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """`Content-Length: N ` (llhttp allows the space) on a request for aiohttp skipped the key, size and
    budget checks: a caller with no key made the daemon hold a body up to max_body_mib, outside
    max_buffered_mib. It is refused before a byte of the body is sent, as without the space."""
    daemon = await _keyed(make_daemon, tmp_path)
    for length in (b"1048576 ", b"1048576\t", b"1048576"):
        head = _head(b"/v1/models", b"Content-Type: application/json", b"Content-Length: " + length)
        answer = await _answer_to(daemon, head)  # no body follows: an answer means it was refused first
        assert answer.startswith(b"HTTP/1.1 401"), (length, answer[:200])


@pytest.mark.parametrize(
    "head",
    [
        b"".join(b"X-Pad-%02d: %s\r\n" % (i, b"a" * 8000) for i in range(95)),  # 760 KB in 95 lines
        b"X-Long: " + b"a" * (1 << 20),  # one line that never ends: aiohttp never gets a head not yet whole
        b"".join(b"X-%d: 1\r\n" % i for i in range(150)),  # too many lines
    ],
    ids=["large", "endless-line", "many-lines"],
)
async def test_a_handed_off_connections_later_heads_are_held_to_the_fronts_bounds(
    standin: Daemon, head: bytes
) -> None:
    """Once a connection was aiohttp's (any /api/ request, such as the open GET /api/version), its later
    heads had aiohttp's bounds only: 100 lines of 8 KiB, none on a head as a whole. 200 unfinished 760 KB
    heads from a peer with no key held 296 MiB of the daemon's memory. Past the front's bounds the head
    is refused now, with the front's 431, and the connection closed (the client, still writing, may see
    the close as a reset before it reads the answer)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", standin.port)
    try:
        writer.write(b"GET /api/version HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert (await _http_answer(reader))[0] == b"200"  # handed to aiohttp
        writer.write(b"GET /api/version HTTP/1.1\r\nHost: localhost\r\n" + head)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        rest = await asyncio.wait_for(reader.read(), 10)
    except ConnectionError:
        rest = b""
    finally:
        writer.close()
    assert rest.startswith(b"HTTP/1.1 431 ") or rest == b"", rest[:100]
    assert b"request header fields too large" in rest or rest == b"", rest[:300]
    assert standin.events("handed_off_head_refused")
    # The next connection is served as ever.
    status, _ = await standin.get("/api/version")
    assert status == 200


async def test_a_compressed_body_is_refused_415_on_every_path(standin: Daemon) -> None:
    """aiohttp unpacked a gzip body after the gate had counted its packed size (a 60 KiB body held 60 MiB
    of the daemon's memory each), a body that was not gzip was a 500, and the front sent the client's
    `Content-Encoding` on to the child, which refused a body the daemon had read. Neither engine takes a
    compressed body: each path answers 415 in its API's shape, before the body is read."""
    daemon = standin
    body = gzip.compress(json.dumps(_chat(False)).encode())
    ollama = gzip.compress(json.dumps({"model": "standin", "messages": [], "stream": False}).encode())
    cases = [
        (_head(b"/v1/chat/completions", b"Content-Encoding: gzip", b"Content-Length: %d" % len(body)), body),
        (_head(b"/v1/chat/completions", b"Content-Encoding: gzip", b"Transfer-Encoding: chunked"), None),
        (_head(b"/api/chat", b"Content-Encoding: gzip", b"Content-Length: %d" % len(ollama)), ollama),
        (_head(b"/v1/chat/completions", b"Content-Encoding: br", b"Content-Length: 10"), b"not brotli"),
        # A second line, and a list in one line: aiohttp unpacked by the last line, the check read the
        # first, and the 60 KiB that held 60 MiB were back on the Ollama routes.
        (
            _head(
                b"/api/chat",
                b"Content-Encoding: identity",
                b"Content-Encoding: gzip",
                b"Content-Length: %d" % len(ollama),
            ),
            ollama,
        ),
        (
            _head(b"/api/chat", b"Content-Encoding: identity, gzip", b"Content-Length: %d" % len(ollama)),
            ollama,
        ),
        (
            _head(
                b"/v1/chat/completions", b"Content-Encoding:", b"Content-Encoding: gzip", b"Content-Length: 9"
            ),
            b"{}",
        ),
    ]
    for head, sent in cases:
        reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
        try:
            writer.write(head if sent is None else head + sent)
            status, answer = await _http_answer(reader)
        finally:
            writer.close()
        assert status == b"415", (head, answer)
        error = json.loads(answer)["error"]
        message = error if isinstance(error, str) else error["message"]  # Ollama's shape, OpenAI's
        assert "Content-Encoding" in message
    assert not daemon.events("handler_error")
    # The front's status line named it "415 Unknown".
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    try:
        writer.write(cases[0][0] + body)
        assert (await reader.readline()).startswith(b"HTTP/1.1 415 Unsupported Media Type\r\n")
    finally:
        writer.close()
    # `identity` is no encoding at all.
    plain = json.dumps(_chat(False)).encode()
    head = _head(b"/v1/chat/completions", b"Content-Encoding: identity", b"Content-Length: %d" % len(plain))
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    try:
        writer.write(head + plain)
        assert (await _http_answer(reader))[0] == b"200"
    finally:
        writer.close()


async def test_a_refused_compressed_body_is_logged_and_its_undecodable_bytes_leave_no_traceback(
    standin: Daemon,
) -> None:
    """The 415 on an Ollama route was not logged (415 was not a gate refusal), and when the body was not
    really gzip aiohttp then failed to drain it and logged a raw traceback (RequestPayloadError: Can not
    decode content-encoding) into the JSON log: aiohttp no longer unpacks bodies (auto_decompress off)."""
    daemon = standin
    for sent in (b"abcd", gzip.compress(b'{"model": "standin"}')):
        head = _head(b"/api/chat", b"Content-Encoding: gzip", b"Content-Length: %d" % len(sent))
        reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
        try:
            writer.write(head + sent)
            status, _ = await _http_answer(reader)
            assert status == b"415"
        finally:
            writer.close()
    await asyncio.sleep(0.5)  # what aiohttp logs after the handler, if anything
    lines = [e for e in daemon.events("request") if e["path"] == "/api/chat"]
    assert [(e["status"], e["error"]) for e in lines] == [(415, "unsupported_content_encoding")] * 2
    log = daemon.log_path.read_text()
    assert "Can not decode content-encoding" not in log
    assert "Traceback" not in log


async def test_the_child_is_told_the_body_is_json_whatever_the_client_labelled_it(standin: Daemon) -> None:
    """A client's `multipart/form-data` or `text/plain` label went on to the child with the JSON body the
    daemon had read, and the child refused it with an empty 400."""
    assert standin.http is not None
    body = json.dumps(_chat(False, echo_headers=True))
    for label in ("multipart/form-data; boundary=x", "text/plain"):
        async with standin.http.post(
            standin.url + "/v1/chat/completions", data=body, headers={"Content-Type": label}
        ) as response:
            assert response.status == 200, await response.text()
            lines = json.loads((await response.json())["choices"][0]["message"]["content"])
        types = [line for line in lines if line.lower().startswith("content-type:")]
        assert types == ["Content-Type: application/json"], lines


async def test_a_key_with_max_concurrent_1_is_never_refused_one_request_after_another(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """The key's count was given back only after the answer had been written, so a client that sent its
    next request as soon as it had read an answer often found the last one still counted (18 429s in 60
    requests in the review)."""
    daemon = await _keyed(make_daemon, tmp_path)
    headers = {"Authorization": f"Bearer {ALICE}"}
    connector = aiohttp.TCPConnector(limit=1)  # one kept-alive connection, one request at a time
    async with aiohttp.ClientSession(connector=connector) as session:
        statuses = []
        for stream in [False, True] * 40:
            async with session.post(
                daemon.url + "/v1/chat/completions", json=_chat(stream, tokens=2), headers=headers
            ) as response:
                await response.read()
                statuses.append(response.status)
    assert statuses == [200] * 80


async def test_pipelined_requests_of_a_key_with_max_concurrent_1_are_both_served(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """Two requests in one write were counted as two at once, and the second got a 429, though the
    front answers a connection's requests one after another. Another connection's request is still
    refused while one is in progress."""
    daemon = await _keyed(make_daemon, tmp_path)
    body = json.dumps(_chat(False, tokens=2)).encode()
    one = _head(
        b"/v1/chat/completions", b"Authorization: Bearer " + ALICE.encode(), b"Content-Length: %d" % len(body)
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    try:
        writer.write((one + body) * 3)
        statuses = [(await _http_answer(reader))[0] for _ in range(3)]
    finally:
        writer.close()
    assert statuses == [b"200"] * 3


async def test_versions_other_than_1_0_and_1_1_get_505(standin: Daemon) -> None:
    """`HTTP/2.0` in a request line was handed to aiohttp, which ran the inference and answered
    `HTTP/2.0 200 OK` in HTTP/1 framing."""
    body = json.dumps(_chat(False)).encode()
    head = _head(b"/v1/chat/completions", b"Content-Length: %d" % len(body), version=b"2.0")
    answer = await _answer_to(standin, head + body)
    assert answer.startswith(b"HTTP/1.1 505 HTTP Version Not Supported"), answer[:200]
    assert b'"http_version_not_supported"' in answer


async def test_every_answer_names_the_same_server(standin: Daemon) -> None:
    """aiohttp's answers (on a tunnelled or handed-over connection) said `Python/3.11 aiohttp/3.x`."""
    assert standin.http is not None
    servers = set()
    for method, path in (("GET", "/health"), ("GET", "/api/version"), ("GET", "/v1/models")):
        async with standin.http.request(method, standin.url + path) as response:
            servers.add(response.headers.get("Server"))
    async with standin.http.post(standin.url + "/v1/chat/completions", json=_chat(False)) as response:
        servers.add(response.headers.get("Server"))
    assert servers == {"llm-supervisor"}


async def test_past_max_connections_an_idle_one_makes_room_then_new_ones_get_503(
    make_daemon: MakeDaemon,
) -> None:
    """Connections were not limited: idle sockets took every descriptor the daemon had, and it could
    then start no child nor read a file. Past max_connections a kept-alive idle one is closed for a new
    one, as nginx does, else the oldest that has sent no whole head for two seconds; when none is either,
    a new one gets 503 at once."""
    daemon = await make_daemon(models=MODELS, config={"max_connections": 8})
    health = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
    idle = []
    for _ in range(8):  # kept alive after an answer: idle
        reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
        writer.write(health)
        assert (await _http_answer(reader))[0] == b"200"
        idle.append((reader, writer))
    body = json.dumps(_chat(False)).encode()
    chat = _head(b"/v1/chat/completions", b"Content-Length: %d" % len(body)) + body
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.write(chat)
    assert (await _http_answer(reader))[0] == b"200"  # served: an idle one was closed for it
    writer.close()
    # (The harness's own kept-alive connection counts too, so one or two were closed.)
    assert any([await _closed_by_daemon(r) for r, _ in idle])
    for _, w in idle:
        w.close()

    # Requests whose heads are still arriving are not idle: once they fill the limit, a new one is refused
    # (while they are new: see below).
    busy, refusal = [], b""
    for _ in range(12):  # at once: all new
        reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")  # no end to the head
        busy.append((reader, writer))
    for reader, _ in busy:
        try:
            refusal = await asyncio.wait_for(reader.read(), 0.05)
        except TimeoutError:
            continue
        except ConnectionResetError:
            # The refusal closes at once (lingering would hold the descriptor it spares), so the head
            # this client sent meanwhile may turn the close into a reset before the 503 is read.
            refusal = b"(reset)"
        if refusal:
            break
    assert refusal == b"(reset)" or refusal.startswith(b"HTTP/1.1 503"), refusal[:200]
    assert refusal == b"(reset)" or b'"too_many_connections"' in refusal
    assert daemon.events("connections_full")
    # Once they have sent no whole head for two seconds, the oldest is closed for a new one: a peer with no
    # key trickling heads over every connection kept everyone out, admin keys included.
    await asyncio.sleep(2.2)
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.write(chat)
    assert (await _http_answer(reader))[0] == b"200"
    writer.close()
    for _, w in busy:
        w.close()
    await asyncio.sleep(0.5)  # the daemon sees them close
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.write(chat)
    assert (await _http_answer(reader))[0] == b"200"
    writer.close()
    assert daemon.http is not None
    async with daemon.http.get(daemon.url + "/metrics") as response:
        metrics = await response.text()
    shed = dict(re.findall(r'llm_supervisor_connections_shed_total\{action="(\w+)"\} ([0-9.]+)', metrics))
    assert float(shed["closed_idle"]) >= 1
    assert float(shed["refused"]) >= 1
    assert float(shed["closed_unproven"]) >= 1


@pytest.mark.parametrize("kind", ["handed-to-aiohttp", "trickled-second-head"])
async def test_connections_a_peer_holds_without_a_key_are_closed_for_an_admin_when_full(
    make_daemon: MakeDaemon, kind: str
) -> None:
    """A security review filled max_connections with no key in two ways the room-making missed, and an
    admin key got 503 too_many_connections: connections handed to aiohttp by a request to an open route
    (GET /api/version), then idle (only the front's own idle ones were closed); and connections that
    sent one whole head, then trickled the next (only those with no whole head yet counted as
    unproven). Each is now closed for a new connection."""
    admin = "an-admin-key-0123456789"
    daemon = await make_daemon(models=MODELS, config={"max_connections": 8, "api_key": admin})
    held = []
    for _ in range(10):  # past the limit: the daemon's own harness connection counts too
        reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
        first = b"/api/version" if kind == "handed-to-aiohttp" else b"/health"
        writer.write(b"GET %s HTTP/1.1\r\nHost: localhost\r\n\r\n" % first)
        # 200; or, once full, a 503 (which may come as a reset) on a connection then closed
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await _http_answer(reader)
            if kind == "trickled-second-head":
                writer.write(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")  # and no more
        held.append((reader, writer))
    if kind == "trickled-second-head":
        await asyncio.sleep(2.2)  # _UNPROVEN_S: the heads have been arriving for longer than that
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
        writer.write(
            b"GET /v1/admin/models HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer %s\r\n\r\n"
            % admin.encode()
        )
        assert (await _http_answer(reader))[0] == b"200"
        writer.close()
    finally:
        for _, w in held:
            w.close()
    shed = "closed_idle" if kind == "handed-to-aiohttp" else "closed_unproven"
    assert daemon.http is not None
    async with daemon.http.get(daemon.url + "/metrics", headers={"Authorization": f"Bearer {admin}"}) as r:
        metrics = await r.text()
    counts = dict(re.findall(r'llm_supervisor_connections_shed_total\{action="(\w+)"\} ([0-9.]+)', metrics))
    assert float(counts[shed]) >= 1


async def _closed_by_daemon(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), 1) == b""
    except TimeoutError:
        return False


async def test_the_daemon_listens_on_its_port_alone_and_leaves_no_socket_directory(standin: Daemon) -> None:
    """aiohttp's own listener, which the front tunnels routes like /health and /v1/models to, was a
    loopback port any local process could reach past the front's bounds on heads and connections. It
    is a Unix socket in the daemon's private directory now."""
    assert standin.proc is not None
    daemon = psutil.Process(standin.proc.pid)
    listening = [c.laddr for c in daemon.net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert [address.port for address in listening] == [standin.port]
    # The listener's socket, and the accepted ends of the front's connections to it, all in one directory.
    (directory,) = {Path(str(c.laddr)).parent for c in daemon.net_connections("unix") if c.laddr}
    assert directory.name.startswith("llmsup-sockets-")
    assert directory.stat().st_mode & 0o077 == 0
    status, _, _ = await standin.post("/v1/admin/models/standin/load", {})  # tunnelled: through the socket
    assert status == 200
    await standin.close()
    assert not directory.exists()


@pytest.mark.parametrize("first", ["version", "streamed-chat"])
async def test_a_request_llhttp_refuses_behind_an_ollama_one_gets_the_fronts_400_after_its_answer(
    standin: Daemon, first: str
) -> None:
    """A request llhttp refuses, pipelined behind one that handed the connection to aiohttp: aiohttp's
    parser answered it with a 400 in text/plain naming itself, and lost the request before it in the
    same read. The answer before it comes whole (a stream to its end), then the 400 the front gives the
    same bytes on a connection of their own (Ollama's shape, for a target under /api/), then the close."""
    refused = b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\nBa d: x\r\n\r\n"
    if first == "version":
        request = b"GET /api/version HTTP/1.1\r\nHost: localhost\r\n\r\n"
    else:
        chat = {
            "model": "standin",
            "messages": [{"role": "user", "content": "hi"}],
            "options": {"num_predict": 3},
        }
        body = json.dumps(chat).encode()  # Ollama streams unless told not to
        request = _head(b"/api/chat", b"Content-Length: %d" % len(body)) + body
    reader, writer = await asyncio.open_connection("127.0.0.1", standin.port)
    try:
        writer.write(request + refused)
        status, answer = await _http_answer(reader)
        assert status == b"200", answer
        if first == "streamed-chat":
            assert json.loads(answer.splitlines()[-1])["done"] is True
        status, error = await _http_answer(reader)
        assert await asyncio.wait_for(reader.read(), 10) == b""
    finally:
        writer.close()
    assert (status, json.loads(error)) == (b"400", {"error": "bad request: Invalid header token"})
    alone = await _answer_to(standin, refused)
    assert alone.startswith(b"HTTP/1.1 400 ")
    assert alone.partition(b"\r\n\r\n")[2] == error


BOB = "bob-key-0123456789abcdefgh"

_BODY = json.dumps({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}).encode()


async def _first_answer(daemon: Daemon, data: bytes, timeout_s: float) -> tuple[bytes, float]:
    """What the daemon answers within `timeout_s` (b"" if nothing), and how long the first bytes took."""
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    started = time.monotonic()
    try:
        writer.write(data)
        try:
            first = await asyncio.wait_for(reader.read(65536), timeout_s)
        except TimeoutError:
            return b"", time.monotonic() - started
        return first, time.monotonic() - started
    finally:
        writer.close()


@pytest.mark.parametrize(
    "chunked_body",
    [
        b"zz\r\n%s\r\n0\r\n\r\n" % _BODY,  # a chunk size that is not hex
        b'%x;a="b\r\n%s\r\n0\r\n\r\n' % (len(_BODY), _BODY),  # an unterminated quoted chunk extension
        b"%x\r\n%sXX\r\n0\r\n\r\n" % (len(_BODY), _BODY),  # chunk data longer than its size
        b"%x\r\n%s\r\n0\r\nContent-Length: 5\r\n\r\n" % (len(_BODY), _BODY),  # a framing header as a trailer
    ],
    ids=["bad-size", "bad-extension", "overlong-chunk", "content-length-trailer"],
)
async def test_a_malformed_chunked_upload_on_a_handed_off_connection_gets_a_400_at_once(
    standin: Daemon, chunked_body: bytes
) -> None:
    """A chunked upload to an Ollama route (a connection the front hands to aiohttp) whose chunked framing
    is broken got no answer for client_timeout_s (60 s), then a 408 `request_timeout`, while its reservation
    of max_buffered_mib (a chunked body counts as max_body_mib) and its key's max_concurrent place were held
    all that time. The same bytes to /v1/chat/completions (tunnelled) get a 400 at once. aiohttp's C parser
    raises on the bad chunk and drops the request's payload without setting an error on it, so the handler
    that awaits `request.read()` waits for a body that will never end."""
    head = b"POST /api/chat HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
    answer, took = await _first_answer(standin, head + chunked_body, timeout_s=10)
    assert answer.startswith(b"HTTP/1.1 400"), (took, answer[:300])
    error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    assert isinstance(error, str), error  # Ollama's shape
    assert "chunked body" in error


async def test_an_unknown_expectation_on_an_ollama_route_is_answered_in_the_apis_shape(
    standin: Daemon,
) -> None:
    """`Expect: foo` on an Ollama route got aiohttp's own 417 in text/plain ("Unknown Expect: foo"), from
    aiohttp's expect handler, which runs before every middleware, so neither the error shape nor the
    access log saw it. (The same request to /v1/chat/completions is tunnelled without its Expect line and
    served.) A 417 is allowed (RFC 9110 10.1.1), but in the API's JSON error shape, as every other error."""
    data = (
        b"POST /api/chat HTTP/1.1\r\nHost: localhost\r\nExpect: foo\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_BODY), _BODY)
    )
    answer, _ = await _first_answer(standin, data, timeout_s=10)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), answer[:300]
    assert "error" in json.loads(body), body


async def test_a_header_value_means_the_same_on_the_front_as_on_aiohttp_whatever_its_trailing_space(
    make_daemon: MakeDaemon, tmp_path: Path
) -> None:
    """llhttp hands the front a header's value with its trailing whitespace (`x-api-key: KEY `), which RFC
    9112 5 says is not part of the value and aiohttp's parser strips. The front's HeaderLines kept it, so
    the same key (or Origin) was refused with 401 (403) on the OpenAI routes the front checks, and accepted
    on every aiohttp route (/api/chat): one request, two answers, as the documented contract
    (HeaderLines answers as a CIMultiDict of the same lines) says it must not be."""
    keys = write_keys(tmp_path / "keys", [{"name": "bob", "key": BOB}])
    daemon = await make_daemon(models=MODELS, config={"api_keys_file": str(keys)})
    statuses = {}
    for path in (b"/api/chat", b"/v1/chat/completions"):
        data = (
            b"POST %s HTTP/1.1\r\nHost: localhost\r\nx-api-key: %s \r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (path, BOB.encode(), len(_BODY), _BODY)
        )
        answer, _ = await _first_answer(daemon, data, timeout_s=10)
        statuses[path] = answer.split(b"\r\n", 1)[0]
    # The model does not exist: a key that was taken gets 404 on both APIs.
    assert statuses == {p: b"HTTP/1.1 404 Not Found" for p in statuses}, statuses


TWO_AGENTS = (
    b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\nUser-Agent: a\r\nUser-Agent: b\r\n"
    b"Connection: close\r\n\r\n"
)


async def test_a_repeated_singleton_header_on_a_tunnelled_request_gets_the_apis_400(standin: Daemon) -> None:
    """Two `User-Agent` lines (or two Content-Type, ETag, Max-Forwards, Server, Content-Location,
    Content-Range) on GET /v1/models: llhttp takes them, so the front tunnels the request to the app's
    internal listener, whose aiohttp parser refuses duplicate singleton headers. Its default error page
    reaches the client as is: `HTTP/1.0 400`, text/plain "Duplicate 'User-Agent' header found.", and
    `Server: Python/3.11 aiohttp/3.14.5` (the versions every other answer hides). It must be the front's
    own 400 in OpenAI's error shape, HTTP/1.1, as for every other head the front refuses."""
    data = TWO_AGENTS.replace(b"/api/tags", b"/v1/models")
    answer, _ = await _first_answer(standin, data, timeout_s=10)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:300]
    assert b"aiohttp" not in head, head
    assert json.loads(body)["error"]["code"] == "invalid_request", body


async def test_a_repeated_singleton_header_on_an_ollama_route_gets_ollamas_400(standin: Daemon) -> None:
    """The same on an Ollama route (a connection handed to aiohttp): aiohttp's parser refuses it, and the
    hand-off's error handler answers `HTTP/1.0 400` in OpenAI's shape, not Ollama's `{"error": "..."}`,
    under aiohttp's Server header."""
    data = TWO_AGENTS
    answer, _ = await _first_answer(standin, data, timeout_s=10)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:300]
    assert b"aiohttp" not in head, head
    assert isinstance(json.loads(body)["error"], str), body


@pytest.mark.parametrize(
    "second",
    [
        b"GET /api/tags HTTP/1.1\r\nConnection: close\r\n\r\n",  # no Host in HTTP/1.1
        b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\nHost: localhost\r\nConnection: close\r\n\r\n",  # two
    ],
    ids=["no-host", "two-hosts"],
)
async def test_a_later_head_without_one_host_is_refused_in_turn_after_the_answer_before_it(
    standin: Daemon, second: bytes
) -> None:
    """The front refuses a request with no Host (HTTP/1.1) or two with its own 400 (RFC 9112 3.2), but only
    a connection's first: the guard of a handed-off connection (HandedOffGuard) passes a later such head to
    aiohttp, whose parser refuses it, and, the two requests having come in one read, loses the answer to
    the GET /api/version pipelined before it. The client got only `HTTP/1.0 400` in OpenAI's shape. The
    first request must be answered, then the refusal in Ollama's shape (what the front gives the same
    head as a first request)."""
    first = b"GET /api/version HTTP/1.1\r\nHost: localhost\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", standin.port)
    try:
        writer.write(first + second)
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert b"HTTP/1.1 400" in answer, answer


@pytest.mark.parametrize("path", [b"/v1/chat/completions", b"/api/chat"])
@pytest.mark.parametrize("expect", [b"Expect: \r\n", b"Expect: foo\r\n"], ids=["empty", "http-1.0"])
async def test_an_empty_expect_or_an_http_1_0_one_is_no_expectation(
    standin: Daemon, path: bytes, expect: bytes
) -> None:
    """An empty Expect is an empty list of expectations (RFC 9110 5.6.1), and HTTP/1.0 has none: aiohttp
    looks at neither, and such a request is served (here the 404 of a model no one has)."""
    version = b"1.0" if expect.endswith(b"foo\r\n") else b"1.1"
    data = (
        b"POST %s HTTP/%s\r\nHost: localhost\r\n%sContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (path, version, expect, len(_BODY), _BODY)
    )
    answer, _ = await _first_answer(standin, data, timeout_s=10)
    assert answer.split(b"\r\n", 1)[0].split(b" ")[1] == b"404", answer[:300]

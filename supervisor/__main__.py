"""The process's entry point, for `python -m supervisor` and the `llm-supervisor` script alike."""

import contextlib
import os
import sys
from collections.abc import Iterator

# structlog imports rich (for tracebacks) and greenlet (for a deprecated thread-local API) whenever they
# are installed, and together they cost the daemon about 3 MiB. It uses neither: tracebacks are rendered
# to plain text before the renderer sees them, so that secrets in them can be masked (logs.configure). A
# None in sys.modules makes their import fail, which structlog handles. Only here, in a process of our
# own; a program that imports the package as a library keeps them.
_UNUSED_OPTIONAL_IMPORTS = ("rich", "greenlet")

# Where OpenSSL looks for its CA bundle file when this variable names one: a path that cannot exist.
_NO_BUNDLE = "/nonexistent/llm-supervisor-serve-uses-no-tls-client"


@contextlib.contextmanager
def _ca_bundle_left_unread() -> Iterator[None]:
    """While aiohttp is imported: its two default TLS client contexts, built at import, get the system's
    certificate directory but not its CA bundle file.

    Each context parses the whole bundle (144 certificates on Debian), 1.85 MiB of the daemon's idle RSS.
    The daemon's aiohttp client never opens TLS: it speaks plain HTTP to its children on loopback and to
    fleet peers (settings refuse any advertise_url but http://, both APIs' forwarding skips a node whose
    record in Redis names another, and no redirect is followed). The directory, which OpenSSL reads a
    certificate at a time when a chain is checked, keeps those contexts able to verify all the same
    where the system has one (Debian's /etc/ssl/certs). The variable is put back at once, so every other
    TLS client (the hub's downloads, Redis over TLS) and every child sees the environment as it was.
    """
    before = os.environ.get("SSL_CERT_FILE")
    os.environ["SSL_CERT_FILE"] = _NO_BUNDLE
    try:
        yield
    finally:
        if before is None:
            del os.environ["SSL_CERT_FILE"]
        else:
            os.environ["SSL_CERT_FILE"] = before


def main() -> None:
    for name in _UNUSED_OPTIONAL_IMPORTS:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    if sys.argv[1:2] == ["serve"]:  # the daemon; the client commands may well speak HTTPS
        with _ca_bundle_left_unread():
            import aiohttp.connector  # noqa: F401  (the import that builds the contexts)
    from supervisor.cli import main as run

    run()


if __name__ == "__main__":
    main()

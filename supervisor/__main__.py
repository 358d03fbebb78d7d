"""The process's entry point, for `python -m supervisor` and the `llm-supervisor` script alike."""

import sys

# structlog imports rich (for tracebacks) and greenlet (for a deprecated thread-local API) whenever they
# are installed, and together they cost the daemon about 3 MiB. It uses neither: tracebacks are rendered
# to plain text before the renderer sees them, so that secrets in them can be masked (logs.configure). A
# None in sys.modules makes their import fail, which structlog handles. Only here, in a process of our
# own; a program that imports the package as a library keeps them.
_UNUSED_OPTIONAL_IMPORTS = ("rich", "greenlet")


def main() -> None:
    for name in _UNUSED_OPTIONAL_IMPORTS:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    from supervisor.cli import main as run

    run()


if __name__ == "__main__":
    main()

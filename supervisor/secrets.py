"""What is secret and how it shows: the one rule behind every answer and every log event.

Secret: a value under a name that says so (`HF_TOKEN`, `--api-key`, `x-api-key`, `db_password`), any
manifest `env` value (operators put credentials there), and any value the daemon was told is secret
(each child's own key). It shows as `***`. Absolute paths and URLs are not secret, but they say more
about the host than a caller without an admin key needs: `hide_internals` shortens them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import PurePosixPath
from typing import Any, Final

from supervisor.manifests import Manifest

MASK: Final = "***"

# A name is secret when one of its words ends with one of these (apiKey, HF_TOKEN, --hf-token) ...
_SECRET_WORDS: Final = (
    "key",
    "keys",
    "token",
    "secret",
    "secrets",
    "password",
    "passwd",
    "authorization",
    "credential",
    "credentials",
)
# ... unless its last word says the value only points at one or counts them (api_key_file, key_name).
_POINTER_WORDS: Final = frozenset({"file", "path", "dir", "name", "names", "id", "ids", "count", "type"})
# Shorter values are too likely to occur by chance in text (`1`, `true`) to be replaced wherever seen.
_MIN_KNOWN: Final = 6

_known: Final[set[str]] = set()


# Every log event asks is_secret_name of each field name: a handful of names, answered from here. A plain
# dict, not functools.lru_cache: compiled, a lookup in it costs a quarter of a call through the cache.
_SECRET_NAMES: Final[dict[str, bool]] = {}
_SECRET_NAMES_MAX: Final = 4096


# Engines' short forms of secret flags, whose names say nothing: llama-server's -hft is --hf-token.
_SECRET_SHORT_FLAGS: Final = frozenset({"-hft"})
# A Hugging Face token, whatever flag or field carries it.
_HF_TOKEN: Final = re.compile(r"hf_[A-Za-z0-9]{30,}")


def is_secret_name(name: str) -> bool:
    """True for HF_TOKEN, --api-key, x-api-key, apiKey, Authorization, -hft; not for max_tokens,
    tokenizer, api_key_file, key_name."""
    known = _SECRET_NAMES.get(name)
    if known is not None:
        return known
    if name in _SECRET_SHORT_FLAGS:
        return True
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    secret = bool(words) and words[-1] not in _POINTER_WORDS
    secret = secret and any(word.endswith(suffix) for word in words for suffix in _SECRET_WORDS)
    if len(_SECRET_NAMES) >= _SECRET_NAMES_MAX:
        _SECRET_NAMES.clear()  # names from outside (a manifest's env, flags): start again, stay bounded
    _SECRET_NAMES[name] = secret
    return secret


def remember(value: str) -> None:
    """Mask `value` wherever it appears in a log event from now on (a child's key, a token in argv)."""
    if len(value) >= _MIN_KNOWN:
        _known.add(value)


def forget(value: str) -> None:
    _known.discard(value)


def remember_launch(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Remember the secret values a child is started with, so that its own output cannot show them."""
    for name, value in env.items():
        if is_secret_name(name):
            remember(value)
    for masked, arg in zip(redact_args(argv), argv, strict=True):
        if masked != arg:
            remember(arg.partition("=")[2] if "=" in masked else arg)


def redact_args(args: Sequence[str]) -> list[str]:
    """argv with the value of every secret flag masked (`--api-key X`, `--hf-token=X`, `-hft X`), and
    anything shaped like a Hugging Face token."""
    shown: list[str] = []
    hide_next = False
    for arg in args:
        if _HF_TOKEN.search(arg):
            shown.append(_HF_TOKEN.sub(MASK, arg))
            hide_next = False
            continue
        if hide_next and not arg.startswith("--"):
            shown.append(MASK)
            hide_next = False
            continue
        hide_next = False
        flag, eq, _ = arg.partition("=")
        if arg.startswith("-") and is_secret_name(flag):
            if eq:
                shown.append(f"{flag}={MASK}")
                continue
            hide_next = True
        shown.append(arg)
    return shown


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """Every value masked: a manifest's environment is where credentials go, whatever their name."""
    return dict.fromkeys(env, MASK)


# Free text (an engine's output line, an error message): `--hf-token X`, `HF_TOKEN=X`, `'api_key': 'X'`,
# `Bearer X`. The name decides, as everywhere else.
_FLAG_IN_TEXT: Final = re.compile(r"(?P<name>--?[A-Za-z][\w.-]*)(?P<sep>=|[ \t]+)(?P<value>[^\s'\",}\]]+)")
_PAIR_IN_TEXT: Final = re.compile(
    r"(?P<q>['\"]?)(?P<name>[A-Za-z_][\w.-]*)(?P=q)(?P<sep>\s*[:=]\s*)(?P<vq>['\"]?)(?P<value>[^\s'\",}\]]+)"
)
_BEARER_IN_TEXT: Final = re.compile(r"(?i)\b(?P<scheme>bearer|basic)\s+[\w.~+/=-]+")
# A password in a URL (`https://user:password@host`, `redis://:password@host`): HF_ENDPOINT behind a proxy,
# a Redis URL in a message.
_URL_PASSWORD: Final = re.compile(r"(?P<head>[A-Za-z][\w+.-]*://[^\s/@:]*:)[^\s/@]+@")
# Each of the three needs a space, a `:` or a `=`: text with none (a method, a path, a model name, an id)
# skips them. A log event is mostly such fields, and the three cost microseconds each.
_MAY_NAME_A_SECRET: Final = re.compile(r"[\s:=]")


# A name that ends in one of these is a file's (`api_keys.yaml: cannot read ...`), not a secret's field.
_FILE_SUFFIXES: Final = (".yaml", ".yml", ".json", ".txt", ".toml", ".conf", ".cfg")


def _mask_named(match: re.Match[str]) -> str:
    value = match["value"]
    name = match["name"]
    # A small number in an engine's output is a count or an id (`EOS token = 2`), not a credential.
    if not is_secret_name(name) or value == MASK or (value.isdigit() and len(value) < 6):
        return match[0]
    if name.lower().endswith(_FILE_SUFFIXES):  # every error about a keys file lost its first word
        return match[0]
    start, end = match.span("value")
    return match[0][: start - match.start()] + MASK + match[0][end - match.start() :]


def scrub(text: str) -> str:
    """`text` with known secrets and the values of secret-named flags and fields masked."""
    if _known:
        for secret in tuple(_known):  # a snapshot: a thread may log while a child starts
            if secret in text:
                text = text.replace(secret, MASK)
    return mask_named_values(text) if _may_name_a_secret(text) else text


def _may_name_a_secret(text: str) -> bool:
    """Whether `text` holds a space, a `:` or a `=` (_MAY_NAME_A_SECRET). Most log fields are short
    printable text without them, told in a few string methods rather than a regex call: every other
    whitespace character that `\\s` matches is unprintable (checked over all of Unicode in the tests)."""
    if text.isprintable() and " " not in text and ":" not in text and "=" not in text:
        return False
    return _MAY_NAME_A_SECRET.search(text) is not None


def mask_named_values(text: str) -> str:
    """`text` with Bearer tokens and the values of secret-named flags and fields masked (scrub's patterns,
    which it skips for text that none of them can match)."""
    text = _BEARER_IN_TEXT.sub(lambda m: f"{m['scheme']} {MASK}", text)
    text = _URL_PASSWORD.sub(lambda m: f"{m['head']}{MASK}@", text)
    text = _FLAG_IN_TEXT.sub(_mask_named, text)
    return _PAIR_IN_TEXT.sub(_mask_named, text)


# Values that no rule masks: they leave redact() at once.
_NUMBERS: Final = frozenset({int, float, bool})


def redact(value: Any, name: str | None = None) -> Any:
    """A JSON-like value with every secret masked: by the field's `name`, argv and env fields by their
    shape, and every string scrubbed. Numbers and booleans stay (`api_keys=3` counts keys)."""
    if value is None or type(value) in _NUMBERS:
        return value
    if name is not None and is_secret_name(name) and _holds_text(value):
        return MASK
    if name in ("argv", "args", "cmdline") and _is_str_list(value):
        return [scrub(a) for a in redact_args(value)]
    if name == "env" and isinstance(value, Mapping):
        return redact_env(value)
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, Mapping):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v) for v in value]
    return value


def _holds_text(value: Any) -> bool:
    if isinstance(value, str | bytes):
        return bool(value)
    if isinstance(value, Mapping):
        return any(_holds_text(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_text(v) for v in value)
    return False


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list | tuple) and all(isinstance(a, str) for a in value)


# Event fields that name a secret rather than hold one: the access log's `key` is the API key's name.
_LOG_FIELDS_NAMING_SECRETS: Final = frozenset({"key"})


def redact_event(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> dict[str, Any]:
    """structlog processor: the same rule for every field of every event."""
    return {
        key: redact(value, None if key in _LOG_FIELDS_NAMING_SECRETS else key) for key, value in event.items()
    }


# --- internals: paths and URLs ------------------------------------------------------------------------

_PATH_IN_TEXT: Final = re.compile(r"(?<![\w.~:/-])/[^\s'\"`<>()\[\]{},;]+")
_URL_IN_TEXT: Final = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"`<>]+", re.IGNORECASE)


def short_path(path: str) -> str:
    """`/srv/models/demo.gguf` -> `demo.gguf`: what the thing is, not where this host keeps it."""
    return PurePosixPath(path).name or path


def _short_path_match(match: re.Match[str]) -> str:
    path = match[0].rstrip(".:")  # the end of a sentence, or `path:line`, is not part of the name
    return short_path(path) + match[0][len(path) :]


def hide_internals(text: str) -> str:
    """`text` with absolute paths cut to their last part and URLs replaced by `<url>`."""
    return _PATH_IN_TEXT.sub(_short_path_match, _URL_IN_TEXT.sub("<url>", text))


def _map_strings(value: Any, change: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return change(value)
    if isinstance(value, Mapping):
        return {k: _map_strings(v, change) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_map_strings(v, change) for v in value]
    return value


def shown(value: Any, sees_internals: bool) -> Any:
    """A JSON-like document as an answer may carry it: every string scrubbed of secrets, and of paths
    and URLs unless the caller may see internals. Mapping keys (model names) are left as they are."""
    return _map_strings(value, scrub if sees_internals else lambda text: hide_internals(scrub(text)))


def manifest_document(manifest: Manifest, sees_internals: bool) -> dict[str, Any]:
    """The manifest's fields as answers show them (defaults left out): env values and secret flag
    values masked; paths cut to their names unless the caller may see internals."""
    document = manifest.model_dump(mode="json", exclude_defaults=True)
    if "env" in document:
        document["env"] = redact_env(document["env"])
    for argv in ("command", "args"):  # a vLLM manifest's `command` is an argv too
        if argv in document:
            document[argv] = redact_args(document[argv])
    result: dict[str, Any] = shown(document, sees_internals)
    return result

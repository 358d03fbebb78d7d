"""Access rules as pure functions: keys, roles, Origins, Hosts, priority caps, the refused listener."""

from __future__ import annotations

import hashlib
import re
import socket
from pathlib import Path

import pytest
import structlog.testing

from supervisor import secrets
from supervisor.access import (
    AccessControl,
    Caller,
    host_allowed,
    is_loopback_host,
    origin_allowed,
    required_role,
    unauthenticated_refusal,
)
from supervisor.api import openai
from supervisor.config import Settings
from supervisor.errors import SupervisorError
from supervisor.keys import KeyEntry, KeyRing, KeysFileError, read_keys_file
from supervisor.output_limits import cap_output_tokens

ALICE = "alice-key-0123456789abcdef"
GATE = AccessControl(Settings(), KeyRing([]))  # no node key: its salts come from a secret made now


def test_a_key_is_found_by_its_sha256_whether_given_plain_or_hashed() -> None:
    ring = KeyRing(
        [
            KeyEntry(name="alice", key=ALICE, role="inference"),
            KeyEntry(name="bob", key_sha256=hashlib.sha256(b"bob-key-0123456789abcd").hexdigest()),
        ],
        direct_admin_key="admin-key-0123456789abcdef",
    )
    alice = ring.identify(ALICE)
    assert alice is not None
    assert alice.name == "alice"
    assert not alice.is_admin
    bob = ring.identify("bob-key-0123456789abcd")
    assert bob is not None
    assert bob.name == "bob"
    admin = ring.identify("admin-key-0123456789abcdef")
    assert admin is not None
    assert admin.is_admin
    assert admin.sees_internals
    assert ring.identify("wrong") is None
    assert ring.identify(ALICE[:-1]) is None


def test_no_keys_means_nobody_has_to_prove_anything() -> None:
    ring = KeyRing([])
    assert not ring.configured


def test_keys_file_errors_name_the_entry_and_field(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("- {name: a, key: short}\n")
    with pytest.raises(KeysFileError, match=r"entry 1: key"):
        read_keys_file(path)
    path.write_text(f"- {{name: a, key: {ALICE}, key_sha256: {'a' * 64}}}\n")
    with pytest.raises(KeysFileError, match="exactly one"):
        read_keys_file(path)
    path.write_text(f"- {{name: a, key: {ALICE}}}\n- {{name: a, key: {ALICE}x}}\n")
    with pytest.raises(KeysFileError, match="unique"):
        read_keys_file(path)
    path.write_text("keys: [")
    with pytest.raises(KeysFileError, match="cannot read"):
        read_keys_file(path)
    path.write_text(f"- {{name: a, key: {ALICE}, role: root}}\n")
    with pytest.raises(KeysFileError, match="role"):
        read_keys_file(path)


@pytest.mark.parametrize(
    "text",
    [
        f"- name: a\n  key: {ALICE}\n  role: [admin\n",  # PyYAML quotes the line after the key's
        f"- {{name: a, role: admin, tag: {ALICE}\n",  # the key on the line it quotes, under no key name
        f"- name: a\n  key: {ALICE}: {ALICE}\n",
    ],
)
def test_a_broken_keys_file_is_refused_with_where_and_no_line_of_it(tmp_path: Path, text: str) -> None:
    """PyYAML's message quotes the lines around its error, which in a keys file (or a config file with
    `api_key`) may hold a key: the refusal (logged as reload_rejected) now says where and what only."""
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(KeysFileError) as raised:
        read_keys_file(path)
    message = str(raised.value)
    assert ALICE[:8] not in message
    assert re.search(r"cannot read the keys file: invalid YAML at line \d+, column \d+: ", message), message


def test_keys_file_entries_with_their_limits(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(f"- {{name: a, key: {ALICE}, models: ['llama*'], max_priority: 3, max_concurrent: 2}}\n")
    (entry,) = read_keys_file(path)
    assert entry.role == "inference"
    assert entry.models == ("llama*",)
    assert entry.max_priority == 3
    assert entry.max_concurrent == 2


@pytest.mark.parametrize(
    ("method", "path", "role"),
    [
        ("GET", "/health", None),
        ("GET", "/health/ready", None),
        ("GET", "/", None),
        ("GET", "/api/version", None),
        ("POST", "/v1/chat/completions", "inference"),
        ("POST", "/api/chat", "inference"),
        ("GET", "/v1/models", "inference"),
        ("GET", "/api/tags", "inference"),
        ("POST", "/api/pull", "admin"),
        ("GET", "/api/pull/status/x", "admin"),
        ("DELETE", "/api/pull/x", "admin"),
        ("DELETE", "/api/delete", "admin"),
        ("GET", "/api/status", "admin"),
        ("GET", "/v1/admin/gpu-memory", "admin"),
        ("GET", "/metrics", "admin"),
        ("POST", "/health", "inference"),
    ],
)
def test_route_roles(method: str, path: str, role: str | None) -> None:
    assert required_role(method, path, metrics_public=False) == role


def test_metrics_public_lets_any_key_scrape() -> None:
    assert required_role("GET", "/metrics", metrics_public=True) == "inference"


@pytest.mark.parametrize(
    ("origin", "allowed"),
    [
        ("http://localhost", True),
        ("http://localhost:3000", True),
        ("http://127.0.0.1:8080", True),
        ("http://[::1]:5173", True),
        ("https://localhost", True),
        ("http://evil.example", False),
        ("http://localhost.evil.example", False),
        ("http://localhost:3000.evil.example", False),
        ("http://127.0.0.1.nip.io", False),
        ("null", False),
        ("file://", False),
    ],
)
def test_origins_from_this_machine_only(origin: str, allowed: bool) -> None:
    assert origin_allowed(origin, ()) is allowed


def test_allowed_origins_are_globs() -> None:
    assert origin_allowed("https://chat.example.com", ("https://*.example.com",))
    assert not origin_allowed("https://example.org", ("https://*.example.com",))


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("localhost", True),
        ("localhost:11435", True),
        ("127.0.0.1:11435", True),
        ("[::1]:11435", True),
        ("LOCALHOST.", True),
        ("evil.example", False),
        ("evil.example:11435", False),
        ("127.0.0.1.evil.example", False),
        ("", False),
        # An address: a page that sends one was served from it (the daemon's own /ui), not rebound.
        ("192.168.1.10:11435", True),
        ("10.0.0.5", True),
        ("[fe80::1]:11435", True),
        ("[2001:db8::1]", True),
        ("192.168.1.10.evil.example", False),
        ("[evil.example]", False),
        ("fe80::1", False),  # not how a Host header writes an IPv6 address
    ],
)
def test_hosts_that_name_this_machine(host: str, allowed: bool) -> None:
    assert host_allowed(host, ()) is allowed


def test_this_machines_own_name_is_a_host_of_its_own() -> None:
    name = socket.gethostname()
    assert host_allowed(f"{name}:11435", ())
    assert host_allowed(name.upper(), ())
    assert not host_allowed(f"{name}.evil.example", ())


def test_host_is_checked_wherever_no_key_is_needed() -> None:
    """A DNS-rebinding page has no key: Host is what tells it apart where no key is asked for."""
    no_keys, keys = KeyRing([]), KeyRing([], "admin-key-0123456789abcdef")
    assert AccessControl(Settings(host="127.0.0.1"), no_keys).host_checked
    assert AccessControl(Settings(host="127.0.0.1"), keys).host_checked
    assert AccessControl(Settings(host="0.0.0.0", allow_unauthenticated=True), no_keys).host_checked
    beyond_loopback = AccessControl(Settings(host="0.0.0.0"), keys)
    assert not beyond_loopback.host_checked
    beyond_loopback.replace(Settings(host="0.0.0.0", allow_unauthenticated=True), no_keys)  # a SIGHUP
    assert beyond_loopback.host_checked


def test_the_name_a_daemon_advertises_is_its_own() -> None:
    """A fleet peer forwards a request under the URL this node advertises."""
    gate = AccessControl(Settings(host="0.0.0.0", advertise_url="http://node-b.lan:11435"), KeyRing([]))
    assert host_allowed("node-b.lan:11435", gate.allowed_hosts)
    assert not host_allowed("node-c.lan:11435", gate.allowed_hosts)


def test_allowed_hosts_are_globs() -> None:
    assert host_allowed("gpu-box.lan:11435", ("*.lan",))


def test_a_host_allowed_once_by_a_glob_is_asked_again() -> None:
    # Loopback names are kept as allowed; one a glob allowed is not: the next reload may drop the glob.
    assert host_allowed("gpu-box.lan", ("*.lan",))
    assert not host_allowed("gpu-box.lan", ())
    for _ in range(2):  # the second answer comes from what the first kept
        assert host_allowed("localhost:11435", ())
        assert not host_allowed("evil.example", ())


def test_loopback_listen_addresses() -> None:
    assert is_loopback_host("127.0.0.1")
    assert is_loopback_host("::1")
    assert is_loopback_host("localhost")
    assert not is_loopback_host("0.0.0.0")
    assert not is_loopback_host("::")
    assert not is_loopback_host("192.168.1.10")
    assert not is_loopback_host("gpu-box")


def test_a_non_loopback_listener_needs_a_key() -> None:
    open_settings = Settings(host="0.0.0.0")
    refusal = unauthenticated_refusal(open_settings, KeyRing([]))
    assert refusal is not None
    assert all(word in refusal for word in ("api_keys_file", "api_key", "allow_unauthenticated"))
    # It reaches the operator through the log, whose masking of secrets must leave it readable (the
    # "key: anyone" it once held read as a key's value and came out as "key: ***").
    assert secrets.scrub(refusal) == refusal
    assert unauthenticated_refusal(Settings(host="0.0.0.0", allow_unauthenticated=True), KeyRing([])) is None
    assert unauthenticated_refusal(open_settings, KeyRing([], "admin-key-0123456789abcdef")) is None
    assert unauthenticated_refusal(Settings(host="127.0.0.1"), KeyRing([])) is None


def test_a_keys_model_globs_and_priority_cap() -> None:
    who = Caller(name="a", role="inference", models=("llama*", "qwen-7b"), max_priority=2)
    assert who.allows_model("llama-3")
    assert who.allows_model("other", "qwen-7b")  # by alias
    assert not who.allows_model("mistral")
    with pytest.raises(SupervisorError) as raised:
        who.check_model("mistral", requested="Mistral")
    assert (raised.value.status, raised.value.code) == (404, "model_not_found")
    assert "'Mistral'" in raised.value.message  # as asked, not the model's own spelling
    assert who.cap_priority(10) == 2
    assert who.cap_priority(1) == 1
    assert who.cap_priority(None) is None


def test_output_cap_lowers_or_sets_the_limit() -> None:
    body: dict[str, object] = {"max_tokens": 500, "max_completion_tokens": 10}
    assert cap_output_tokens(body, 64)
    assert body == {"max_tokens": 64, "max_completion_tokens": 10}
    body = {}
    assert cap_output_tokens(body, 64)
    assert body == {"max_tokens": 64}
    body = {"max_tokens": 8}
    assert not cap_output_tokens(body, 64)
    assert body == {"max_tokens": 8}
    body = {"n_predict": -1}
    assert cap_output_tokens(body, 64)
    assert body == {"n_predict": 64}
    assert not cap_output_tokens(body, None)


def test_the_daemons_own_pages_are_same_origin() -> None:
    assert origin_allowed("http://10.0.0.5:11435", (), host="10.0.0.5:11435")
    assert origin_allowed("https://gpu.example.com", (), host="gpu.example.com")
    assert not origin_allowed("http://evil.example", (), host="10.0.0.5:11435")


def test_the_body_limits_follow_the_gates_settings() -> None:
    """Read from the settings the gate holds, which a reload replaces (restart-only ones, these among
    them, keep the running values: app.reload, tests/integration/test_lifecycle.py)."""
    gate = AccessControl(Settings(max_body_mib=2, max_buffered_mib=8), KeyRing([]))
    assert (gate.max_body_bytes, gate.max_buffered_bytes) == (2 * 2**20, 8 * 2**20)
    gate.replace(Settings(max_body_mib=1, max_buffered_mib=3), KeyRing([]))
    assert (gate.max_body_bytes, gate.max_buffered_bytes) == (2**20, 3 * 2**20)


def test_plain_keys_in_a_file_others_can_read_are_warned_of(tmp_path: Path) -> None:
    """A keys file of mode 0644 (an editor's or cp's under umask 022) gave every local user the keys
    in it, without a word."""
    path = tmp_path / "keys.yaml"
    path.write_text("- {name: alice, key: a-long-random-key-0123, role: inference}\n")
    path.chmod(0o644)
    with structlog.testing.capture_logs() as logged:
        read_keys_file(path)
    (warning,) = [e for e in logged if e["event"] == "keys_file_readable_by_others"]
    assert (warning["plain_keys"], warning["mode"]) == (["alice"], "0o644")
    assert "a-long-random-key-0123" not in str(warning)
    path.chmod(0o600)
    with structlog.testing.capture_logs() as logged:
        read_keys_file(path)
    assert not logged
    path.write_text(f"- {{name: ops, key_sha256: {'ab' * 32}, role: admin}}\n")
    path.chmod(0o644)  # digests only: nothing to give away
    with structlog.testing.capture_logs() as logged:
        read_keys_file(path)
    assert not logged


def test_each_key_gets_a_prefix_cache_salt_of_its_own() -> None:
    """vLLM's cache_salt keeps keys from learning each other's prompts through a shared prefix cache."""
    alice, bob = Caller(name="alice", role="inference"), Caller(name="bob", role="inference")
    salts = []
    for who in (alice, alice, bob):
        payload: dict[str, object] = {"cache_salt": "chosen by the client"}
        assert openai.salt_prefix_cache(payload, who, GATE)
        salts.append(payload["cache_salt"])
    assert salts[0] == salts[1] != salts[2]
    assert "alice" not in str(salts[0])
    assert len(str(salts[0])) <= 128  # vLLM's bound
    assert not openai.salt_prefix_cache(
        {}, Caller(name=None, role="admin"), GATE
    )  # keys off: nothing to keep apart


def test_a_forwarded_request_keeps_the_prefix_cache_salt_its_first_node_gave_it() -> None:
    """On the node a request was forwarded to, the caller is always the node key: salted again there,
    every key's forwarded requests shared one salt (and one prefix cache). A hop (the node key and the
    hop header) now keeps the salt the first node made for the client's key; nothing else does."""
    node = Caller(name="node", role="inference", keys_configured=True, node=True)
    alice = Caller(name="alice", role="inference", keys_configured=True)
    salted: dict[str, object] = {"cache_salt": "made for alice by node-a"}
    assert not openai.salt_prefix_cache(salted, node, GATE, hop=True)
    assert salted["cache_salt"] == "made for alice by node-a"
    for who, hop in ((node, False), (alice, True)):  # no hop header; a client's own hop header
        payload: dict[str, object] = {"cache_salt": "made for alice by node-a"}
        assert openai.salt_prefix_cache(payload, who, GATE, hop=hop)
        assert payload["cache_salt"] != "made for alice by node-a"
    unsalted: dict[str, object] = {}
    assert openai.salt_prefix_cache(unsalted, node, GATE, hop=True)  # a first node without keys: salted here
    assert isinstance(unsalted["cache_salt"], str)


def test_nodes_sharing_a_node_key_give_a_key_one_salt() -> None:
    """In a fleet a key's requests forwarded to a node, salted by the first node, share a prefix cache
    with those sent to it directly only if every node makes the same salt for the key."""
    node_key = "node-key-0123456789abcdef"
    a, b = (AccessControl(Settings.model_validate({"node_key": node_key}), KeyRing([])) for _ in range(2))
    assert a.cache_salt("alice") == b.cache_salt("alice") != a.cache_salt("bob")
    other = AccessControl(Settings.model_validate({"node_key": "another-node-key-0123"}), KeyRing([]))
    assert other.cache_salt("alice") != a.cache_salt("alice")
    assert GATE.cache_salt("alice") != a.cache_salt("alice")  # no node key: a secret of its own


def test_the_node_key_proves_a_node_and_a_key_named_node_does_not(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("- {name: node, key: a-long-random-key-0123, role: inference}\n")
    path.chmod(0o600)
    ring = KeyRing(read_keys_file(path), None, "the-node-key-0123456789")
    named_node, node_key = ring.identify("a-long-random-key-0123"), ring.identify("the-node-key-0123456789")
    assert named_node is not None
    assert node_key is not None
    assert (named_node.node, node_key.node) == (False, True)

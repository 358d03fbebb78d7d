"""A child the daemon cannot record (no pid file) is never left running: the load fails, then recovers."""

from __future__ import annotations

import shutil

from tests.integration.conftest import MakeDaemon
from tests.integration.harness import eventually

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_an_unwritable_state_dir_fails_the_load_and_leaks_no_engine(make_daemon: MakeDaemon) -> None:
    daemon = await make_daemon(config={"failure_backoff_s": 0.2, "failure_backoff_max_s": 0.5})
    # Tests run as root, where chmod stops no write: a file where the pid files' folder belongs does.
    children = daemon.state_dir / "children"
    shutil.rmtree(children, ignore_errors=True)
    children.parent.mkdir(parents=True, exist_ok=True)
    children.write_text("not a directory")

    async def failed_again() -> bool:
        status, body, _ = await daemon.post("/v1/chat/completions", CHAT)
        assert (status, body["error"]["code"]) == (503, "model_failed"), body
        assert "cannot record the child's pid" in body["error"]["message"]
        assert daemon.children() == []  # every back-off retry stopped its engine before answering
        return len(daemon.events("pid_file_failed")) >= 3

    await eventually(failed_again, what="three failed loads, each after its back-off")
    assert len(daemon.events("child_started")) == 0
    assert len(daemon.events("child_stopped")) == len(daemon.events("pid_file_failed"))
    assert not list((daemon.state_dir / "keys").glob("*"))  # each key file went with its engine

    children.unlink()  # fixed: the next load after the back-off works

    async def served() -> bool:
        status, body, _ = await daemon.post("/v1/chat/completions", CHAT)
        assert status in (200, 503), body
        return status == 200

    await eventually(served, what="a load once the state dir is writable again")
    assert len(daemon.children()) == 1

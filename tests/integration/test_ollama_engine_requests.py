"""What an Ollama request becomes at the engine, where llama-server would answer otherwise than Ollama:
each test starts a daemon of its own (real llama-server children)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from supervisor.demo_model import write_demo_model
from tests.integration.conftest import MakeDaemon


@pytest.fixture
def base_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The demo model without a chat template, as a base (completion) model's GGUF comes."""
    monkeypatch.setattr(gguf.GGUFWriter, "add_chat_template", lambda self, template: None)
    path = write_demo_model(tmp_path / "base.gguf")
    assert "tokenizer.chat_template" not in gguf.GGUFReader(path).fields
    return path


async def test_generate_sends_a_base_models_prompt_as_it_is(make_daemon: MakeDaemon, base_gguf: Path) -> None:
    """A model without a chat template has Ollama's default template `{{ .Prompt }}`. The prompt went to
    /v1/chat/completions, where llama-server wrapped it in chatml: 57 prompt tokens for "hello", 7 raw."""
    daemon = await make_daemon(models={"base": {"model": str(base_gguf), "ctx_size": 1024, "parallel": 1}})
    status, shown, _ = await daemon.post("/api/show", {"model": "base"})
    assert status == 200, shown
    assert (shown["template"], "chat" in shown["capabilities"]) == ("", False)
    counts = {}
    for raw in (True, False):
        body = {
            "model": "base",
            "prompt": "hello",
            "raw": raw,
            "stream": False,
            "options": {"num_predict": 1},
        }
        status, answer, _ = await daemon.post("/api/generate", body)
        assert status == 200, answer
        counts[raw] = answer["prompt_eval_count"]
    assert counts[False] == counts[True]


async def test_a_tool_whose_optional_fields_are_null_is_accepted(make_daemon: MakeDaemon) -> None:
    """A client building tools from functions without docstrings sends `description: null`: Ollama reads
    it as "", llama-server refused the request (400 'Failed to parse tools')."""
    daemon = await make_daemon(models={"demo": {"capabilities": ["completion", "chat", "tools"]}})
    parameters = {"type": "object", "properties": {"zone": {"type": "string", "description": None}}}
    tool = {"type": "function", "function": {"name": "now", "description": None, "parameters": parameters}}
    status, answer, _ = await daemon.post(
        "/api/chat",
        {
            "model": "demo",
            "messages": [{"role": "user", "content": "what time is it?"}],
            "tools": [tool],
            "stream": False,
            "options": {"num_predict": 2},
        },
    )
    assert status == 200, answer

"""Capabilities: what the weights, the engine flags and the manifest say a model can do, what a request
needs of it, the 400 when it lacks that, and vLLM's tool-call and reasoning parsers by model."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from supervisor import capabilities as caps
from supervisor.capabilities import CapabilityCache, capabilities, ollama_needs, openai_needs, vllm_parsers
from supervisor.demo_model import write_demo_model
from supervisor.errors import SupervisorError
from supervisor.manifests import LlamaServerManifest, ManifestLoadError, VllmManifest, load_files
from supervisor.model_info import ModelInfo, read_weights
from workers.base import ChildKey, Endpoint, GpuPlacement
from workers.vllm_serve import VllmWorker, model_architectures

TOOLS_TEMPLATE = (
    "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
)
THINKING_TEMPLATE = (
    "{% if enable_thinking %}<think>{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
)


def llama(*args: str, **fields: Any) -> LlamaServerManifest:
    return LlamaServerManifest.model_validate(
        {"name": "demo", "engine": "llama-server", "model": "/m.gguf", "args": list(args), **fields}
    )


def vllm(model: str = "org/model", *args: str, **fields: Any) -> VllmManifest:
    return VllmManifest.model_validate(
        {"name": "v", "engine": "vllm", "model": model, "args": list(args), **fields}
    )


def gguf(arch: str = "llama", template: str = "chat", keys: dict[str, Any] | None = None) -> ModelInfo:
    meta = {"general.architecture": arch, **(keys or {})}
    return ModelInfo(format="gguf", model_info=meta, template=template)


def hf(*architectures: str, template: str = "chat", families: tuple[str, ...] = ("x",)) -> ModelInfo:
    return ModelInfo(
        format="safetensors",
        families=families,
        model_info={"general.architectures": list(architectures)},
        template=template,
    )


# --- detection: GGUF metadata and llama-server flags ------------------------------------------------------


@pytest.fixture(scope="module")
def demo_info(tmp_path_factory: pytest.TempPathFactory) -> ModelInfo:
    return read_weights(write_demo_model(tmp_path_factory.mktemp("caps") / "demo.gguf"))


def test_the_demo_model_completes_and_chats_and_nothing_more(demo_info: ModelInfo) -> None:
    # Its chat template names neither tools nor thinking; llama-server runs it without a projector.
    assert capabilities(llama(), demo_info) == ["completion", "chat"]


def test_llama_server_flags_add_embeddings_and_vision(demo_info: ModelInfo) -> None:
    assert capabilities(llama("--embeddings", "--pooling", "mean"), demo_info) == [
        "completion",
        "chat",
        "embedding",
    ]
    assert "embedding" in capabilities(llama("--embedding"), demo_info)
    assert "embedding" in capabilities(llama("--embeddings", "--pooling", "mean"), demo_info)
    for args in (("--mmproj", "/p.gguf"), ("--mmproj=/p.gguf",), ("-mm", "/p.gguf"), ("--mmproj-auto",)):
        assert "vision" in capabilities(llama(*args), demo_info), args
    assert "vision" not in capabilities(llama("--mmproj", "/p.gguf", "--no-mmproj"), demo_info)


def test_the_chat_template_tells_tools_and_thinking() -> None:
    assert capabilities(llama(), gguf(template=TOOLS_TEMPLATE)) == ["completion", "chat", "tools"]
    assert capabilities(llama(), gguf(template=THINKING_TEMPLATE)) == ["completion", "chat", "thinking"]
    r1 = "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    assert "thinking" in capabilities(llama(), gguf(template=r1))
    # Without Jinja, llama-server answers no tools whatever the template says.
    assert "tools" not in capabilities(llama("--no-jinja"), gguf(template=TOOLS_TEMPLATE))
    # A GGUF without a template still completes text (llama-server falls back to a built-in template).
    assert capabilities(llama(), gguf(template="")) == ["completion"]


def test_llama_server_reranks_when_it_pools_by_rank(demo_info: ModelInfo) -> None:
    """--reranking is --embeddings with --pooling rank: /v1/rerank, and scores for embeddings, which is
    why a reranker is not listed as embedding."""
    for args in (("--reranking",), ("--rerank",), ("--embeddings", "--pooling", "rank")):
        assert capabilities(llama(*args), demo_info) == ["completion", "chat", "rerank"], args
    # A reranker's GGUF says rank pooling itself (bge-reranker's conversion); --pooling overrides it.
    reranker = gguf("bert", template="", keys={"bert.pooling_type": 4})
    assert capabilities(llama("--embeddings"), reranker) == ["rerank"]
    assert capabilities(llama("--embeddings", "--pooling", "cls"), reranker) == ["embedding"]
    assert capabilities(llama(), demo_info) == ["completion", "chat"]


def test_a_reranker_asked_to_generate_is_sent_to_rerank() -> None:
    needs = openai_needs("/v1/chat/completions", {"messages": []})
    lacking = caps.missing(needs, ["rerank"])
    assert lacking == "completion"
    refused = caps.refusal(llama("--reranking"), lacking, needs[lacking], ["rerank"])
    assert refused.code == "completion_unsupported"
    assert "send it to /v1/rerank" in refused.message
    assert openai_needs("/rerank", {}) == {"rerank": "/rerank"}
    refused = caps.refusal(llama("--embeddings"), "rerank", "/v1/rerank", ["embedding"])
    assert (refused.code, refused.status) == ("rerank_unsupported", 400)
    assert "runs without --reranking" in refused.message


@pytest.mark.parametrize(
    "info",
    [
        gguf("bert", template=""),
        gguf("nomic-bert", template=""),
        gguf("qwen3", keys={"qwen3.pooling_type": 3}),  # Qwen3-Embedding: a causal model with a pooler
        gguf("gemma3", keys={"gemma3.attention.causal": False}),
    ],
)
def test_an_embedding_gguf_generates_nothing(info: ModelInfo) -> None:
    assert capabilities(llama("--embeddings"), info) == ["embedding"]
    assert capabilities(llama(), info) == []  # and serves nothing without --embeddings


def test_unreadable_or_missing_weights_leave_what_the_flags_say() -> None:
    assert capabilities(llama("--embeddings"), ModelInfo(error="truncated")) == ["completion", "embedding"]
    assert capabilities(llama(), ModelInfo()) == ["completion"]


# --- detection: config.json and vLLM flags ----------------------------------------------------------------


def write_hf_model(directory: Path, config: dict[str, Any], template: str = "chat") -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return directory


def test_a_config_json_gives_the_runner_the_parsers_and_vision(tmp_path: Path) -> None:
    qwen3 = write_hf_model(
        tmp_path / "my-finetune", {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    )
    info = read_weights(qwen3)
    assert capabilities(vllm(str(qwen3)), info) == ["completion", "chat", "tools", "thinking"]

    bert = write_hf_model(tmp_path / "encoder", {"architectures": ["BertModel"], "model_type": "bert"}, "")
    assert capabilities(vllm(str(bert)), read_weights(bert)) == ["embedding", "rerank"]

    vision = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {"num_hidden_layers": 2},
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    gemma = write_hf_model(tmp_path / "seeing", vision)
    assert capabilities(vllm(str(gemma)), read_weights(gemma)) == ["completion", "chat", "vision"]


def test_vllm_flags_and_names_pick_the_runner() -> None:
    llama3 = hf("LlamaForCausalLM")
    assert capabilities(vllm("org/plain"), llama3) == ["completion", "chat"]
    # A pooler embeds, and reranks by cosine similarity.
    embeds = ["embedding", "rerank"]
    assert capabilities(vllm("org/plain", "--runner", "pooling"), llama3) == embeds
    assert capabilities(vllm("org/plain", "--convert=embed"), llama3) == embeds
    assert capabilities(vllm("org/plain", "--task", "embed"), llama3) == embeds
    # Sentence-transformers models on a causal architecture are poolers in vLLM (their modules.json).
    assert capabilities(vllm("Qwen/Qwen3-Embedding-0.6B"), hf("Qwen3ForCausalLM")) == embeds
    assert capabilities(vllm("Qwen/Qwen3-Embedding-0.6B", "--runner", "generate"), hf("Qwen3ForCausalLM"))[
        0
    ] == ("completion")
    # A cross-encoder (a classifier) scores pairs and embeds nothing.
    assert capabilities(vllm("org/classifier"), hf("RobertaForSequenceClassification")) == ["rerank"]
    assert capabilities(vllm("BAAI/bge-reranker-v2-m3"), hf("XLMRobertaModel")) == ["rerank"]
    assert capabilities(vllm("org/plain", "--convert", "classify"), llama3) == ["rerank"]
    assert capabilities(vllm("org/plain", "--task", "score"), llama3) == ["rerank"]
    # A hub repo not downloaded yet: its name alone.
    assert capabilities(vllm("Qwen/Qwen3-8B"), ModelInfo()) == ["completion", "tools", "thinking"]
    assert "vision" in capabilities(
        vllm("Qwen/Qwen2.5-VL-7B-Instruct"), hf("Qwen2_5_VLForConditionalGeneration")
    )


def test_the_manifests_parsers_decide_tools_and_thinking() -> None:
    qwen = hf("Qwen3ForCausalLM")
    assert capabilities(vllm("Qwen/Qwen3-8B", tool_call_parser="none"), qwen) == [
        "completion",
        "chat",
        "thinking",
    ]
    assert capabilities(vllm("Qwen/Qwen3-8B", reasoning_parser="none"), qwen) == [
        "completion",
        "chat",
        "tools",
    ]
    assert capabilities(vllm("org/plain", tool_call_parser="pythonic"), hf("LlamaForCausalLM")) == [
        "completion",
        "chat",
        "tools",
    ]


def test_the_manifests_list_wins_in_the_usual_order(demo_info: ModelInfo) -> None:
    manifest = llama(capabilities=["tools", "completion", "tools", "vision"])
    assert manifest.capabilities == ("tools", "completion", "vision")
    assert capabilities(manifest, demo_info) == ["completion", "vision", "tools"]
    assert capabilities(vllm(capabilities=["embedding"]), hf("LlamaForCausalLM")) == ["embedding"]


def test_the_manifests_list_is_checked() -> None:
    with pytest.raises(ValidationError, match="capabilities"):
        llama(capabilities=["telepathy"])
    with pytest.raises(ValidationError, match="at least 1"):
        llama(capabilities=[])


# --- the vLLM parser table -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "architectures", "tool", "reasoning"),
    [
        ("meta-llama/Llama-3.1-8B-Instruct", ["LlamaForCausalLM"], "llama3_json", None),
        ("meta-llama/Llama-3.2-3B-Instruct", [], "llama3_json", None),
        ("meta-llama/Llama-4-Scout-17B-16E-Instruct", [], "llama4_json", None),
        ("codellama/CodeLlama-34b-Instruct-hf", ["LlamaForCausalLM"], None, None),
        ("/models/tiny-llama", ["LlamaForCausalLM"], None, None),
        ("Qwen/Qwen2.5-7B-Instruct", ["Qwen2ForCausalLM"], "hermes", None),
        ("Qwen/Qwen3-8B", ["Qwen3ForCausalLM"], "hermes", "qwen3"),
        ("Qwen/Qwen3-30B-A3B", ["Qwen3MoeForCausalLM"], "hermes", "qwen3"),
        ("Qwen/Qwen3-4B-Instruct-2507", ["Qwen3ForCausalLM"], "hermes", None),
        ("Qwen/Qwen3-Coder-30B-A3B-Instruct", ["Qwen3MoeForCausalLM"], "qwen3_coder", None),
        ("/srv/weights/house-model", ["Qwen3ForCausalLM"], "hermes", "qwen3"),
        # Of a local path, only the model's own folder and its parent count, or the snapshot's repo.
        ("/home/bob/llama3-runs/out/house-model", ["LlamaForCausalLM"], None, None),
        ("/hf/hub/models--Qwen--Qwen3-8B/snapshots/0a1b2c", [], "hermes", "qwen3"),
        ("Qwen/QwQ-32B", ["Qwen2ForCausalLM"], "hermes", "deepseek_r1"),
        ("mistralai/Mistral-7B-Instruct-v0.3", ["MistralForCausalLM"], "mistral", None),
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", ["MixtralForCausalLM"], "mistral", None),
        ("NousResearch/Hermes-3-Llama-3.1-8B", ["LlamaForCausalLM"], "hermes", None),
        ("ibm-granite/granite-3.1-8b-instruct", ["GraniteForCausalLM"], "granite", None),
        ("ibm-granite/granite-3.2-8b-instruct", ["GraniteForCausalLM"], "granite", "granite"),
        ("ibm-granite/granite-20b-functioncalling", ["GPTBigCodeForCausalLM"], "granite-20b-fc", None),
        ("internlm/internlm2_5-7b-chat", ["InternLM2ForCausalLM"], "internlm", None),
        ("deepseek-ai/DeepSeek-V3-0324", ["DeepseekV3ForCausalLM"], "deepseek_v3", None),
        ("deepseek-ai/DeepSeek-V3.1", ["DeepseekV3ForCausalLM"], "deepseek_v31", "deepseek_v3"),
        ("deepseek-ai/DeepSeek-R1-0528", ["DeepseekV3ForCausalLM"], "deepseek_v3", "deepseek_r1"),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", ["Qwen2ForCausalLM"], "hermes", "deepseek_r1"),
        ("zai-org/GLM-4.5-Air", ["Glm4MoeForCausalLM"], "glm45", "glm45"),
        ("zai-org/GLM-4.6", ["Glm4MoeForCausalLM"], "glm45", "glm45"),
        ("openai/gpt-oss-20b", ["GptOssForCausalLM"], "openai", "openai_gptoss"),
        ("moonshotai/Kimi-K2-Instruct", ["DeepseekV3ForCausalLM"], "kimi_k2", None),
        ("moonshotai/Kimi-K2-Thinking", ["DeepseekV3ForCausalLM"], "kimi_k2", "kimi_k2"),
        # Poolers generate nothing to parse.
        ("Qwen/Qwen3-Embedding-8B", ["Qwen3ForCausalLM"], None, None),
        ("intfloat/e5-mistral-7b-instruct", ["MistralModel"], None, None),
    ],
)
def test_the_parsers_are_detected_from_the_model_id_and_architecture(
    model: str, architectures: list[str], tool: str | None, reasoning: str | None
) -> None:
    parsers = vllm_parsers(vllm(model), architectures)
    assert (parsers.tool, parsers.reasoning) == (tool, reasoning)


def test_a_parser_in_the_manifest_wins_and_none_turns_detection_off() -> None:
    parsers = vllm_parsers(vllm("Qwen/Qwen3-8B", tool_call_parser="qwen3_xml", reasoning_parser="none"), [])
    assert (parsers.tool, parsers.reasoning) == ("qwen3_xml", None)
    assert vllm_parsers(vllm("org/plain", reasoning_parser="deepseek_r1"), []).reasoning == "deepseek_r1"


KEY = ChildKey("k", Path("/state/keys/k.key"))


def argv_of(manifest: VllmManifest) -> list[str]:
    return VllmWorker().launch_spec(manifest, Endpoint(port=1), GpuPlacement({0: 1}, {0: 10}), KEY).argv


def test_the_parsers_become_vllm_flags_before_args() -> None:
    argv = argv_of(vllm("Qwen/Qwen3-8B", "--swap-space", "1"))
    tail = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    assert argv[-7:] == [*tail, "--swap-space", "1"]
    argv = argv_of(vllm("Qwen/Qwen3-8B", tool_call_parser="none", reasoning_parser="none"))
    assert not {"--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser"} & set(argv)
    argv = argv_of(vllm("org/plain", tool_call_parser="pythonic"))
    assert argv[argv.index("--tool-call-parser") + 1] == "pythonic"
    assert "--reasoning-parser" not in argv


def test_the_architecture_comes_from_a_local_config_or_the_hub_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = write_hf_model(tmp_path / "house-model", {"architectures": ["Qwen3ForCausalLM"]})
    assert model_architectures(vllm(str(local)), {}) == ("Qwen3ForCausalLM",)
    assert "--reasoning-parser" in argv_of(vllm(str(local)))

    cache = tmp_path / "hub"
    repo = cache / "models--org--house-model"
    write_hf_model(repo / "snapshots" / "abc123", {"architectures": ["GptOssForCausalLM"]})
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert model_architectures(vllm("org/house-model"), {"HF_HUB_CACHE": str(cache)}) == (
        "GptOssForCausalLM",
    )
    assert model_architectures(vllm("org/house-model"), {"HF_HOME": str(tmp_path)}) == ("GptOssForCausalLM",)
    assert model_architectures(vllm("org/elsewhere"), {"HF_HUB_CACHE": str(cache)}) == ()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    argv = argv_of(vllm("org/house-model"))
    assert argv[argv.index("--tool-call-parser") + 1] == "openai"


def test_the_parser_flags_are_fields_not_args(tmp_path: Path) -> None:
    for arg in (
        "--tool-call-parser=hermes",
        "--enable-auto-tool-choice",
        "--reasoning-parser",
        "--tool_call_parser",
    ):
        with pytest.raises(ValidationError, match=r"tool_call_parser|reasoning_parser"):
            vllm("org/m", arg)
    with pytest.raises(ValidationError, match="tool_call_parser"):
        vllm(tool_call_parser="hermes; rm -rf /")
    path = tmp_path / "m.yaml"
    path.write_text("name: m\nengine: vllm\nmodel: org/m\nreasoning_parser: 42\n")
    with pytest.raises(ManifestLoadError) as raised:
        load_files([path])
    (error,) = raised.value.errors
    assert (error.line, error.field) == (4, "reasoning_parser")


def test_capabilities_change_live_and_the_parsers_restart_the_model() -> None:
    assert not llama().needs_restart_for(llama(capabilities=["completion", "tools"]))
    assert vllm().needs_restart_for(vllm(tool_call_parser="hermes"))
    assert vllm().needs_restart_for(vllm(reasoning_parser="none"))


# --- what requests need, and the refusal ------------------------------------------------------------------

PNG_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_what_an_openai_request_needs() -> None:
    assert openai_needs("/v1/embeddings", {"input": "x", "tools": [TOOL]}) == {"embedding": "/v1/embeddings"}
    assert openai_needs("/v1/completions", {"prompt": "x"}) == {"completion": "/v1/completions"}
    chat = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "user", "content": [{"type": "text"}, PNG_PART]},
        ],
        "tools": [TOOL],
        "reasoning_effort": "low",
    }
    assert openai_needs("/v1/chat/completions", chat) == {
        "completion": "/v1/chat/completions",
        "vision": "messages[1].content[1]",
        "tools": "tools",
        "thinking": "reasoning_effort",
    }
    quiet = {
        "messages": [],
        "tools": [],
        "reasoning_effort": "none",
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert openai_needs("/v1/chat/completions", quiet) == {"completion": "/v1/chat/completions"}
    kwargs = {"chat_template_kwargs": {"enable_thinking": True}}
    assert openai_needs("/v1/chat/completions", kwargs)["thinking"] == "chat_template_kwargs.enable_thinking"
    responses = {
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
        "reasoning": {"effort": "high"},
    }
    assert openai_needs("/v1/responses", responses) == {
        "completion": "/v1/responses",
        "vision": "input[0].content[0]",
        "thinking": "reasoning.effort",
    }
    # Odd values are the field checks' business; here they need nothing and never raise.
    assert openai_needs("/v1/chat/completions", {"messages": "x", "tools": {}, "input": 3}) == {
        "completion": "/v1/chat/completions"
    }


def test_what_an_ollama_request_needs() -> None:
    chat = {
        "messages": [{"role": "user", "content": "hi", "images": ["AAAA"]}],
        "tools": [TOOL],
        "think": True,
    }
    assert ollama_needs("chat", chat) == {
        "completion": "/api/chat",
        "vision": "messages[0].images",
        "tools": "tools",
        "thinking": "think",
    }
    assert ollama_needs("generate", {"prompt": "x", "images": ["AAAA"], "think": "high"}) == {
        "completion": "/api/generate",
        "vision": "images",
        "thinking": "think",
    }
    assert ollama_needs("chat", {"messages": [{"role": "user", "content": "hi"}], "think": False}) == {
        "completion": "/api/chat"
    }
    # Nothing to generate: the request loads or unloads the model, whatever else it says.
    assert ollama_needs("generate", {"prompt": "", "think": True, "keep_alive": 0}) == {}
    assert ollama_needs("chat", {"messages": [], "tools": [TOOL]}) == {}
    assert ollama_needs("embed", {"input": []}) == {"embedding": "/api/embed"}
    assert ollama_needs("embeddings", {"prompt": "x"}) == {"embedding": "/api/embeddings"}


@pytest.mark.parametrize(
    ("needs", "code", "words"),
    [
        (
            {"completion": "/api/chat", "vision": "messages[0].images"},
            "modality_unsupported",
            "does not take images",
        ),
        (
            {"completion": "/v1/chat/completions", "tools": "tools"},
            "tools_unsupported",
            "does not support tools",
        ),
        (
            {"completion": "/api/chat", "thinking": "think"},
            "thinking_unsupported",
            "does not support thinking",
        ),
        ({"embedding": "/v1/embeddings"}, "embedding_unsupported", "does not serve embeddings"),
    ],
)
def test_a_request_needing_what_the_demo_model_lacks_is_a_400(
    demo_info: ModelInfo, needs: dict[str, str], code: str, words: str
) -> None:
    found = capabilities(llama(), demo_info)
    lacking = caps.missing(needs, found)  # type: ignore[arg-type]
    assert lacking is not None
    error = caps.refusal(llama(), lacking, needs[lacking], found)
    assert (error.status, error.code) == (400, code)
    where = needs[lacking]
    assert error.message.startswith(f"{where}: model 'demo' {words}")
    assert "(its capabilities: completion, chat)" in error.message


def test_an_embedding_model_refuses_to_generate() -> None:
    found = capabilities(llama("--embeddings"), gguf("bert", template=""))
    assert caps.missing({"completion": "/v1/chat/completions"}, found) == "completion"
    error = caps.refusal(llama(), "completion", "/v1/chat/completions", found)
    assert error.code == "completion_unsupported"
    assert "does not generate text" in error.message
    # `chat` alone (a manifest that says so) is enough to generate.
    assert caps.missing({"completion": "/api/chat"}, ["chat"]) is None


def test_the_hint_says_how_to_give_the_model_what_it_lacks() -> None:
    assert "--mmproj" in caps.refusal(llama(), "vision", "images", ["completion"]).message
    assert "--embeddings" in caps.refusal(llama(), "embedding", "/api/embed", ["completion"]).message
    assert "set `tool_call_parser`" in caps.refusal(vllm(), "tools", "tools", ["completion"]).message
    declared = llama(capabilities=["completion"])
    assert (
        "list `vision` in its manifest's `capabilities`"
        in caps.refusal(declared, "vision", "images", ["completion"]).message
    )


# --- the cache --------------------------------------------------------------------------------------------


async def test_the_weights_are_read_once_per_manifest(tmp_path: Path) -> None:
    weights = write_demo_model(tmp_path / "demo.gguf")
    cache = CapabilityCache()
    manifest = llama(model=str(weights))
    first = await asyncio.gather(*(cache.of(manifest) for _ in range(10)))
    assert first == [["completion", "chat"]] * 10
    assert await cache.of(llama(model=str(weights))) == ["completion", "chat"]  # an equal manifest
    assert cache.reads == 1
    assert await cache.of(llama("--embeddings", model=str(weights))) == ["completion", "chat", "embedding"]
    assert cache.reads == 2
    assert await cache.of(llama(model=str(weights), capabilities=["embedding"])) == ["embedding"]
    assert cache.reads == 2  # a declared list reads nothing


async def test_the_check_refuses_with_the_cached_list(tmp_path: Path) -> None:
    manifest = llama(model=str(write_demo_model(tmp_path / "demo.gguf")))
    await caps.check(manifest, {"completion": "/api/chat"})
    await caps.check(manifest, {})
    with pytest.raises(SupervisorError) as raised:
        await caps.check(manifest, {"completion": "/api/chat", "tools": "tools"})
    assert raised.value.code == "tools_unsupported"


async def test_weights_that_are_missing_or_not_a_gguf_leave_the_flags(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + b"\xff" * 64)
    cache = CapabilityCache()
    assert await cache.of(llama("--embeddings", model=str(garbage))) == ["completion", "embedding"]
    assert await cache.of(llama(model=str(tmp_path / "gone.gguf"))) == ["completion"]

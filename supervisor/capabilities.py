"""What a model can do: `completion`, `chat`, `embedding`, `rerank`, `vision`, `tools` and `thinking`.

Read from the weights' metadata (GGUF keys, config.json, the chat template) and the engine's flags
(llama-server's --embeddings, --reranking and --mmproj; vLLM's runner and its tool-call and reasoning
parsers, which `vllm_parsers` detects from the model when the manifest names none); a manifest's
`capabilities` list wins over all of it. `/api/show` and the admin document report `capabilities()`;
the inference routes call `check()`, which refuses a request that needs what the model lacks with a 400
before anything loads.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

import structlog

from supervisor import errors
from supervisor.manifests import Capability, LlamaServerManifest, Manifest, VllmManifest, flag_name
from supervisor.model_info import ModelInfo, hf_cache_snapshot, read_weights

log = structlog.get_logger("capabilities")

# The routes of a reranking (Jina's and Cohere's API, as llama-server and vLLM serve it).
RERANK_PATHS: frozenset[str] = frozenset({"/v1/rerank", "/rerank"})
# The order every list of capabilities is reported in.
CAPABILITIES: tuple[Capability, ...] = (
    "completion",
    "chat",
    "embedding",
    "rerank",
    "vision",
    "tools",
    "thinking",
)
# The error code of a request that needs a capability the model lacks.
REFUSAL_CODES: dict[Capability, str] = {
    "completion": "completion_unsupported",
    "chat": "completion_unsupported",
    "embedding": "embedding_unsupported",
    "rerank": "rerank_unsupported",
    "vision": "modality_unsupported",
    "tools": "tools_unsupported",
    "thinking": "thinking_unsupported",
}


def flag_value(args: Sequence[str], *flags: str) -> str | None:
    """The value of the last `--flag value` or `--flag=value` in argv ("" for a bare last flag), or None."""
    found = None
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if flag_name(name) in flags:
            found = value if eq else (args[i + 1] if i + 1 < len(args) else "")
    return found


def _has_flag(args: Sequence[str], *flags: str) -> bool:
    return any(flag_name(arg) in flags for arg in args)


def _ordered(found: set[Capability] | Sequence[Capability]) -> list[Capability]:
    return [c for c in CAPABILITIES if c in found]


# --- the chat template ---------------------------------------------------------------------------------

# A template that renders a thinking part: Qwen3's enable_thinking, DeepSeek-R1's </think>, gpt-oss's and
# Granite 3.2's `thinking`, Kimi's ◁think▷.
_THINKING_TEMPLATE = re.compile(r"</?think>|enable_thinking|reasoning_content|\bthinking\b|think▷")


def _template_capabilities(template: str) -> set[Capability]:
    found: set[Capability] = set()
    if template:
        found.add("chat")
    if "tools" in template:
        found.add("tools")
    if _THINKING_TEMPLATE.search(template):
        found.add("thinking")
    return found


# --- llama-server ----------------------------------------------------------------------------------------

PROJECTOR_FLAGS = ("--mmproj", "-mm", "--mmproj-url", "-mmu", "--mmproj-auto")
_LLAMA_EMBEDDING_FLAGS = ("--embeddings", "--embedding")
_LLAMA_RERANK_FLAGS = ("--reranking", "--rerank")  # --embeddings with --pooling rank
_RANK_POOLING = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK, as a GGUF's `<arch>.pooling_type`
# GGUF architectures of encoder-only (embedding) models: llama-server cannot generate text with them.
_ENCODER_ARCHITECTURES = {
    "bert",
    "modern-bert",
    "nomic-bert",
    "nomic-bert-moe",
    "neo-bert",
    "jina-bert-v2",
    "jina-bert-v3",
    "eurobert",
    "gemma-embedding",
    "t5encoder",
    "llama-embed",
}


def _gguf_is_embedding_model(info: ModelInfo) -> bool:
    """An encoder architecture, non-causal attention, or a pooling type (Qwen3-Embedding's `last`)."""
    meta = info.model_info
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        return False
    pooling = meta.get(f"{arch}.pooling_type")
    return (
        arch in _ENCODER_ARCHITECTURES
        or meta.get(f"{arch}.attention.causal") is False
        or (isinstance(pooling, int) and pooling > 0)
    )


def _pools_by_rank(args: Sequence[str], info: ModelInfo) -> bool:
    """Whether llama-server pools by rank: `--pooling rank`, or no --pooling and the GGUF's own pooling
    type is rank (a reranker's conversion, bge-reranker's)."""
    pooling = flag_value(args, "--pooling")
    if pooling is not None:
        return pooling == "rank"
    arch = info.model_info.get("general.architecture")
    return isinstance(arch, str) and info.model_info.get(f"{arch}.pooling_type") == _RANK_POOLING


def _llama_server_capabilities(manifest: LlamaServerManifest, info: ModelInfo) -> set[Capability]:
    args = manifest.args
    found: set[Capability] = set()
    # llama-server serves /v1/embeddings only when started with --embeddings, and /v1/rerank only when
    # it pools by rank (--reranking), which makes its embeddings scores, not vectors.
    if _has_flag(args, *_LLAMA_RERANK_FLAGS):
        found.add("rerank")
    elif _has_flag(args, *_LLAMA_EMBEDDING_FLAGS):
        found.add("rerank" if _pools_by_rank(args, info) else "embedding")
    if _gguf_is_embedding_model(info):
        return found
    found.add("completion")
    found |= _template_capabilities(info.template)
    if _has_flag(args, "--no-jinja"):
        found.discard("tools")  # llama-server answers tools only through the Jinja template
    if _has_flag(args, *PROJECTOR_FLAGS) and not _has_flag(args, "--no-mmproj"):
        found.add("vision")
    return found


# --- vLLM ------------------------------------------------------------------------------------------------

# vLLM's default runner by architecture suffix (vllm/config/model.py: the first matching suffix decides).
_VLLM_POOLING_BY_SUFFIX = (
    ("ForCausalLM", False),
    ("ForConditionalGeneration", False),
    ("ChatModel", False),
    ("LMHeadModel", False),
    ("ForTextEncoding", True),
    ("EmbeddingModel", True),
    ("ForSequenceClassification", True),
    ("ForTokenClassification", True),
    ("ClassificationModel", True),
    ("ForRewardModeling", True),
    ("RewardModel", True),
    ("Model", True),  # BertModel, XLMRobertaModel, MistralModel (e5-mistral)
)
# Sentence-transformers models on a causal architecture (Qwen3-Embedding, gte-Qwen2) that vLLM runs as
# poolers because of their modules.json, which the weights' metadata does not show: known by their names.
_EMBEDDING_NAME = re.compile(r"embed|rerank|(^|[/_-])(bge|gte|e5)-")
_POOLING_TASKS = {"embed", "embedding", "classify", "score", "reward"}
# Architectures of models that take images, for configs whose vision_config names no model_type.
_VISION_ARCHITECTURE = re.compile(
    r"VL|Vision|Llava|LLaVA|Pixtral|Idefics|PaliGemma|Mllama|MiniCPMV|Molmo|InternVL|Phi3V|Phi4MM|Aria|Blip"
    r"|Chameleon|Fuyu|Ovis|Glm4v|NVLM|Florence|Gemma3ForConditional|Gemma3n|Mistral3ForConditional"
    r"|Llama4ForConditional|Omni"
)


def model_id(manifest: VllmManifest) -> str:
    """The model's name as detection reads it, lower-case: a Hub repo id as it is; of a local directory
    its last two parts (`org/name`), or the repo a Hugging Face cache snapshot belongs to."""
    if manifest.local_weights() is None:
        return manifest.model.lower()
    parts = PurePath(manifest.model).parts
    if len(parts) >= 3 and parts[-2] == "snapshots":  # .../models--org--name/snapshots/<revision>
        parts = parts[:-2]
    return "/".join(parts[-2:]).lower()


def vllm_is_pooling(manifest: VllmManifest, architectures: Sequence[str]) -> bool:
    """Whether vLLM serves the model as a pooler (embeddings, scores), not as a generator."""
    runner = flag_value(manifest.args, "--runner")
    if runner in ("pooling", "generate"):
        return runner == "pooling"
    if flag_value(manifest.args, "--convert") not in (None, "auto", "none"):
        return True
    task = flag_value(manifest.args, "--task")
    if task is not None and task != "auto":
        return task in _POOLING_TASKS
    if _EMBEDDING_NAME.search(model_id(manifest)):
        return True
    for arch in architectures:
        for suffix, pooling in _VLLM_POOLING_BY_SUFFIX:
            if arch.endswith(suffix):
                return pooling
    return False


@dataclass(frozen=True)
class ParserRule:
    """A model matches when its id or path matches `name`, or one of its architectures is listed, unless
    its id matches `unless`."""

    parser: str
    name: str | None = None
    architectures: frozenset[str] = frozenset()
    unless: str | None = None

    def matches(self, model: str, architectures: Sequence[str]) -> bool:
        if self.unless is not None and re.search(self.unless, model):
            return False
        by_name = self.name is not None and re.search(self.name, model) is not None
        return by_name or not self.architectures.isdisjoint(architectures)


# vLLM's --tool-call-parser for a model (names as vLLM 0.32 registers them); the first match wins, so a
# fine-tune's name (Hermes on Llama, Kimi on DeepSeek-V3) comes before its base architecture.
TOOL_PARSERS: tuple[ParserRule, ...] = (
    ParserRule("hermes", r"hermes"),
    ParserRule("openai", r"gpt-oss", frozenset({"GptOssForCausalLM"})),
    ParserRule("kimi_k2", r"kimi-k2"),
    ParserRule("deepseek_v31", r"deepseek-v3\.1"),
    ParserRule("deepseek_v32", r"deepseek-v3\.2"),
    ParserRule("deepseek_v3", r"deepseek-(v3|r1)", frozenset({"DeepseekV3ForCausalLM"}), unless=r"distill"),
    ParserRule("glm47", r"glm-4\.7"),
    ParserRule("glm45", r"glm-4\.[56]", frozenset({"Glm4MoeForCausalLM"})),
    ParserRule("qwen3_coder", r"qwen3-coder"),
    ParserRule(
        "hermes",
        r"qwen2\.5|qwen3|qwq",
        frozenset({"Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}),
    ),
    ParserRule(
        "mistral",
        r"mistral|mixtral|ministral|devstral|magistral|codestral",
        frozenset({"MistralForCausalLM", "MixtralForCausalLM", "Mistral3ForConditionalGeneration"}),
    ),
    ParserRule("llama4_json", r"llama-?4(?!\d)", frozenset({"Llama4ForConditionalGeneration"})),
    ParserRule("llama3_json", r"llama-?3(?!\d)"),
    ParserRule("granite-20b-fc", r"granite-20b-functioncalling"),
    ParserRule("granite", r"granite", frozenset({"GraniteForCausalLM", "GraniteMoeForCausalLM"})),
    ParserRule("internlm", r"internlm", frozenset({"InternLM2ForCausalLM", "InternLM3ForCausalLM"})),
    ParserRule("phi4_mini_json", r"phi-4-mini"),
)
# vLLM's --reasoning-parser for a model that thinks.
REASONING_PARSERS: tuple[ParserRule, ...] = (
    ParserRule("openai_gptoss", r"gpt-oss", frozenset({"GptOssForCausalLM"})),
    ParserRule("kimi_k2", r"kimi-k2-thinking"),
    ParserRule("deepseek_r1", r"deepseek-r1|qwq"),
    ParserRule("deepseek_v3", r"deepseek-v3\.[12]"),
    ParserRule("glm47", r"glm-4\.7"),
    ParserRule("glm45", r"glm-4\.[56]", frozenset({"Glm4MoeForCausalLM"})),
    # Qwen3's hybrid models think; its Instruct-2507, VL-Instruct and Coder models do not.
    ParserRule(
        "qwen3", r"qwen3", frozenset({"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}), unless=r"instruct|coder"
    ),
    ParserRule("granite", r"granite-3\.[23]"),
)
NO_PARSER = "none"


@dataclass(frozen=True)
class VllmParsers:
    tool: str | None
    reasoning: str | None


def _parser(
    given: str | None, rules: Sequence[ParserRule], model: str, architectures: Sequence[str], detect: bool
) -> str | None:
    if given is not None:
        return None if given == NO_PARSER else given
    if not detect:
        return None
    return next((rule.parser for rule in rules if rule.matches(model, architectures)), None)


def vllm_parsers(manifest: VllmManifest, architectures: Sequence[str]) -> VllmParsers:
    """The tool-call and reasoning parsers vLLM runs the model with: the manifest's, else detected from the
    model's id or path and its config.json architectures; None for none."""
    model = model_id(manifest)
    detect = not vllm_is_pooling(manifest, architectures)  # a pooler generates nothing to parse
    return VllmParsers(
        tool=_parser(manifest.tool_call_parser, TOOL_PARSERS, model, architectures, detect),
        reasoning=_parser(manifest.reasoning_parser, REASONING_PARSERS, model, architectures, detect),
    )


def _architectures(info: ModelInfo) -> tuple[str, ...]:
    found = info.model_info.get("general.architectures")
    return tuple(a for a in found if isinstance(a, str)) if isinstance(found, list) else ()


def _vllm_scores_only(manifest: VllmManifest, architectures: Sequence[str]) -> bool:
    """Whether a vLLM pooler is a cross-encoder (a classifier: it scores pairs, embeds nothing)."""
    task = flag_value(manifest.args, "--task")
    if task is not None and task != "auto":
        return task in ("classify", "score")
    convert = flag_value(manifest.args, "--convert")
    if convert not in (None, "auto", "none"):
        return convert == "classify"
    classifier = any(a.endswith("ForSequenceClassification") for a in architectures)
    return classifier or "rerank" in model_id(manifest)


def _vllm_capabilities(manifest: VllmManifest, info: ModelInfo) -> set[Capability]:
    architectures = _architectures(info)
    if vllm_is_pooling(manifest, architectures):
        # vLLM reranks with a cross-encoder, and with an embedding model by cosine similarity.
        return {"rerank"} if _vllm_scores_only(manifest, architectures) else {"embedding", "rerank"}
    found: set[Capability] = {"completion"}
    if info.template:
        found.add("chat")
    parsers = vllm_parsers(manifest, architectures)
    if parsers.tool is not None:
        found.add("tools")  # vLLM answers `tools` only with --enable-auto-tool-choice and a parser
    if parsers.reasoning is not None:
        found.add("thinking")
    if len(info.families) > 1 or any(_VISION_ARCHITECTURE.search(a) for a in architectures):
        found.add("vision")  # a vision_config beside the language model's
    return found


# --- the list --------------------------------------------------------------------------------------------


def capabilities(manifest: Manifest, info: ModelInfo) -> list[Capability]:
    """What the model can do: the manifest's `capabilities` when given, else what its weights' metadata
    (`info`) and its engine flags say; in the order of CAPABILITIES."""
    if manifest.capabilities is not None:
        return _ordered(manifest.capabilities)
    if isinstance(manifest, LlamaServerManifest):
        return _ordered(_llama_server_capabilities(manifest, info))
    return _ordered(_vllm_capabilities(manifest, info))


def _read_info(manifest: Manifest) -> ModelInfo:
    """The weights' metadata without their digest (blocking: call in a thread); empty when they are not
    here or not readable, which leaves what the flags say."""
    try:
        weights = manifest.local_weights()
        if weights is None and isinstance(manifest, VllmManifest):
            weights = hf_cache_snapshot(manifest.model)
        if weights is None or not weights.exists():
            return ModelInfo()
        return read_weights(weights)
    except Exception as exc:  # gguf and json meet arbitrary bytes and have no single error type
        log.warning("capabilities_unreadable", model=manifest.name, error=str(exc))
        return ModelInfo(error=str(exc))


class CapabilityCache:
    """Capabilities by manifest: the weights are read once per manifest version, in a thread, however
    many requests ask at once; later requests do no I/O. Weights replaced under an unchanged manifest
    are read again after a restart (or once the manifest changes)."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[Manifest, list[Capability]]] = {}
        self._reading: dict[str, tuple[Manifest, asyncio.Future[list[Capability]]]] = {}
        self.reads = 0  # weights read (cache misses), for tests

    def known(self, manifest: Manifest) -> list[Capability] | None:
        """What is known of the manifest's model without reading it: its declared capabilities, or those
        read before for this very manifest (a request's usual case, answered without an await)."""
        if manifest.capabilities is not None:
            return _ordered(manifest.capabilities)
        known = self._known.get(manifest.name)
        if known is not None and (known[0] is manifest or known[0] == manifest):
            return known[1]
        return None

    async def of(self, manifest: Manifest) -> list[Capability]:
        known = self.known(manifest)
        return known if known is not None else await self.shared_read(manifest)

    async def shared_read(self, manifest: Manifest) -> list[Capability]:
        """Read the model's capabilities: one read per manifest, however many requests wait on it."""
        reading = self._reading.get(manifest.name)
        if reading is None or not (reading[0] is manifest or reading[0] == manifest):
            future = asyncio.ensure_future(self._read(manifest))
            self._reading[manifest.name] = (manifest, future)
            future.add_done_callback(lambda done: self._read_done(manifest.name, done))
            reading = (manifest, future)
        # Shielded: a client that goes away must not cancel the read the others wait on.
        return await asyncio.shield(reading[1])

    async def _read(self, manifest: Manifest) -> list[Capability]:
        self.reads += 1
        info = await asyncio.to_thread(_read_info, manifest)
        found = capabilities(manifest, info)
        self._known[manifest.name] = (manifest, found)
        return found

    def _read_done(self, name: str, done: asyncio.Future[list[Capability]]) -> None:
        if self._reading.get(name, (None, None))[1] is done:
            del self._reading[name]


_cache = CapabilityCache()


async def capabilities_of(manifest: Manifest) -> list[Capability]:
    """`capabilities()` of the manifest's model, cached per manifest (see CapabilityCache)."""
    return await _cache.of(manifest)


# --- what a request needs --------------------------------------------------------------------------------

# Capability -> where in the request it is needed (a route or a field), for the refusal's message.
Needs = dict[Capability, str]


def _first_image_part(items: object, container: str) -> str | None:
    """Where the first image part of a list of messages (or Responses API input items) is, or None."""
    for i, item in enumerate(items if isinstance(items, list) else ()):
        content = item.get("content") if isinstance(item, dict) else None
        if isinstance(item, dict) and item.get("type") == "input_image":
            return f"{container}[{i}]"
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") in ("image_url", "input_image"):
                return f"{container}[{i}].content[{j}]"
    return None


def _non_empty_list(value: object) -> bool:
    return isinstance(value, list) and len(value) > 0


def _first_multimodal_prompt(payload: dict[str, Any]) -> str | None:
    """Where the first llama-server multimodal prompt item (`{"prompt_string", "multimodal_data"}`) is."""
    for field in ("prompt", "input"):
        prompts = payload.get(field)
        for i, prompt in enumerate(prompts if isinstance(prompts, list) else ()):
            if isinstance(prompt, dict) and "multimodal_data" in prompt:
                return f"{field}[{i}].multimodal_data"
    return None


def openai_needs(path: str, payload: dict[str, Any]) -> Needs:
    """What an OpenAI request to `path` needs of its model. A dict (a parsed body), not any Mapping:
    compiled, each `get` is then a dict lookup, not a method call."""
    multimodal = _first_multimodal_prompt(payload)
    if path == "/v1/embeddings":
        return {"embedding": path} if multimodal is None else {"embedding": path, "vision": multimodal}
    if path in RERANK_PATHS:
        return {"rerank": path}
    needs: Needs = {"completion": path}
    image = (
        _first_image_part(payload.get("messages"), "messages")
        or _first_image_part(payload.get("input"), "input")
        or multimodal
    )
    if image is not None:
        needs["vision"] = image
    for field in ("tools", "functions"):
        if _non_empty_list(payload.get(field)):
            needs["tools"] = field
            break
    effort = payload.get("reasoning_effort")
    reasoning = payload.get("reasoning")
    kwargs = payload.get("chat_template_kwargs")
    if isinstance(effort, str) and effort != "none":
        needs["thinking"] = "reasoning_effort"
    elif isinstance(reasoning, dict) and reasoning.get("effort") not in (None, "none"):
        needs["thinking"] = "reasoning.effort"
    elif isinstance(kwargs, dict):
        for name in ("enable_thinking", "thinking"):
            if kwargs.get(name) is True:
                needs["thinking"] = f"chat_template_kwargs.{name}"
                break
    return needs


def ollama_needs(route: str, payload: Mapping[str, Any]) -> Needs:
    """What an Ollama request (`route`: chat, generate, embed or embeddings) needs of its model. One with
    nothing to generate (no messages, no prompt) only loads or unloads the model, and needs nothing."""
    if route in ("embed", "embeddings"):
        return {"embedding": f"/api/{route}"}
    needs: Needs = {}
    if route == "chat" and payload.get("messages"):
        needs["completion"] = "/api/chat"
        messages = payload["messages"]
        for i, message in enumerate(messages if isinstance(messages, list) else ()):
            if isinstance(message, dict) and _non_empty_list(message.get("images")):
                needs["vision"] = f"messages[{i}].images"
                break
        if _non_empty_list(payload.get("tools")):
            needs["tools"] = "tools"
    elif route == "generate" and (payload.get("prompt") or payload.get("images")):
        needs["completion"] = "/api/generate"
        if _non_empty_list(payload.get("images")):
            needs["vision"] = "images"
    if needs and payload.get("think") not in (None, False):
        needs["thinking"] = "think"
    return needs


# --- the check -------------------------------------------------------------------------------------------


def _hint(manifest: Manifest, capability: Capability) -> str:
    """How an operator gives the model the capability, when it has it."""
    declare = f"; if it can, list `{capability}` in its manifest's `capabilities`"
    if manifest.capabilities is not None:
        return declare
    if isinstance(manifest, LlamaServerManifest):
        if capability == "vision":
            return ": its llama-server has no --mmproj (a vision projector); add one to the manifest's args"
        if capability == "embedding":
            return ": its llama-server runs without --embeddings; add it to the manifest's args"
        if capability == "rerank":
            return ": its llama-server runs without --reranking; add it to the manifest's args"
        if capability in ("tools", "thinking"):
            return f": its chat template has no {capability}" + declare
    if isinstance(manifest, VllmManifest) and capability in ("tools", "thinking"):
        field = "tool_call_parser" if capability == "tools" else "reasoning_parser"
        return f": vLLM runs it without a {field.replace('_', ' ')}; set `{field}` in its manifest"
    return declare


_WHAT = {
    "embedding": "does not serve embeddings",
    "rerank": "does not rerank",
    "vision": "does not take images",
    "tools": "does not support tools",
    "thinking": "does not support thinking",
}


def refusal(
    manifest: Manifest, capability: Capability, where: str, found: Sequence[Capability]
) -> errors.SupervisorError:
    """The 400 for a request that needs `capability` (at `where`) of a model that has only `found`."""
    has = ", ".join(found) or "none"
    if capability in ("completion", "chat"):
        reranks_only = "rerank" in found and "embedding" not in found
        instead = "/v1/rerank" if reranks_only else "/v1/embeddings or /api/embed"
        message = (
            f"{where}: model '{manifest.name}' does not generate text (its capabilities: {has}); "
            f"send it to {instead}"
        )
    else:
        message = (
            f"{where}: model '{manifest.name}' {_WHAT[capability]} (its capabilities: {has})"
            f"{_hint(manifest, capability)}"
        )
    return errors.capability_unsupported(REFUSAL_CODES[capability], message)


def missing(needs: Mapping[Capability, str], found: Sequence[Capability]) -> Capability | None:
    """The first capability `needs` names that `found` lacks; text generation is `completion` or `chat`."""
    for capability in needs:
        if capability in ("completion", "chat"):
            if "completion" not in found and "chat" not in found:
                return capability
        elif capability not in found:
            return capability
    return None


async def check(manifest: Manifest, needs: Mapping[Capability, str]) -> None:
    """Raise the 400 (`modality_unsupported`, `tools_unsupported`, `thinking_unsupported`,
    `embedding_unsupported`, `completion_unsupported`) for a request that needs what the model lacks."""
    if not needs:
        return
    found = _cache.known(manifest)
    if found is None:
        found = await _cache.shared_read(manifest)
    lacking = missing(needs, found)
    if lacking is not None:
        raise refusal(manifest, lacking, needs[lacking], found)

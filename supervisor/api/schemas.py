"""The request and response bodies of every route, as pydantic models: the source of /openapi.json.

Inference bodies are passed to an engine, which reads many more fields than are named here, so their
models allow extra fields; the fields they name have the types the daemon checks before an engine sees
them (supervisor/bodies.py for OpenAI, supervisor/ollama_translate.py for Ollama; a unit test keeps the
two in step). Admin action bodies forbid unknown fields. Response models describe what the daemon
itself writes; where an engine writes the answer, only the part every engine sends is named.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from supervisor.api.admin_bodies import LoadRequest as LoadRequest  # re-exported: the document names them
from supervisor.api.admin_bodies import PinRequest as PinRequest
from supervisor.api.admin_bodies import UnloadRequest as UnloadRequest
from supervisor.api.admin_bodies import UnpinRequest as UnpinRequest
from supervisor.bodies import INT32_MAX, MAX_LOGPROBS, SEED_RANGE

# --- building blocks ---------------------------------------------------------------------------------

T = TypeVar("T")


def _not_null(value: T) -> T:
    if value is None:  # only an explicit null gets here: a default is not validated
        raise ValueError("must not be null; leave the field out instead")
    return value


def _no_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


# A field a client may leave out but not send as null: engines fail on a null there.
Omittable = Annotated[
    T | SkipJsonSchema[None], AfterValidator(_not_null), Field(json_schema_extra=_no_default)
]

Count = Annotated[int, Field(ge=-1, le=INT32_MAX, description="-1: no limit")]


def _not_zero(value: int) -> int:
    if value == 0:
        raise ValueError("must be at least 1 (or -1: no limit), not 0")
    return value


# A limit on the tokens to generate: 0 is refused, as OpenAI and vLLM refuse it.
OutputCount = Annotated[
    int,
    Field(ge=-1, le=INT32_MAX, description="-1: no limit", json_schema_extra={"not": {"const": 0}}),
    AfterValidator(_not_zero),
]
NonNegative = Annotated[int, Field(ge=0, le=INT32_MAX)]
# As OpenAI and vLLM (its max_logprobs): llama-server would list its whole vocabulary per token.
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
Seed = Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])]
ModelName = Annotated[str, Field(min_length=1, description="a model's name or alias")]
KeepAlive = Annotated[
    float | str,
    Field(
        description='seconds, or a duration like "5m"; 0 unloads after the answer, negative keeps it forever'
    ),
]
Dimensions = Annotated[int, Field(ge=1, le=65536)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX, description="written as an integer: 7, not 7.0")]
SlotStateName = Literal["unloaded", "loading", "ready", "draining", "stopping", "failed"]


class _Passthrough(BaseModel):
    """A body an engine reads: fields not named here pass through untouched."""

    model_config = ConfigDict(extra="allow", defer_build=True)


class _Answer(BaseModel):
    """A document the daemon writes; a later version may add fields."""

    model_config = ConfigDict(extra="allow", defer_build=True)


class SchedulingFields(_Passthrough):
    """Fields of ours that any inference request may carry; removed before the engine sees the body."""

    keep_alive: KeepAlive | None = None
    x_priority: int | None = Field(
        default=None, description="orders queues; capped to the key's max_priority"
    )
    x_client_id: str | None = Field(default=None, max_length=200, description="who is asking, for logs")


# --- OpenAI requests ---------------------------------------------------------------------------------


class StreamOptions(_Passthrough):
    include_usage: bool | None = None


class TextPart(_Passthrough):
    type: Literal["text"]
    text: str


def _not_text(kind: str) -> str:
    if kind == "text":
        raise ValueError("a text part needs its `text`")
    return kind


class OtherPart(_Passthrough):
    """A part that is not text: `image_url` (for a model with a vision projector), `input_audio`, ..."""

    type: Annotated[str, AfterValidator(_not_text), Field(json_schema_extra={"not": {"const": "text"}})]


ContentPart = TextPart | OtherPart


class FunctionCall(_Passthrough):
    name: str
    arguments: str | dict[str, Any] = Field(description="a JSON string (OpenAI), or an object")


class ToolCall(_Passthrough):
    """A call an assistant message made."""

    type: Literal["function"]
    function: FunctionCall
    id: Omittable[str] = None


class FunctionDefinition(_Passthrough):
    """A function a model may call: its `name`, and the `description` and `parameters` (a JSON schema)
    the engine reads."""

    name: str


class Tool(_Passthrough):
    type: Literal["function"]
    function: FunctionDefinition


class ChatMessage(_Passthrough):
    role: str
    content: str | list[ContentPart] | None = None
    name: Omittable[str] = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Omittable[str] = None
    reasoning_content: Omittable[str] = None


class _Sampling(SchedulingFields):
    """The fields /v1/chat/completions and /v1/completions share."""

    model: ModelName
    user: str | None = Field(default=None, description="a session: requests of one user share a replica")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repeat_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    max_tokens: OutputCount | None = None
    top_k: Count | None = None
    repeat_last_n: Count | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    n_probs: Logprobs | None = Field(default=None, description="llama-server's own name for top_logprobs")


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: OutputCount | None = None
    logprobs: bool | None = None
    top_logprobs: Logprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_format: Omittable[str] = None  # llama-server's: how `reasoning_content` is split out


class PromptObject(_Passthrough):
    """llama-server's multimodal prompt."""

    prompt_string: str
    multimodal_data: list[str] | None = Field(default=None, description="base64 media, one per marker")


# A prompt or an embeddings input: a string; or one prompt of text and token ids mixed; or several
# prompts, each a string, a list of token ids or a multimodal prompt object.
TokensOrTexts = (
    str
    | Annotated[list[str | TokenId], Field(min_length=1)]
    | Annotated[list[str | list[TokenId] | PromptObject], Field(min_length=1)]
)


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: TokensOrTexts
    logprobs: Logprobs | None = None
    echo: bool | None = None
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None
    suffix: str | None = None


class EmbeddingRequest(SchedulingFields):
    """POST /v1/embeddings."""

    model: ModelName
    user: str | None = None
    input: TokensOrTexts
    dimensions: Dimensions | None = None
    encoding_format: Omittable[str] = None


class RerankRequest(SchedulingFields):
    """POST /v1/rerank (or /rerank): Jina's and Cohere's reranking API, as llama-server (`--reranking`) and
    vLLM (a cross-encoder or an embedding model) serve it."""

    model: ModelName
    query: str
    documents: Annotated[list[str | dict[str, Any]], Field(min_length=1)] = Field(
        description="the texts to rank (llama-server takes strings only; vLLM multimodal objects too)"
    )
    top_n: NonNegative | None = Field(default=None, description="the best this many (default: all)")
    return_documents: bool | None = None


class ResponsesRequest(SchedulingFields):
    """POST /v1/responses: OpenAI's Responses API, for engines that serve it."""

    model: ModelName


# --- Ollama requests ---------------------------------------------------------------------------------

Int32 = Annotated[int, Field(ge=-(2**31), le=INT32_MAX)]
NumPredict = Annotated[int, Field(ge=-2, le=INT32_MAX, description="-1: no limit, -2: fill the context")]


class OllamaOptions(_Passthrough):
    """Ollama's `options`; unknown ones are ignored, as Ollama does. num_ctx above what the model serves
    is a 400 (options never restart a model); num_gpu, num_thread and the like are checked, then ignored."""

    seed: Seed | None = None
    top_k: Count | None = None
    num_predict: NumPredict | None = None
    num_ctx: NonNegative | None = None
    repeat_last_n: Count | None = None
    mirostat: Annotated[int, Field(ge=0, le=2)] | None = None
    num_keep: Int32 | None = None
    num_batch: Int32 | None = None
    num_gpu: Int32 | None = None
    main_gpu: Int32 | None = None
    num_thread: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    tfs_z: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    numa: bool | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    logits_all: bool | None = None
    penalize_newline: bool | None = None
    stop: str | list[str] | None = None


Image = Annotated[str, Field(description="base64 PNG, JPEG, GIF, WebP or BMP")]
Format = Literal["json", ""] | dict[str, Any]
Think = bool | Literal["low", "medium", "high"]


class OllamaFunctionCall(_Passthrough):
    name: str
    arguments: dict[str, Any] | str | None = None


class OllamaToolCall(_Passthrough):
    function: OllamaFunctionCall
    id: str | None = None


class OllamaMessage(_Passthrough):
    role: str
    content: str | None = None
    images: list[Image] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    thinking: str | None = None
    tool_name: str | None = None
    name: str | None = None
    tool_call_id: str | None = None


class OllamaFunction(_Passthrough):
    name: str


class OllamaTool(_Passthrough):
    type: Literal["function"] | None = None
    function: OllamaFunction


class _OllamaRequest(SchedulingFields):
    model: ModelName
    options: OllamaOptions | None = None
    stream: bool | None = Field(default=None, description="default true: NDJSON lines")


class OllamaChatRequest(_OllamaRequest):
    """POST /api/chat; without messages it loads the model (or unloads it with keep_alive 0)."""

    messages: list[OllamaMessage] | None = None
    tools: list[OllamaTool] | None = None
    format: Format | None = None
    think: Think | None = None


class OllamaGenerateRequest(_OllamaRequest):
    """POST /api/generate; without a prompt it loads the model (or unloads it with keep_alive 0).
    A custom `template`, a `suffix` and `context` are refused (400)."""

    prompt: str | None = None
    system: str | None = None
    template: str | None = None
    suffix: str | None = None
    raw: bool | None = None
    context: list[int] | None = None
    images: list[Image] | None = None
    format: Format | None = None
    think: Think | None = None


class OllamaEmbedRequest(_OllamaRequest):
    """POST /api/embed."""

    input: str | list[str] | None = None
    truncate: bool | None = None
    dimensions: Dimensions | None = None


class OllamaEmbeddingsRequest(_OllamaRequest):
    """POST /api/embeddings (Ollama's legacy route)."""

    prompt: str | None = None


class ModelRequest(_Passthrough):
    """POST /api/show and DELETE /api/delete: the model named by `model` (`name` in older clients)."""

    model: ModelName
    name: str | None = Field(default=None, description="older clients' spelling of model")
    verbose: bool | None = None


class PullRequest(_Passthrough):
    """POST /api/pull: `hf.co/org/repo[:quant]`, `org/repo[:quant]`."""

    model: ModelName
    name: str | None = Field(default=None, description="older clients' spelling of model")
    stream: bool | None = Field(default=None, description="default true: NDJSON progress lines")


# --- admin requests: supervisor/api/admin_bodies.py (the admin routes validate with them) ----------


# --- errors ------------------------------------------------------------------------------------------


class OpenAIErrorDetail(_Answer):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = Field(
        description="ours: a stable code such as model_not_found; an engine's own error may carry its status"
    )


class OpenAIError(BaseModel):
    """The error body of every route outside /api/."""

    error: OpenAIErrorDetail


class OllamaError(BaseModel):
    """The error body of every /api/ route (Ollama's shape)."""

    error: str


# --- OpenAI answers (written by the engine) ----------------------------------------------------------


class ChatCompletion(_Answer):
    """The engine's answer to /v1/chat/completions or /v1/completions without `stream`."""

    object: str | None = None
    model: str | None = None
    choices: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class Embeddings(_Answer):
    """The engine's answer to /v1/embeddings."""

    data: list[dict[str, Any]]
    model: str | None = None
    usage: dict[str, Any] | None = None


class Reranking(_Answer):
    """The engine's answer to /v1/rerank: each document's index and score, best first."""

    results: list[dict[str, Any]]
    model: str | None = None
    usage: dict[str, Any] | None = None


class EngineAnswer(_Answer):
    """Whatever the engine answered (/v1/responses)."""


class ModelEntry(_Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    state: SlotStateName
    engine: str
    aliases: list[str]
    alias_of: str | None = Field(default=None, description="set on an alias's entry")
    loaded: bool | None = None


class ModelList(_Answer):
    """GET /v1/models: every model and alias the caller may use."""

    object: Literal["list"]
    data: list[ModelEntry]


# --- health ------------------------------------------------------------------------------------------


class LastError(_Answer):
    reason: str
    exit_code: int | None
    stderr_tail: list[str]
    at: float | None = None


class SlotSummary(_Answer):
    state: SlotStateName
    inflight: int
    queued: int | None = None
    pid: int | None = None
    port: int | None = None  # where its child listens: a loopback port,
    socket: str | None = None  # or a Unix socket
    idle_s: float | None = None
    last_error: LastError | None = None


class GpuLeases(_Answer):
    gpu: int
    capacity_mib: int
    leased_mib: int
    leaked_mib: int
    free_mib: int
    leases: dict[str, int] = Field(description="MiB by lease holder")


class Health(_Answer):
    """GET /health: 200 while serving, 503 while draining for shutdown. With keys configured, a caller
    without an admin key gets `status` alone."""

    status: Literal["ok", "draining"]
    models: dict[str, SlotSummary] | None = Field(default=None, description="absent without an admin key")
    gpus: list[GpuLeases] | None = Field(default=None, description="absent without an admin key")
    queued: int | None = Field(default=None, description="absent without an admin key")


class Liveness(_Answer):
    status: Literal["alive"]


class Readiness(_Answer):
    """200 `ready`; 503 `starting` (with the pinned models still loading) or `draining`."""

    status: Literal["ready", "starting", "draining"]
    waiting_for: list[str] | None = None


# --- admin answers -----------------------------------------------------------------------------------


class GpuLease(_Answer):
    model: str
    holder: str
    mib: int
    state: str
    pid: int | None
    measured_mib: int | None = None
    method: str | None = None


class GpuProcess(_Answer):
    pid: int
    used_mib: int
    model: str | None


class GpuMemoryEntry(_Answer):
    index: int
    name: str | None = None
    uuid: str | None = None
    simulated: bool
    total_mib: int
    margin_mib: int
    leased_mib: int
    leaked_mib: int
    leasable_mib: int
    used_mib: int | None
    free_mib: int | None
    leases: list[GpuLease]
    foreign_mib: int | None = None
    processes: list[GpuProcess] | None = None
    nvml_error: str | None = None


class GpuMemory(_Answer):
    """GET /v1/admin/gpu-memory."""

    source: str
    gpus: list[GpuMemoryEntry]
    assumed: bool | None = Field(default=None, description="true: neither NVML nor a `gpus` declaration")
    warning: str | None = Field(default=None, description="what to do about an assumed GPU")


class FleetGpu(_Answer):
    index: int
    capacity_mib: int
    leased_mib: int
    used_mib: int
    free_mib: int
    shared: bool


class FleetModel(_Answer):
    state: str
    replicas: int
    inflight: int
    queued: int
    max_inflight: int
    keep_alive_expires_at: float | None = None
    priority: int
    pinned: bool
    evictable: bool
    leases: dict[str, int]


class FleetNode(_Answer):
    node_id: str
    url: str
    healthy: bool
    last_seen: float
    version: str | None = None
    weights_on_disk: list[str] | None = None
    gpus: list[FleetGpu]
    models: dict[str, FleetModel]


class FleetNodes(_Answer):
    """GET /v1/admin/nodes."""

    nodes: list[FleetNode]
    fleet: bool  # false: no redis_url, this node alone
    degraded: bool  # Redis cannot be reached now: this node alone, serving as a single host


class Replica(_Answer):
    """One replica of the model: its own child and lease (`pid`, `gpus` and `vram_mib` are null
    while it has no child)."""

    id: str
    state: str
    pid: int | None = None
    gpus: list[int] | None = None
    vram_mib: int | None = None
    inflight: int | None = None
    since: float | None = None


class VramEstimate(_Answer):
    mib: int | None
    source: Literal["declared", "observed", "weights", "unavailable"]
    detail: str | None = None


class ModelDocument(_Answer):
    """One model as operators see it (GET /v1/admin/models/{name}, and the answer of every action)."""

    name: str
    engine: str
    aliases: list[str]
    source: Literal["manifest", "store"]
    state: SlotStateName
    load_pending: bool = Field(
        default=False, description="a load is under way (waiting for room it has no lease, state unloaded)"
    )
    replicas: list[Replica] | None = None
    inflight: int
    queue_depth: int
    last_error: LastError | None
    keep_alive: float | None = Field(description="seconds; null: forever")
    expires_at: float | None = Field(description="epoch seconds; null: not loaded, or never")
    pinned: bool
    pin_source: str | None = None
    priority: int
    vram_estimate: VramEstimate
    capabilities: list[str] | None = None
    load_constraints: dict[str, Any] | None = Field(
        default=None, description="the JSON schema of the overrides this engine accepts"
    )
    load_override: dict[str, Any] | None = None
    definition: dict[str, Any] = Field(description="the manifest, secrets shown as ***")


class ModelDocuments(_Answer):
    """GET /v1/admin/models."""

    models: list[ModelDocument]


class ChildLog(_Answer):
    """GET /v1/admin/models/{name}/logs without follow."""

    model: str
    pid: int | None = Field(description="the child's pid: the running one's, or the one that stopped last")
    running: bool = Field(description="false once the child has stopped: its last lines stay until the next")
    exit_code: int | None = Field(description="how the stopped child exited (negative: the signal)")
    lines: list[str]


# --- Ollama answers ----------------------------------------------------------------------------------


class ModelDetails(_Answer):
    parent_model: str
    format: str
    family: str
    families: list[str] | None
    parameter_size: str
    quantization_level: str


class OllamaMessageOut(_Answer):
    role: str
    content: str
    thinking: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class _Durations(_Answer):
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class OllamaChatAnswer(_Durations):
    """One /api/chat line (a stream sends many; the last has done true), or the whole answer."""

    model: str
    created_at: str
    message: OllamaMessageOut
    done: bool
    done_reason: str | None = Field(default=None, description="stop, length, load or unload")


class OllamaGenerateAnswer(_Durations):
    """One /api/generate line, or the whole answer."""

    model: str
    created_at: str
    response: str
    thinking: str | None = None
    done: bool
    done_reason: str | None = None


class OllamaEmbedAnswer(_Durations):
    model: str
    embeddings: list[list[float]]


class OllamaEmbeddingAnswer(_Answer):
    embedding: list[float]


class TagEntry(_Answer):
    name: str
    model: str
    modified_at: str | None
    size: int
    digest: str
    details: ModelDetails
    loaded: bool
    engine: str
    aliases: list[str]


class Tags(_Answer):
    """GET /api/tags: every model the daemon can serve."""

    models: list[TagEntry]


class RunningEntry(_Answer):
    name: str
    model: str
    size: int
    digest: str
    details: ModelDetails
    expires_at: str | None
    size_vram: int
    context_length: int | None
    gpus: list[int]
    state: SlotStateName
    inflight: int
    engine: str
    replicas: int | list[Any] | None = None


class Running(_Answer):
    """GET /api/ps: the models with a child."""

    models: list[RunningEntry]


class ModelCard(_Answer):
    """POST /api/show."""

    license: str
    modelfile: str
    parameters: str
    template: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str | None
    engine: str
    aliases: list[str]


class Version(_Answer):
    """GET /api/version: the Ollama API level followed, and the daemon's own version."""

    version: str
    llm_supervisor: str


class PullProgress(_Answer):
    """One line of a pull's progress (Ollama's), or how it ended; a failure after the start ends the
    stream with `error`."""

    status: str | None = None
    digest: str | None = None
    total: int | None = None
    completed: int | None = None
    error: str | None = None


class PullCancelled(_Answer):
    status: Literal["cancelled", "cancelling"]
    model: str


class Done(_Answer):
    status: Literal["success"]


class PullSummary(_Answer):
    model: str
    requested: str
    name: str | None
    state: str
    status: str | None
    digest: str | None
    total: int | None
    completed: int | None
    error: str | None
    started_at: float | None
    finished_at: float | None


class PullList(_Answer):
    running: list[PullSummary]
    recent: list[PullSummary]


class StatusModel(SlotSummary):
    engine: str
    unloads_in_s: float | None = None
    lease_mib: dict[str, int] | None = None


class StatusGpu(_Answer):
    index: int
    name: str | None
    simulated: bool
    total_mib: int
    used_mib: int | None
    leased_mib: int
    leasable_mib: int
    leases: dict[str, int]


class StoreUsage(_Answer):
    path: str
    bytes: int


class DaemonStatus(_Answer):
    """GET /api/status: the whole daemon in one document."""

    accepting: bool
    uptime_s: float
    queued: int
    max_queue: int
    models: dict[str, StatusModel]
    gpus: list[StatusGpu]
    gpu_source: str
    pulls: PullList
    store: StoreUsage

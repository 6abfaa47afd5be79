"""The span conventions stagetrace reads: every name and rule the core, the store's views, the dashboards and
the analysis share, each rule with its SQL twin beside it (docs/design.md#span-conventions).

Spans come from stagetrace's own API and from instrumentation already in the field (OpenInference,
OpenLLMetry, the OpenTelemetry GenAI conventions, vLLM, SGLang; docs/design.md#instrumentation-already-in-the-field).
They reach the store through the agent or straight from an OpenTelemetry Collector, so whatever is derived
from a span (its stage, its digests, the request it belongs to) is derived *in the store*, by the SQL below,
which the materialized views run on every span written to ``otel_traces``. Python reads the results from
``stagetrace_requests`` and ``stagetrace_stages`` and never re-derives them.

The rules are data (``STAGE_RULES``, ``*_DIGEST_SOURCES``, the attribute roles), so supporting another
producer is a line here, not a change in four modules.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass


def _quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _alias(kind: str, expression: str) -> str:
    """A name for ``expression`` within one query, the same for the same expression: an expression written twice is
    analysed twice, and ClickHouse analyses a view's query again for every insert, so a view that repeats its long
    expressions costs milliseconds per insert before it reads a row (issue 32)."""
    return f"_{kind}_{hashlib.blake2b(expression.encode(), digest_size=6).hexdigest()}"


# -- stagetrace's own names
REQUEST_ID = "stagetrace.request.id"
INPUT_DIGEST = "stagetrace.input.digest"
OUTPUT_DIGEST = "stagetrace.output.digest"
STAGE = "stagetrace.stage"
STAGE_INPUT_DIGEST = "stagetrace.stage.input_digest"
STAGE_OUTPUT_DIGEST = "stagetrace.stage.output_digest"
INPUT_CONTENT = "stagetrace.input.content"
OUTPUT_CONTENT = "stagetrace.output.content"
STAGE_INPUT_CONTENT = "stagetrace.stage.input_content"
STAGE_OUTPUT_CONTENT = "stagetrace.stage.output_content"
NONDETERMINISTIC = "stagetrace.nondeterministic"
TP_RANK = "parallel.tp_rank"
TP_SIZE = "parallel.tp_size"  # on each rank's span: how many ranks the tensor-parallel group has
# a stage folded over steps (a request's collectives, its decode steps): its first steps' input digests in order, each
# cut to STEP_DIGEST_CHARS, comma-separated. After a rank's corrupted contribution is summed, every rank's later
# inputs differ too: the first step at which a rank's input differs tells the rank where it began
STAGE_STEP_INPUT_DIGESTS = "stagetrace.stage.step_input_digests"
STEPS_KEPT, STEP_DIGEST_CHARS = 256, 16
# Data- and pipeline-parallel ranks. A request runs on one data-parallel replica: its DP rank says where it ran, an
# identity like its host. Pipeline-parallel stages each hold their own TP ranks 0..n-1, so the stage key's rank is
# the TP rank alone on pipeline stage 0 (or without pipeline parallelism) and ``<tp>@pp<pp>`` on the others
# (rank_of, RANK_SQL): one key per GPU, and the ranks of a deployment without pipeline parallelism unchanged.
DP_RANK = "parallel.dp_rank"
PP_RANK = "parallel.pp_rank"
# Ranks an engine records on an enclosing span instead of its stage spans: SGLang sets tp_rank, pp_rank (always, 0
# without pipeline parallelism) and dp_rank (with data parallelism) on its per-thread span (``Scheduler [TP 0]
# [PP 0] ...``) only. The agent copies them onto the spans below that span in the same export (inherit_ranks) before
# the views read them: a view sees one span at a time and SGLang ends the thread span after its stage spans, so
# neither the view nor a later lookup of ``Rank`` could join them cheaply.
ENCLOSING_RANKS = {"tp_rank": TP_RANK, "pp_rank": PP_RANK, "dp_rank": DP_RANK}
HOST = "host.name"  # resource attribute
GPU_UUID = "gpu.uuid"
WEIGHTS_STEP = "model.weights.step"  # on decode spans: the training step of the weights the GPU served with

# -- configuration: what the resource detector (stagetrace.configuration) records once per process. No
# semantic convention names these yet; they are compared by the analysis like any resource attribute (none starts
# with an uncompared prefix such as "stagetrace.").
CONFIGURATION_GPU_MODEL = "gpu.model"  # the visible GPUs' distinct NVML names, e.g. "NVIDIA H200"
CONFIGURATION_GPU_UUIDS = "gpu.uuids"  # the visible GPUs' UUIDs, comma-separated
CONFIGURATION_GPU_COUNT = "gpu.count"
CONFIGURATION_DRIVER = "gpu.driver.version"
CONFIGURATION_CUDA = "cuda.driver.version"  # the CUDA version the driver supports, e.g. "12.8"
CONFIGURATION_NCCL = "nccl.version"
CONFIGURATION_ENV_PREFIX = "env."  # env.NCCL_ALGO = Ring
# environment variables that change numerics (docs/design.md#settings-that-change-numerics)
CONFIGURATION_ENVIRONMENT = (
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "NCCL_NVLS_ENABLE",
    "NCCL_P2P_DISABLE",
    "CUBLAS_WORKSPACE_CONFIG",
    "VLLM_BATCH_INVARIANT",
    "VLLM_ATTENTION_BACKEND",
    "VLLM_USE_V1",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "SGLANG_ENABLE_DETERMINISTIC_INFERENCE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "NVIDIA_TF32_OVERRIDE",
)
CONFIGURATION_ENGINE = "engine"  # engine = vllm; engine.version; engine.<setting> for each flag below
CONFIGURATION_ENGINE_VERSION = "engine.version"
CONFIGURATION_ENGINES = {
    "vllm": ("vllm serve", "vllm.entrypoints", "vllm/entrypoints"),
    "sglang": ("sglang.launch_server", "sglang serve", "sglang/launch_server"),
}
# the engines' command-line flags that change numerics -> the setting's name under "engine."
CONFIGURATION_FLAGS = {
    "--kv-cache-dtype": "kv_cache_dtype",
    "--attention-backend": "attention_backend",
    "--quantization": "quantization",
    "--dtype": "dtype",
    "--tensor-parallel-size": "tensor_parallel_size",
    "--tp-size": "tensor_parallel_size",
    "--tp": "tensor_parallel_size",
    "--speculative-config": "speculative_config",
    "--speculative-algorithm": "speculative_algorithm",
    "--enable-prefix-caching": "enable_prefix_caching",
    "--no-enable-prefix-caching": "disable_prefix_caching",
    "--disable-radix-cache": "disable_prefix_caching",
    "--enable-chunked-prefill": "enable_chunked_prefill",
    "--chunked-prefill-size": "chunked_prefill_size",
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--disable-custom-all-reduce": "disable_custom_all_reduce",
    "--enable-deterministic-inference": "deterministic_inference",
    "--seed": "seed",
}

# What the serving engines and libraries document about settings that change numerics
# (docs/design.md#settings-that-change-numerics, with the sources there): a verdict whose top cause is one of them
# says it, so the operator reads why it can.
KNOWN_CAUSES = {
    "decode.batch_size": "kernels reduce in an order that depends on the batch size unless batch invariance is on "
    "(vLLM VLLM_BATCH_INVARIANT=1, SGLang --enable-deterministic-inference)",
    "engine.enable_prefix_caching": "a prefix-cache hit computes the prompt on another kernel path than a miss; "
    "bit-exact only with batch invariance",
    "engine.disable_prefix_caching": "a prefix-cache hit computes the prompt on another kernel path than a miss",
    "engine.speculative_config": "speculative decoding is documented to change greedy outputs",
    "engine.speculative_algorithm": "speculative decoding is documented to change greedy outputs",
    "engine.attention_backend": "attention backends round differently (SGLang's deterministic mode supports only "
    "FlashInfer, FA3 and Triton)",
    "env.VLLM_ATTENTION_BACKEND": "attention backends round differently",
    "engine.kv_cache_dtype": "a lower-precision KV cache (FP8) changes the values attention reads",
    "engine.quantization": "quantized weights compute other values",
    "engine.dtype": "another compute dtype rounds differently",
    "engine.tensor_parallel_size": "another tensor-parallel degree splits every reduction differently",
    "engine.disable_custom_all_reduce": "custom all-reduce and NCCL sum in different orders (vLLM picks one by "
    "message size)",
    "engine.enable_chunked_prefill": "chunked prefill runs other kernels",
    "engine.deterministic_inference": "deterministic inference fixes the reduction order; without it outputs vary "
    "with the batch",
    "allreduce.algorithm": "ring and tree all-reduce sum in different orders",
    "env.NCCL_ALGO": "NCCL's algorithms sum in different orders",
    "env.NCCL_PROTO": "NCCL's protocols can change the reduction's chunking",
    "gpu.model": "outputs are reproducible only on the same GPU model (vLLM's reproducibility notes)",
    "gpu.driver.version": "outputs are reproducible only on the same driver and CUDA versions",
    "cuda.driver.version": "outputs are reproducible only on the same driver and CUDA versions",
    "engine.version": "outputs are reproducible only on the same engine version",
}

# Settings the engines and libraries document as not changing what is computed (logging, ports, names, the sockets of
# NCCL's bootstrap): never blamed for a deviation, whatever else they coincide with; each says why.
NUMERICS_NEUTRAL = {
    "env.NCCL_DEBUG": "NCCL_DEBUG only sets NCCL's logging",
    "env.NCCL_DEBUG_SUBSYS": "NCCL_DEBUG_SUBSYS only selects what NCCL logs",
    "env.NCCL_SOCKET_IFNAME": "NCCL_SOCKET_IFNAME picks the interface of NCCL's bootstrap sockets, not its reductions",
    "env.VLLM_LOGGING_LEVEL": "vLLM's log level",
    "env.VLLM_CONFIGURE_LOGGING": "vLLM's logging setup",
    "engine.port": "the port the engine listens on",
    "engine.host": "the address the engine listens on",
    "engine.served_model_name": "the name the model is served under",
    "engine.disable_log_requests": "whether requests are logged",
    "engine.disable_log_stats": "whether statistics are logged",
    "engine.api_key": "the API key clients present",
}

# The GPU inventory the gpu collector exports as gpu_info{gpu, uuid, model, driver_version, cuda_version, ...}, by the
# configuration attribute each label stands for: the analysis fills these in from the host's inventory for spans whose
# process recorded no configuration (joined by host and GPU UUID).
INVENTORY_METRIC = "gpu_info"
INVENTORY_LABELS = {
    CONFIGURATION_GPU_MODEL: "model",
    CONFIGURATION_DRIVER: "driver_version",
    CONFIGURATION_CUDA: "cuda_version",
}

# -- the prefix cache: how many of a request's prompt tokens the engine's prefix (KV) cache supplied instead of
# computing them. A hit computes the prompt on another kernel path than a miss, and a longer hit computes fewer of
# its tokens (docs/design.md#settings-that-change-numerics), so a request whose hit differs from its baseline's may
# deviate for that alone. The count is what the engine measured, not a setting, and it sits on the request's root
# (SGLang), not on the stage spans the attribute contrast compares: the ``prefix_cache`` detector reads it from the
# whole request. Where each producer records it (docs/instrumented.md), first found wins: SGLang's root (vLLM
# declares the name and never sets it), the GenAI conventions and OpenLLMetry (and OpenLLMetry's spelling before its
# v0.5), OpenInference. The last three are a provider's prompt cache: the same mechanism, run by the provider.
CACHED_TOKENS_KEYS = (
    "gen_ai.usage.cached_tokens",
    "gen_ai.usage.cache_read.input_tokens",
    "gen_ai.usage.cache_read_input_tokens",
    "llm.token_count.prompt_details.cache_read",
)
# Batch invariance makes a hit bit-exact with a miss (vLLM pull 52701; SGLang's deterministic inference): with it on
# for both requests a differing hit is named, never blamed. Configuration keys (``configuration``) and their "on".
BATCH_INVARIANT = {
    f"{CONFIGURATION_ENV_PREFIX}VLLM_BATCH_INVARIANT": "1",
    f"{CONFIGURATION_ENV_PREFIX}SGLANG_ENABLE_DETERMINISTIC_INFERENCE": "1",
    f"{CONFIGURATION_ENGINE}.deterministic_inference": "true",
}
PREFIX_CACHE_HIT = (
    "a prefix-cache hit computes the prompt on another kernel path than a miss, and a longer hit "
    "computes fewer of its tokens; bit-exact only with batch invariance"
)
KNOWN_CAUSES.update(dict.fromkeys(CACHED_TOKENS_KEYS, PREFIX_CACHE_HIT))


def cached_tokens(attributes: dict[str, str]) -> tuple[str, int] | None:
    """``(key, count)`` of the span's prefix-cache hit by ``CACHED_TOKENS_KEYS``, None where it records none (an
    unknown hit, not a miss); SGLang exports the count as a double (``0.0``)."""
    for key in CACHED_TOKENS_KEYS:
        value = attributes.get(key)
        if value is None:
            continue
        try:
            return key, int(float(value))
        except (ValueError, OverflowError):
            continue
    return None


def batch_invariant(attributes: dict[str, str]) -> bool:
    """Whether a span's configuration (attributes or resource) turns batch invariance on (``BATCH_INVARIANT``)."""
    return any(str(attributes.get(key, "")).lower() == on for key, on in BATCH_INVARIANT.items())


# -- weight transfer (RL: after each training step the trainer pushes the new weights into the inference GPUs).
# One span per sync, the root of its own trace, carrying the step, the bytes and how many ranks send and receive;
# below it one span per link (a source NIC writing to a destination NIC), or per destination. A sync span is not
# a request, although it is a trace's root.
SYNC_BYTES = "weights.sync.bytes"  # total bytes the sync moved
SYNC_SOURCE_RANKS = "weights.sync.source_ranks"  # how many training ranks hold the weights (could send)
SYNC_DESTINATION_RANKS = "weights.sync.destination_ranks"  # how many inference ranks receive them
LINK_BYTES = "weights.link.bytes"
LINK_SOURCE_HOST, LINK_SOURCE_RANK, LINK_SOURCE_DEVICE = (
    "weights.link.source.host",
    "weights.link.source.rank",
    "weights.link.source.device",
)
LINK_DESTINATION_HOST, LINK_DESTINATION_RANK, LINK_DESTINATION_DEVICE, LINK_DESTINATION_GPU = (
    "weights.link.destination.host",
    "weights.link.destination.rank",
    "weights.link.destination.device",
    "weights.link.destination.gpu.uuid",
)
# Which weights a GPU serves: the step of its latest decode span, counted only when it is a whole number (SGLang's
# weight_version "default" orders nothing); its fleet's step is the (lower) median of its service's GPUs' steps, so one
# canary ahead moves no one. The dashboards' board and alert and the weights detector share both rules.
_STEP = re.compile(r"-?[0-9]+")


def weights_step(attributes: dict[str, str]) -> int | None:
    """A span's ``model.weights.step`` as a number, None when it has none (same rule as ``IS_STEP_SQL``)."""
    text = attributes.get(WEIGHTS_STEP, "")
    return int(text) if _STEP.fullmatch(text) else None


IS_STEP_SQL = f"match(Attributes['{WEIGHTS_STEP}'], '^{_STEP.pattern}$')"  # over stagetrace_stages
STEP_SQL = f"toInt64OrZero(Attributes['{WEIGHTS_STEP}'])"  # where IS_STEP_SQL holds


def fleet_step_sql(steps: str) -> str:
    """The fleet's step from its GPUs' latest steps ``steps`` (an aggregate argument): the lower median, so that a
    step is the fleet's once more than half its GPUs serve it (of two GPUs, one canary ahead is not the fleet)."""
    return f"toInt64(quantileExactLow(0.5)({steps}))"


# A sync funnels through one NIC (the rank-0 pattern: gather on training rank 0, send from there) when one NIC
# of a side carries at least this many times its even share of the bytes (1 / that side's ranks).
FAN_IN_FACTOR = 2.0

# Pipeline order; other stage names are allowed and come after these, by start time.
PIPELINE_STAGES = ("retrieval", "cache", "context_assembly", "allreduce", "decode")

# A request's ID, in order of preference. vLLM and newer SGLang set gen_ai.request.id on their request span;
# older SGLang only ``rid``, a name too generic to trust anywhere but on SGLang's own request span.
REQUEST_ID_ALIASES = (REQUEST_ID, "gen_ai.request.id")
SGLANG_RID = "rid"
SGLANG_MODULE = ("module", "sglang::request")
# NVIDIA Dynamo (its Rust runtime's spans, tests/fixtures/dynamo/README.md): the frontend's root ``http-request`` over
# ``router.route_request`` over the worker's ``handle_payload``, each with Dynamo's tracing target ``request_span``.
# The request's ID on its root: the client's ``x-request-id`` where one was sent (a gateway's or an app's name for
# the request), else Dynamo's own ``request_id`` (the response's ``id`` without its ``chatcmpl-`` / ``cmpl-``).
# Both names are too generic to trust on any span but Dynamo's root. Its ``system_span`` roots (``GET /v1/models``,
# health checks) are no request.
DYNAMO_ROOT = "http-request"
DYNAMO_TARGET = "target"
DYNAMO_REQUEST_SPAN = "request_span"
DYNAMO_SYSTEM_SPAN = "system_span"
DYNAMO_REQUEST_IDS = ("x_request_id", "request_id")
DYNAMO_RESPONSE_ID_PREFIXES = ("chatcmpl-", "cmpl-")
# SGLang's model gateway (``smg``, its router, tests/fixtures/sglang/README.md): with ``--enable-trace`` it exports one
# span per HTTP request it serves, ``http_request`` (tracing target ``smg::otel-trace``), and sends the workers its
# ``traceparent``, so SGLang's request roots (``prefill Req``, ``decode Req``, or `` Req`` on one server) are its
# children in one trace. Its ``request_id`` is the client's x-request-id (else smg's own ``req-...``), returned in the
# response's x-request-id header: the request's ID on a route that serves a model. Its spans of the other routes
# (readiness and health probes, models, workers) are no request.
SMG_ROOT = "http_request"
SMG_TARGET = "smg::otel-trace"
SMG_REQUEST_ID = "request_id"
SMG_PATH = "path"
SMG_REQUEST_PATHS = (
    "/generate",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/interactions",
    "/v1/embeddings",
    "/v1/rerank",
    "/rerank",
    "/v1/classify",
    "/v1/audio/transcriptions",
)
# Roots that are no request (engine_traces.md): an engine's start-up and model loading, and SGLang's other modules'
# roots, e.g. the KV sender's ``Sender Req 0x...`` (module sglang::mooncake), a transfer worker's view of a request
# whose own root is ``... Req <rid8>``. They stay in otel_traces as spans, but a request listed, analysed or counted
# is a request a client sent. vLLM's start-up spans come from its ``@instrument`` decorator, which records the
# decorated function's module as ``code.namespace`` (``vllm.v1.engine.core_client``): which of its dozens of names
# is the root depends on how vLLM was started (``Overall Loading`` for ``vllm serve``, ``SyncMPClient init`` for the
# ``LLM`` class, in 0.33.0), so the module says it, the names being kept for producers that drop ``code.*``.
NOT_REQUEST_ROOT_NAMES = (
    "API server setup",
    "Overall Loading",
    "Executor init",
    "Worker init",
    "Init device",
    "Load model",
    "Prepare model",
)
VLLM_CODE_NAMESPACE = ("code.namespace", "vllm.")
SGLANG_MODULE_PREFIX = "sglang::"
# SGLang's prefill/decode disaggregation serves one request on two servers, each opening a root of its own
# (``prefill Req <rid8>``, ``decode Req <rid8>``) with the same rid, in two traces unless a traced router joins them:
# the request is both halves, each the latest of its role (a retried request ID's older traces are earlier tries).
DISAGGREGATED_ROLES = ("prefill", "decode")


def disaggregated_role(root_name: str) -> str | None:
    """The half of a disaggregated request a root span stands for (``prefill``/``decode``), or None."""
    role, _, rest = root_name.partition(" Req ")
    return role if rest and role in DISAGGREGATED_ROLES else None


def is_not_request(name: str, attributes: dict[str, str]) -> bool:
    """A span that is never a request, even as a trace's root (same rule as ``IS_NOT_REQUEST_SQL``)."""
    module = attributes.get(SGLANG_MODULE[0], "")
    return (
        name in NOT_REQUEST_ROOT_NAMES
        or str(attributes.get(VLLM_CODE_NAMESPACE[0], "")).startswith(VLLM_CODE_NAMESPACE[1])
        or (module.startswith(SGLANG_MODULE_PREFIX) and module != SGLANG_MODULE[1])
        or attributes.get(DYNAMO_TARGET) == DYNAMO_SYSTEM_SPAN
        or (is_smg_span(name, attributes) and attributes.get(SMG_PATH) not in SMG_REQUEST_PATHS)
    )


def is_smg_span(name: str, attributes: dict[str, str]) -> bool:
    """A span of SGLang's model gateway (same rule as ``IS_SMG_SPAN_SQL``)."""
    return name == SMG_ROOT and attributes.get(DYNAMO_TARGET) == SMG_TARGET


def is_smg_request(name: str, attributes: dict[str, str]) -> bool:
    """The gateway's span of a request a client sent to a model (same rule as ``IS_SMG_REQUEST_SQL``)."""
    return is_smg_span(name, attributes) and attributes.get(SMG_PATH) in SMG_REQUEST_PATHS


IS_SMG_SPAN_SQL = f"SpanName = {_quote(SMG_ROOT)} AND SpanAttributes[{_quote(DYNAMO_TARGET)}] = {_quote(SMG_TARGET)}"
_SMG_PATHS_SQL = ", ".join(_quote(p) for p in SMG_REQUEST_PATHS)
IS_SMG_REQUEST_SQL = f"{IS_SMG_SPAN_SQL} AND SpanAttributes[{_quote(SMG_PATH)}] IN ({_SMG_PATHS_SQL})"


def is_dynamo_request(name: str, attributes: dict[str, str]) -> bool:
    """Dynamo's frontend root of a request a client sent (same rule as ``IS_DYNAMO_REQUEST_SQL``)."""
    return name == DYNAMO_ROOT and attributes.get(DYNAMO_TARGET) == DYNAMO_REQUEST_SPAN


IS_DYNAMO_REQUEST_SQL = (
    f"SpanName = {_quote(DYNAMO_ROOT)} AND SpanAttributes[{_quote(DYNAMO_TARGET)}] = {_quote(DYNAMO_REQUEST_SPAN)}"
)


def request_id_candidates(request_id: str) -> tuple[str, ...]:
    """The IDs a request may be stored under, given the one a person holds: Dynamo's response ``id`` is its
    ``request_id`` behind ``chatcmpl-`` or ``cmpl-``, which its spans record bare."""
    bare = next((request_id[len(p) :] for p in DYNAMO_RESPONSE_ID_PREFIXES if request_id.startswith(p)), "")
    return (request_id, bare) if bare else (request_id,)


def stored_request_id_sql(request_id: str, table: str = "stagetrace_requests") -> str:
    """The SQL twin of ``request_id_candidates`` over an SQL string expression: a scalar subquery giving the ID the
    request is stored under in ``table`` (by its key), the ID as given where a request has it, else the bare ID behind
    a Dynamo response prefix; NULL where neither is stored."""
    # (?s): an ID is any string, newlines included, as in Python; no ``$``, which Grafana would read as a variable
    prefixed = _quote(f"(?s)^({'|'.join(re.escape(p) for p in DYNAMO_RESPONSE_ID_PREFIXES)})(.+)")
    return (
        f"(SELECT RequestId FROM {table} "
        f"WHERE RequestId IN ({request_id}, replaceRegexpOne({request_id}, {prefixed}, '\\\\2')) "
        f"ORDER BY RequestId != {request_id} LIMIT 1)"
    )


# OpenInference marks what it hides with this value: it is not content, and equal placeholders are no evidence.
REDACTED = "__REDACTED__"


# -- stage rules: the first rule whose conditions all hold names the span's stage
@dataclass(frozen=True)
class Attr:
    """The attribute is set (non-empty), or, with ``values``, holds one of them."""

    key: str
    values: tuple[str, ...] = ()

    def sql(self) -> str:
        value = f"SpanAttributes[{_quote(self.key)}]"
        if not self.values:
            return f"{value} != ''"
        return f"{value} IN ({', '.join(_quote(v) for v in self.values)})"


@dataclass(frozen=True)
class Name:
    """The span's name is one of ``exact``, or ends with one of ``suffixes``, or contains one of ``parts``."""

    exact: tuple[str, ...] = ()
    suffixes: tuple[str, ...] = ()
    parts: tuple[str, ...] = ()

    def sql(self) -> str:
        tests = [f"SpanName IN ({', '.join(_quote(n) for n in self.exact)})"] if self.exact else []
        tests += [f"endsWith(SpanName, {_quote(s)})" for s in self.suffixes]
        tests += [f"position(SpanName, {_quote(p)}) > 0" for p in self.parts]
        return " OR ".join(tests)

    def matches(self, name: str) -> bool:
        """Whether ``name`` passes this condition (what ``sql`` tests in the store)."""
        return name in self.exact or name.endswith(self.suffixes) or any(p in name for p in self.parts)


@dataclass(frozen=True)
class Rule:
    stage: str
    when: tuple[Attr | Name, ...]
    producer: str  # for the README and the reader of this table

    def sql(self) -> str:
        return " AND ".join(f"({c.sql()})" for c in self.when)


_OI_KIND = "openinference.span.kind"
# SGLang's prefill/decode disaggregation: the spans of the KV cache's move from the prefill server to the decode server
# (its bootstrap and transfer slices, and mooncake's own), a stage and a fabric transfer at once (moves_over_fabric)
KV_TRANSFER = Name(
    exact=("prefill_bootstrap", "prefill_transfer_kv_cache", "decode_bootstrap", "decode_transferred"),
    parts=("mooncake_",),
)
_VECTOR_STORES = ("chroma", "Pinecone", "pinecone", "Qdrant", "qdrant", "milvus", "weaviate", "lancedb", "marqo")

STAGE_RULES = (
    # context assembly before the kinds: Haystack's prompt builders are LLM spans to OpenInference
    Rule("context_assembly", (Attr(_OI_KIND, ("PROMPT",)),), "OpenInference (LangChain templates)"),
    Rule("context_assembly", (Attr(_OI_KIND), Name(suffixes=("PromptBuilder.run",))), "OpenInference (Haystack)"),
    # LlamaIndex's response synthesizers pack the retrieved chunks into the prompt window with a text splitter
    Rule(
        "context_assembly",
        (Attr(_OI_KIND, ("CHAIN",)), Name(suffixes=("TextSplitter.split_text",))),
        "OpenInference (LlamaIndex)",
    ),
    Rule("retrieval", (Attr(_OI_KIND, ("RETRIEVER", "RERANKER", "EMBEDDING")),), "OpenInference"),
    Rule("decode", (Attr(_OI_KIND, ("LLM",)),), "OpenInference"),
    Rule("context_assembly", (Attr("traceloop.span.kind"), Name(parts=("PromptTemplate",))), "OpenLLMetry (LangChain)"),
    Rule(
        "retrieval",
        (Attr("gen_ai.operation.name", ("retrieval", "vector_db_retrieve", "embeddings")),),
        "OpenTelemetry GenAI, OpenLLMetry",
    ),
    Rule(
        "decode",
        (Attr("gen_ai.operation.name", ("chat", "text_completion", "generate_content")),),
        "OpenTelemetry GenAI, OpenLLMetry",
    ),
    Rule("retrieval", (Attr("llm.request.type", ("embedding", "rerank")),), "OpenLLMetry (before semconv-ai 0.5)"),
    Rule("decode", (Attr("llm.request.type", ("chat", "completion")),), "OpenLLMetry (before semconv-ai 0.5)"),
    Rule("retrieval", (Attr("db.system.name", _VECTOR_STORES),), "vector stores, DB semantic conventions"),
    Rule("retrieval", (Attr("db.system", _VECTOR_STORES),), "vector stores, OpenLLMetry"),
    Rule("decode", (Name(exact=("llm_request",)), Attr("gen_ai.request.id")), "vLLM"),
    # the worker's handling of the request Dynamo's router sent it: the engine's prefill and decode (the mocker,
    # TensorRT-LLM, SGLang, vLLM); an engine span traced below it is part of that pass (stage_passes)
    Rule("decode", (Name(exact=("handle_payload",)), Attr(DYNAMO_TARGET, (DYNAMO_REQUEST_SPAN,))), "NVIDIA Dynamo"),
    Rule("context_assembly", (Name(exact=("tokenize",)),), "SGLang"),
    Rule("decode", (Name(exact=("prefill_forward", "decode_forward", "chunked_prefill", "decode_loop")),), "SGLang"),
    # prefill/decode disaggregation moves the prompt's KV cache from the prefill server's GPUs to the decode
    # server's, over RDMA (mooncake): the decode's cache is filled by it, so it is the cache stage, where a cache
    # the decode did not compute itself belongs (docs/instrumented.md)
    Rule("cache", (KV_TRANSFER,), "SGLang (disaggregation)"),
)


@functools.lru_cache(maxsize=4096)  # asked of every span of every analysed request; spans have few names
def moves_over_fabric(name: str) -> bool:
    """A span that moves data between hosts over the RDMA fabric without naming its NIC (``net.rdma.devices``): the
    KV transfer of a disaggregated request (``KV_TRANSFER``). Its host's RDMA NICs, every one the agent collected
    there, are weighed over its window as an all-reduce's named NICs are (analysis/fabric.py)."""
    return KV_TRANSFER.matches(name)


# -- digests: the first source with a value gives the digest; content is hashed in the store
@dataclass(frozen=True)
class Digest:
    """An attribute that already is a digest."""

    key: str

    def sql(self) -> str:
        return f"SpanAttributes[{_quote(self.key)}]"


@dataclass(frozen=True)
class Content:
    """An attribute holding content; hashed with ``CONTENT_DIGEST_SQL``."""

    key: str

    def sql(self) -> str:
        value = f"SpanAttributes[{_quote(self.key)}]"
        return f"if({value} IN ('', {_quote(REDACTED)}), '', {CONTENT_DIGEST_SQL.format(x=value)})"


@dataclass(frozen=True)
class Family:
    """Flattened list attributes (``<prefix><i>.<...><suffix>``), hashed together, keys included, in key order."""

    prefix: str
    suffix: str = ""

    def sql(self) -> str:
        # the members in one pass over the map: looking each key up again (SpanAttributes[k]) scans the map once per
        # key, which made the views 3x the bare insert on OpenInference spans (issue 32)
        found = (
            f"mapFilter((k, v) -> startsWith(k, {_quote(self.prefix)}) AND endsWith(k, {_quote(self.suffix)})"
            f" AND v != {_quote(REDACTED)}, SpanAttributes)"
        )
        members = _alias("m", found)
        lines = f"arrayMap((k, v) -> concat(k, '=', v), mapKeys({members}), mapValues({members}))"
        joined = f"arrayStringConcat(arraySort((line, k) -> k, {lines}, mapKeys({members})), '\\n')"  # in key order
        return f"if(empty(({found}) AS {members}), '', {CONTENT_DIGEST_SQL.format(x=joined)})"


# 128 bits, hex, like the span API's BLAKE2b-128 digests (ClickHouse has no BLAKE2b); only ever compared with
# digests made by this same expression, since the span API sends its own digests and no content.
CONTENT_DIGEST_SQL = "lower(hex(sipHash128({x})))"

REQUEST_INPUT_DIGEST_SOURCES = (
    Digest(INPUT_DIGEST),
    Content("input.value"),
    Content("traceloop.entity.input"),
    Content("gen_ai.input.messages"),
)
REQUEST_OUTPUT_DIGEST_SOURCES = (
    Digest(OUTPUT_DIGEST),
    Content("output.value"),
    Content("traceloop.entity.output"),
    Content("gen_ai.output.messages"),
)
STAGE_INPUT_DIGEST_SOURCES = (
    Digest(STAGE_INPUT_DIGEST),
    Family("llm.input_messages.", ".content"),
    Content("gen_ai.input.messages"),
    Family("gen_ai.prompt.", ".content"),
    Content("llm.prompts"),
    Family("reranker.input_documents.", ".content"),
    Content("traceloop.entity.input"),
    Content("input.value"),
)
# Retrieved documents by content, not ID: each replica that ingests a corpus gives its chunks new IDs.
STAGE_OUTPUT_DIGEST_SOURCES = (
    Digest(STAGE_OUTPUT_DIGEST),
    Family("retrieval.documents.", ".document.content"),
    Family("reranker.output_documents.", ".document.content"),
    Family("retrieval.documents.", ".document.id"),
    Family("llm.output_messages.", ".content"),
    Content("gen_ai.output.messages"),
    Family("gen_ai.completion.", ".content"),
    Content("traceloop.entity.output"),
    Content("output.value"),
)


# -- attribute roles: what analysis may blame. Content (what a stage read and produced, retrieved IDs included) and
# digests are what a stage did, identifiers differ on every request, measurements are effects; the rest are settings.
CONTENT_KEYS = frozenset(
    {
        "input.value",
        "output.value",
        "traceloop.entity.input",
        "traceloop.entity.output",
        "gen_ai.task.input",
        "gen_ai.task.output",
        "gen_ai.input.messages",
        "gen_ai.output.messages",
        "gen_ai.system_instructions",
        "gen_ai.retrieval.documents",
        "gen_ai.retrieval.query.text",
        "llm.prompts",
        "llm.prompt_template.variables",
        "reranker.query",
        "retrieval.doc_ids",
        INPUT_CONTENT,
        OUTPUT_CONTENT,
        STAGE_INPUT_CONTENT,
        STAGE_OUTPUT_CONTENT,
    }
)
CONTENT_PREFIXES = (
    "retrieval.documents.",
    "reranker.input_documents.",
    "reranker.output_documents.",
    "llm.input_messages.",
    "llm.output_messages.",
    "llm.choices.",
    "gen_ai.prompt.",
    "gen_ai.completion.",
    "embedding.embeddings.",
)
DIGEST_KEYS = frozenset({INPUT_DIGEST, OUTPUT_DIGEST, STAGE_INPUT_DIGEST, STAGE_OUTPUT_DIGEST})
IDENTIFIER_KEYS = frozenset(
    {
        *REQUEST_ID_ALIASES,
        SGLANG_RID,
        "gen_ai.response.id",
        "gen_ai.task.id",
        "gen_ai.task.parent.id",
        "gen_ai.agent.id",
        "gen_ai.conversation.id",
        "session.id",
        "user.id",
        "bid",
        "vllm.process_id",
        "process.pid",
        "pid",
        "bootstrap_room",  # SGLang's thread span and request root
        *DYNAMO_REQUEST_IDS,
        "trace_id",
        "parent_id",
        "trace_flags",
        "thread.id",  # Dynamo copies its context onto spans
    }
)
MEASUREMENT_KEYS = frozenset(
    {
        "cache.hit",
        "cache.hits",
        "cache.misses",
        "cache.entry.age_s",
        "context.tokens",
        "context.truncated",
        "allreduce.time_ms",
        "allreduce.max_ms",
        "allreduce.count",
        "allreduce.bytes",
        "decode.tokens",
        "decode.ttft_ms",
        "gen_ai.task.status",
        # Dynamo: what its spans measured (tracing's busy and idle time, tokens) and how the request ended
        "busy_ns",
        "idle_ns",
        "input_tokens",
        "output_tokens",
        "request.outcome",
        "request.attempt",
        "migration.is_retry",
        "migration.tokens_completed",
    }
)
MEASUREMENT_PREFIXES = ("gen_ai.usage.", "gen_ai.latency.", "gen_ai.response.", "llm.token_count.", "llm.cost.")
MEASUREMENT_SUFFIXES = ("_ms", "_s", "_seconds", "_bytes", ".duration")
# Never compared: they describe the telemetry, not the request.
UNCOMPARED_PREFIXES = ("stagetrace.", "telemetry.sdk.", "process.", "service.instance.")
UNCOMPARED_KEYS = frozenset({TP_RANK, PP_RANK, *ENCLOSING_RANKS, "input.mime_type", "output.mime_type"})


def is_content(key: str) -> bool:
    return key in CONTENT_KEYS or key.startswith(CONTENT_PREFIXES)


# What names *where* a request ran, not *why* its output changed: when a setting separates deviating from agreeing
# requests as well as the identity carrying it, the setting is the cause and the identity is where
# (docs/design.md#an-identity-is-where-a-setting-is-why).
IDENTITY_KEYS = frozenset(
    {
        HOST,
        "host.id",
        "k8s.node.name",
        "k8s.pod.name",
        "k8s.pod.uid",
        "k8s.container.name",
        "container.id",
        "container.name",
        "k8s.replicaset.name",
        "k8s.statefulset.name",
        "service.instance.id",
        GPU_UUID,
        CONFIGURATION_GPU_UUIDS,
        "cloud.resource_id",
        "host_id",  # SGLang's machine ID, on its thread spans
        DP_RANK,  # the data-parallel replica that served the request
        "instance_id",
        "worker_id",
        "prefill_worker_id",
        "decode_worker_id",  # Dynamo's worker that served it
    }
)


def is_identity(key: str) -> bool:
    return key in IDENTITY_KEYS


def is_measurement(key: str) -> bool:
    return key in MEASUREMENT_KEYS or key.startswith(MEASUREMENT_PREFIXES) or key.endswith(MEASUREMENT_SUFFIXES)


def is_comparable(key: str) -> bool:
    """May differ between a request and its baseline as a cause: not content, a digest, an identifier or telemetry."""
    return not (
        is_content(key)
        or key in DIGEST_KEYS
        or key in IDENTIFIER_KEYS
        or key in UNCOMPARED_KEYS
        or key.startswith(UNCOMPARED_PREFIXES)
    )


# -- peers: the requests a request is compared with are those with its input digest *and* its peer key. A store is
# shared by a fleet's services, and a shadow deployment of another model answers the same prompts differently by
# design: neither is a baseline. The key's parts are the root span's service and model; STAGETRACE_PEER_KEY
# (``config.peer_key``) keeps a subset (``gen_ai.request.model`` alone for services that share a model pool; empty:
# the input digest alone, as before issue 51).
PEER_SERVICE = "service.name"
PEER_MODEL = "gen_ai.request.model"
PEER_KEY_PARTS = (PEER_SERVICE, PEER_MODEL)
DEFAULT_PEER_KEY = PEER_KEY_PARTS
# Where a span names its model, first non-empty wins: the GenAI conventions (what was asked for, then what served),
# OpenInference's LLM span, OpenLLMetry's older names; then the same keys on the span's resource: vLLM's llm_request
# names no model (0.33.0), and an operator declares the model a server serves there
# (``OTEL_RESOURCE_ATTRIBUTES=gen_ai.request.model=...``, which vLLM's and SGLang's tracer providers read), a span's
# own naming winning over it. Dynamo's root names the model a client asked for as ``model`` (too generic a name for
# any other span); Dynamo's tracer reads no OTEL_RESOURCE_ATTRIBUTES (1.6.1). A *request's* model is its root rows'
# (the first that names one), else that of a span below them (``stagetrace_models``: ``requests_sql``,
# ``request_model``): an application's root often names none above the engine's or framework's span that does
# (OpenInference's LLM span under a chain, a decode span under an app's request). The decode span's first, then the
# earliest: the model that generates the answer tells deployments apart, not an embedding model its retrieval names.
MODEL_KEYS = (
    "gen_ai.request.model",
    "gen_ai.response.model",
    "llm.model_name",
    "llm.request.model_name",
    "llm.response.model_name",
    "llm.request.model",
    "llm.response.model",
)
DYNAMO_MODEL = "model"


def _model_sql(maps: tuple[str, ...], dynamo: bool) -> str:
    named = ", ".join(f"{m}[{_quote(k)}] != '', {m}[{_quote(k)}]" for m in maps for k in MODEL_KEYS)
    root = f", {IS_DYNAMO_REQUEST_SQL}, SpanAttributes[{_quote(DYNAMO_MODEL)}]" if dynamo else ""
    return f"multiIf({named}{root}, '')"


MODEL_SQL = _model_sql(("SpanAttributes", "ResourceAttributes"), dynamo=True)
OWN_MODEL_SQL = _model_sql(("SpanAttributes",), dynamo=False)  # the span's own naming, not its resource's
MODEL_STAGE = "decode"  # the stage whose span's model is a request's before any other span's


def model_of(attributes: dict[str, str], resource: dict[str, str] | None = None, name: str = "") -> str:
    """A span's model by ``MODEL_KEYS``, on the span, then on its resource, then Dynamo's (``name``: the span's);
    the Python twin of ``MODEL_SQL``."""
    found = next((str(m[k]) for m in (attributes, resource or {}) for k in MODEL_KEYS if m.get(k, "") != ""), "")
    return found or (str(attributes.get(DYNAMO_MODEL, "")) if is_dynamo_request(name, attributes) else "")


def request_model(roots, below=()) -> str:
    """A request's model: the first of its root rows' (``roots``: (attributes, resource[, name]) in
    ``requests_sql``'s order) that names one, else the ``MODEL_STAGE`` span's among the spans ``below`` them
    ((stage, start ns, attributes, resource)) that names one on its own attributes (``stagetrace_models``' rule: a
    resource names the model of every span of its process, which would add a row per span), else the earliest's,
    ties to the smaller name; the Python twin of ``requests_sql(model=True)``."""
    named = next((m for m in (model_of(*root) for root in roots) if m), "")
    spans = ((stage != MODEL_STAGE, t, model_of(a)) for stage, t, a, _ in below)
    return named or min((s for s in spans if s[2]), default=(0, 0, ""))[2]


def peer_sql(service: str = "ServiceName", model: str = "Model") -> str:
    """The peer key of a row as one SQL tuple; the parts left out of the key (bound parameters ``peer_service`` and
    ``peer_model``, from :func:`peer_parameters`) are ''."""
    return f"tuple(if({{peer_service:UInt8}}, {service}, ''), if({{peer_model:UInt8}}, {model}, ''))"


def peer_parameters(key=DEFAULT_PEER_KEY) -> dict[str, int]:
    """The bound parameters of :func:`peer_sql` for a peer key (a subset of ``PEER_KEY_PARTS``)."""
    return {"peer_service": int(PEER_SERVICE in key), "peer_model": int(PEER_MODEL in key)}


def peer_of(service: str, model: str, key=DEFAULT_PEER_KEY) -> tuple[str, str]:
    """The Python twin of :func:`peer_sql`."""
    return (service if PEER_SERVICE in key else "", model if PEER_MODEL in key else "")


# Contrast keys that may explain away another cause's deviations (``analysis.population.contrasts``): any attribute a
# stage span or its resource records that is a setting or an identity, whatever its name. The SQL twin of
# ``is_comparable`` and ``not is_measurement`` over a key ``k`` (the attribute's name).
def candidate_sql(k: str) -> str:
    keys = sorted(CONTENT_KEYS | DIGEST_KEYS | IDENTIFIER_KEYS | UNCOMPARED_KEYS | MEASUREMENT_KEYS)
    prefixes = CONTENT_PREFIXES + UNCOMPARED_PREFIXES + MEASUREMENT_PREFIXES
    return (
        f"NOT ({k} IN ({', '.join(_quote(x) for x in keys)})"
        + "".join(f" OR startsWith({k}, {_quote(p)})" for p in prefixes)
        + "".join(f" OR endsWith({k}, {_quote(x)})" for x in MEASUREMENT_SUFFIXES)
        + ")"
    )


# -- nondeterminism: outputs that differ by design are no deviation. A request samples nondeterministically when it
# says so, or samples above temperature zero without a seed (on its own span or its decode span) where its producer
# would have recorded one (not on SEED_UNRECORDED's engine spans, whose seed is unknown).
TEMPERATURE_KEYS = ("gen_ai.request.temperature", "llm.request.temperature")
SEED_KEYS = ("gen_ai.request.seed", "llm.request.seed")
INVOCATION_PARAMETERS = "llm.invocation_parameters"  # OpenInference: the request's sampling parameters as JSON
_TRUE = ("true", "True", "1")
# Spans of engines that never export the request's seed (engine_traces.md): SGLang's request root and vLLM's
# llm_request (both, alone among producers, set gen_ai.latency.e2e). On them a seed not recorded is unknown, not
# absent: temperature > 0 alone does not make the request nondeterministic, or a seeded request's real deviation
# would be excused as sampling (issue 53). OpenInference's invocation parameters list what was sent, seed included.
SEED_UNRECORDED = ((SGLANG_MODULE[0], SGLANG_MODULE[1]), ("gen_ai.latency.e2e", None))
# Dynamo is not among them: its request root records neither the temperature nor the seed (1.6.1), so whether it
# sampled at all is unknown, which unknown_seed says of it.


def seed_unknown(attributes: dict[str, str]) -> bool:
    """The span's producer never records the seed (same rule as ``SEED_UNKNOWN_SQL``)."""
    return any(attributes.get(k, "") != "" if v is None else attributes.get(k) == v for k, v in SEED_UNRECORDED)


def records_seed(attributes: dict[str, str]) -> bool:
    """The span records the request's seed: a seed attribute, or OpenInference's invocation parameters naming one."""
    if any(attributes.get(k, "") != "" for k in SEED_KEYS):
        return True
    recorded = attributes.get(INVOCATION_PARAMETERS, "")
    if not recorded:
        return False
    try:
        parameters = json.loads(recorded)
    except ValueError:
        return False
    return isinstance(parameters, dict) and parameters.get("seed") is not None


def unknown_seed(attributes: dict[str, str], name: str = "") -> str:
    """Why a span's sampling has an unknown seed, in words, or ``''``: it samples (temperature > 0) and its producer
    never records the seed (``SEED_UNRECORDED``), so it may have been seeded; or it is Dynamo's request root (``name``),
    which records neither. ``explain`` and ``divergences`` say so where they would otherwise have called it sampling
    nondeterminism (issue 53)."""
    if any(attributes.get(k, "") != "" for k in SEED_KEYS):
        return ""
    if is_dynamo_request(name, attributes) and not any(attributes.get(k, "") != "" for k in TEMPERATURE_KEYS):
        return "Dynamo records neither the temperature nor the seed"
    if not seed_unknown(attributes):
        return ""
    producer = "SGLang" if attributes.get(SGLANG_MODULE[0]) == SGLANG_MODULE[1] else "the engine"
    return next(
        (
            f"{k} {attributes[k]}, and {producer} does not record the seed"
            for k in TEMPERATURE_KEYS
            if _positive(str(attributes.get(k, "")))
        ),
        "",
    )


def nondeterminism(attributes: dict[str, str]) -> str:
    """Why a span's output may differ by design, or ``''``. Same rule as ``NONDETERMINISM_SQL``."""
    if attributes.get(NONDETERMINISTIC, "") in _TRUE:
        return f"{NONDETERMINISTIC} is set"
    seeded = any(attributes.get(k, "") != "" for k in SEED_KEYS) or seed_unknown(attributes)
    for key in TEMPERATURE_KEYS:
        if _positive(attributes.get(key, "")) and not seeded:
            return f"{key} {attributes[key]} without a seed"
    parameters = attributes.get(INVOCATION_PARAMETERS, "")
    if parameters:
        try:
            decoded = json.loads(parameters)
        except ValueError:
            decoded = None
        if isinstance(decoded, dict) and _positive(str(decoded.get("temperature", ""))) and decoded.get("seed") is None:
            return f"{INVOCATION_PARAMETERS} temperature {decoded['temperature']} without a seed"
    return ""


def _positive(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


SEED_UNKNOWN_SQL = (
    "("
    + " OR ".join(
        f"SpanAttributes[{_quote(k)}] != ''" if v is None else f"SpanAttributes[{_quote(k)}] = {_quote(v)}"
        for k, v in SEED_UNRECORDED
    )
    + ")"
)


def _seeded_sql() -> str:
    # a seed recorded, or one the producer never records (unknown): either way temperature alone is no verdict
    return " OR ".join(f"SpanAttributes[{_quote(k)}] != ''" for k in SEED_KEYS) + f" OR {SEED_UNKNOWN_SQL}"


_PARAMS = f"SpanAttributes[{_quote(INVOCATION_PARAMETERS)}]"
NONDETERMINISM_SQL = (
    f"multiIf(SpanAttributes[{_quote(NONDETERMINISTIC)}] IN ({', '.join(_quote(v) for v in _TRUE)}), "
    f"{_quote(NONDETERMINISTIC + ' is set')}, "
    + "".join(
        f"toFloat64OrZero(SpanAttributes[{_quote(k)}]) > 0 AND NOT ({_seeded_sql()}), "
        f"concat({_quote(k + ' ')}, SpanAttributes[{_quote(k)}], ' without a seed'), "
        for k in TEMPERATURE_KEYS
    )
    + f"JSONExtractFloat({_PARAMS}, 'temperature') > 0 AND (NOT JSONHas({_PARAMS}, 'seed') OR JSONType({_PARAMS}, 'seed') = 'Null'), "
    f"concat({_quote(INVOCATION_PARAMETERS + ' temperature ')}, JSONExtractRaw({_PARAMS}, 'temperature'), ' without a seed'), "
    "'')"
)


def nondeterministic_traces_sql(
    where: str, requests: str = "stagetrace_requests", stages: str = "stagetrace_stages"
) -> str:
    """Trace IDs of nondeterministic requests among root and stage rows matching ``where`` (``Start`` bounds)."""
    return (
        f"SELECT TraceId FROM {requests} WHERE Nondeterministic != '' AND {where} "
        f"UNION DISTINCT SELECT TraceId FROM {stages} WHERE Nondeterministic != '' AND {where}"
    )


# -- a stage run as several spans: spans nested in a span of the same stage are part of that one (LlamaIndex's
# retrieve → _retrieve → query embedding; an LLM's predict → complete); the remaining, top-level spans are
# the stage's passes, in start order. The stage's input is its first pass's; its output all passes' outputs.
def stage_passes(spans):
    """The top-level spans of one stage of one trace (objects with ``span_id``, ``parent_span_id``, ``start_ns``)."""
    if len(spans) == 1:  # most stages of most traces: nothing to order
        return list(spans)
    ids = {s.span_id for s in spans}
    return sorted((s for s in spans if s.parent_span_id not in ids), key=lambda s: (s.start_ns, s.span_id))


def inherit_ranks(spans) -> int:
    """Give each span the ranks it does not record itself of its nearest enclosing span among ``spans`` (objects
    with ``context.trace_id``, ``context.span_id``, ``parent`` (None or with ``span_id``) and a mutable
    ``attributes`` dict) that records them, under stagetrace's names (``ENCLOSING_RANKS``: ``tp_rank`` as
    ``parallel.tp_rank``, ...); returns how many spans got one. A span that records an engine's rank itself (the
    thread span) is left as it is.

    Only spans exported together are seen: SGLang's exporter sends a thread's spans when the request ends on that
    thread, thread span last, so they share an export unless a batch boundary (512 spans by default) falls between.
    """
    by_id = {(s.context.trace_id, s.context.span_id): s for s in spans}
    found: dict[tuple[int, int, str], str] = {}

    def rank(span, engine: str, ours: str, depth: int = 0) -> str:
        key = (span.context.trace_id, span.context.span_id, ours)
        if key not in found:
            own = span.attributes.get(ours, "")
            own = own if own != "" else span.attributes.get(engine, "")
            parent = by_id.get((span.context.trace_id, span.parent.span_id)) if span.parent else None
            inherited = rank(parent, engine, ours, depth + 1) if parent and depth < 64 else ""
            found[key] = str(own) if own != "" else inherited
        return found[key]

    given = 0
    for span in spans:
        if any(k in span.attributes for k in ENCLOSING_RANKS):
            continue
        inherited = {
            ours: rank(span, engine, ours)
            for engine, ours in ENCLOSING_RANKS.items()
            if span.attributes.get(ours, "") == ""
        }
        inherited = {k: v for k, v in inherited.items() if v}
        span.attributes.update(inherited)
        given += bool(inherited)
    return given


def rank_of(attributes: dict[str, str]) -> str:
    """The rank of a stage span's key: its TP rank, on a pipeline stage other than 0 with that stage
    (``1@pp1``). The Python twin of ``RANK_SQL``."""
    tp, pp = str(attributes.get(TP_RANK, "")), str(attributes.get(PP_RANK, ""))
    return tp if pp in ("", "0") else f"{tp or 0}@pp{pp}"


def rank_order(rank: str) -> tuple:
    """Ranks by pipeline stage, then TP rank, by number (a rank that is no number as 0)."""
    tp, _, pp = rank.partition("@pp")
    return (int(pp) if pp.isdigit() else 0, int(tp) if tp.isdigit() else 0, rank)


def combined_output(outputs) -> str:
    """The output of a stage from its passes' outputs, in start order."""
    return ",".join(outputs)


# -- time columns of either generation of the Collector's tables: DateTime64(9) (its previous metric tables, its span
# table, and stagetrace's own) or DateTime (its current metric tables and trace-ID table, in seconds)
def time_ns_sql(column: str) -> str:
    """Nanoseconds since the epoch of ``column``, whichever of the two types it has (DateTime64(9) passes through)."""
    return f"toUnixTimestamp64Nano(toDateTime64({column}, 9))"


# -- SQL over otel_traces columns (SpanName, SpanAttributes, ParentSpanId, ...) for the materialized views
def _first_sql(sources) -> str:
    # multiIf evaluates lazily (short_circuit_function_evaluation), so a span with a digest attribute never hashes;
    # the digest a producer sent is tested apart, in an if of its own: a multiIf of many branches costs each row
    # several times that one test even when its first branch holds (measured, issue 32)
    first, *rest = sources
    parts = []
    for source in rest:
        expression = source.sql()
        name = _alias("d", expression)
        parts.append(f"(({expression}) AS {name}) != '', {name}")
    return f"if({first.sql()} != '', {first.sql()}, multiIf(" + ", ".join(parts) + ", ''))"


STAGE_SQL = (
    f"multiIf(SpanAttributes[{_quote(STAGE)}] != '', SpanAttributes[{_quote(STAGE)}], "
    + ", ".join(f"{rule.sql()}, {_quote(rule.stage)}" for rule in STAGE_RULES)
    + ", '')"
)
IS_EXPLICIT_STAGE_SQL = f"mapContains(SpanAttributes, {_quote(STAGE)})"
IS_SGLANG_REQUEST_SQL = f"SpanAttributes[{_quote(SGLANG_RID)}] != '' AND SpanAttributes[{_quote(SGLANG_MODULE[0])}] = {_quote(SGLANG_MODULE[1])}"
ATTRIBUTE_REQUEST_ID_SQL = (
    "multiIf("
    + ", ".join(f"SpanAttributes[{_quote(k)}] != '', SpanAttributes[{_quote(k)}]" for k in REQUEST_ID_ALIASES)
    + f", {IS_SGLANG_REQUEST_SQL}, SpanAttributes[{_quote(SGLANG_RID)}]"
    + "".join(
        f", {IS_DYNAMO_REQUEST_SQL} AND SpanAttributes[{_quote(k)}] != '', SpanAttributes[{_quote(k)}]"
        for k in DYNAMO_REQUEST_IDS
    )
    + f", {IS_SMG_REQUEST_SQL} AND SpanAttributes[{_quote(SMG_REQUEST_ID)}] != '', SpanAttributes[{_quote(SMG_REQUEST_ID)}]"
    + ", '')"
)
# A request root: a span with a request ID that is not one of stagetrace's own stage spans (nor a weight sync, nor a
# root that is no request: is_not_request), or
# a trace's root span (its trace ID then stands for the request ID). Stages named by other conventions may be roots too:
# vLLM's llm_request is both the request and its decode stage.
IS_WEIGHT_SYNC_SQL = f"mapContains(SpanAttributes, {_quote(SYNC_BYTES)})"
IS_NOT_REQUEST_SQL = (
    f"(SpanName IN ({', '.join(_quote(n) for n in NOT_REQUEST_ROOT_NAMES)}) OR "
    f"startsWith(SpanAttributes[{_quote(VLLM_CODE_NAMESPACE[0])}], {_quote(VLLM_CODE_NAMESPACE[1])}) OR "
    f"(startsWith(SpanAttributes[{_quote(SGLANG_MODULE[0])}], {_quote(SGLANG_MODULE_PREFIX)}) "
    f"AND SpanAttributes[{_quote(SGLANG_MODULE[0])}] != {_quote(SGLANG_MODULE[1])}) OR "
    f"SpanAttributes[{_quote(DYNAMO_TARGET)}] = {_quote(DYNAMO_SYSTEM_SPAN)} OR "
    f"({IS_SMG_SPAN_SQL} AND SpanAttributes[{_quote(SMG_PATH)}] NOT IN ({_SMG_PATHS_SQL})))"
)
IS_REQUEST_ROOT_SQL = (
    f"NOT {IS_EXPLICIT_STAGE_SQL} AND NOT {IS_WEIGHT_SYNC_SQL} AND NOT {IS_NOT_REQUEST_SQL} "
    f"AND ({ATTRIBUTE_REQUEST_ID_SQL} != '' OR ParentSpanId = '')"
)
REQUEST_ID_SQL = f"if({ATTRIBUTE_REQUEST_ID_SQL} AS _rid != '', _rid, TraceId)"
REQUEST_ID_SOURCE_SQL = f"if({ATTRIBUTE_REQUEST_ID_SQL} != '', 'attribute', 'trace')"
REQUEST_INPUT_DIGEST_SQL = _first_sql(REQUEST_INPUT_DIGEST_SOURCES)
REQUEST_OUTPUT_DIGEST_SQL = _first_sql(REQUEST_OUTPUT_DIGEST_SOURCES)
STAGE_INPUT_DIGEST_SQL = _first_sql(STAGE_INPUT_DIGEST_SOURCES)
STAGE_OUTPUT_DIGEST_SQL = _first_sql(STAGE_OUTPUT_DIGEST_SOURCES)
# The content sources are the only ones that cost: a span carrying none of their attributes gets its digests from the
# digest attributes alone (a Content source of an absent key and a Family without members are ''), so the views
# compute the digest rules only for spans that carry content (HAS_CONTENT_SQL) and read the others' digests as the
# attributes they are (the *_GIVEN_SQL twins, equal to the full rules on such spans).
_SOURCES = (
    REQUEST_INPUT_DIGEST_SOURCES,
    REQUEST_OUTPUT_DIGEST_SOURCES,
    STAGE_INPUT_DIGEST_SOURCES,
    STAGE_OUTPUT_DIGEST_SOURCES,
)
CONTENT_SOURCE_KEYS = tuple(sorted({s.key for sources in _SOURCES for s in sources if isinstance(s, Content)}))
CONTENT_SOURCE_PREFIXES = tuple(sorted({s.prefix for sources in _SOURCES for s in sources if isinstance(s, Family)}))
HAS_CONTENT_SQL = "arrayExists(k -> k IN ({keys}) OR {prefixes}, mapKeys(SpanAttributes))".format(
    keys=", ".join(_quote(k) for k in CONTENT_SOURCE_KEYS),
    prefixes=" OR ".join(f"startsWith(k, {_quote(p)})" for p in CONTENT_SOURCE_PREFIXES),
)
(
    REQUEST_INPUT_DIGEST_GIVEN_SQL,
    REQUEST_OUTPUT_DIGEST_GIVEN_SQL,
    STAGE_INPUT_DIGEST_GIVEN_SQL,
    STAGE_OUTPUT_DIGEST_GIVEN_SQL,
) = (sources[0].sql() for sources in _SOURCES)
RANK_SQL = (
    f"if(SpanAttributes[{_quote(PP_RANK)}] IN ('', '0'), SpanAttributes[{_quote(TP_RANK)}], "
    f"concat(if(SpanAttributes[{_quote(TP_RANK)}] = '', '0', SpanAttributes[{_quote(TP_RANK)}]), '@pp', "
    f"SpanAttributes[{_quote(PP_RANK)}]))"
)
# Stage attributes as stagetrace keeps them: without content, which stays only where its producer sent it.
STAGE_ATTRIBUTES_SQL = "mapFilter((k, v) -> NOT (k IN ({keys}) OR {prefixes}), SpanAttributes)".format(
    keys=", ".join(_quote(k) for k in sorted(CONTENT_KEYS)),
    prefixes=" OR ".join(f"startsWith(k, {_quote(p)})" for p in CONTENT_PREFIXES),
)


# -- SQL over stagetrace_requests: one row per request
# A trace's root rows that carry a request ID first (Source 'trace': the trace ID stands in for one), then the
# earliest: (Source = 'trace', start) packed into one UInt64, which argMin compares three times faster than a tuple
ROOT_ORDER_SQL = "bitOr(bitShiftLeft(toUInt64(Source = 'trace'), 63), toUInt64(toUnixTimestamp64Nano({start})))"


# Whether any span below a request's roots ever named a model: a count the engine answers from its parts' metadata
_ANY_MODELS = "(SELECT count() FROM {models}) > 0"


def requests_sql(where: str = "1", table: str = "stagetrace_requests", model: bool = False) -> str:
    """One row per trace among the root rows matching ``where``: the request's ID from its first span carrying one
    (else the trace ID), digests from the first root row that has them, the trace's start and end.

    A trace may hold several root rows: an app's root span without a request ID above an engine's span with one
    (vLLM's llm_request, reached through ``traceparent``), or stagetrace's root above it. ``model``: also the
    request's model, from the first root row that names one (the engine's span, below an app's root, often does),
    else from a span below them (``request_model``'s rule), in ``stagetrace_models`` beside ``table``.
    """
    order = ROOT_ORDER_SQL.format(start="RowStart")
    columns = (
        "RequestId",
        "TraceId",
        "SpanId",
        "Start",
        "End",
        "ServiceName",
        "HostName",
        "SpanName",
        "InputDigest",
        "OutputDigest",
        "StatusCode",
    )
    roots = f"""SELECT argMin(RequestId, {order}) AS RequestId, TraceId, argMin(SpanId, {order}) AS SpanId,
       min(RowStart) AS Start, max(RowEnd) AS End,
       argMin(ServiceName, {order}) AS ServiceName, argMin(HostName, {order}) AS HostName,
       argMin(SpanName, {order}) AS SpanName, argMinIf(InputDigest, {order}, InputDigest != '') AS InputDigest,
       argMinIf(OutputDigest, {order}, OutputDigest != '') AS OutputDigest, argMin(StatusCode, {order}) AS StatusCode{
        f", argMinIf(Model, {order}, Model != '') AS RootModel" if model else ""
    }
FROM (SELECT RequestId, TraceId, SpanId, Start AS RowStart, End AS RowEnd, ServiceName, HostName, SpanName,
             InputDigest AS InputDigest, OutputDigest AS OutputDigest, StatusCode, Source{", Model" if model else ""}
      FROM {table}
      WHERE {where})
GROUP BY TraceId"""
    if not model:
        return roots
    # only the traces whose root rows name no model, found by the models table's key (its trace ID): none read where
    # every root names one, and a few granules for one request's. While the models table is empty (no span below a
    # root has named a model), the count folds the filter to false before the set of trace IDs is built.
    models = table.replace("stagetrace_requests", "stagetrace_models")
    return f"""SELECT {", ".join(f"r.{c} AS {c}" for c in columns)},
       if(r.RootModel != '', r.RootModel, s.BelowModel) AS Model
FROM ({roots}) AS r
LEFT JOIN (SELECT TraceId, argMin(Model, (Stage != '{MODEL_STAGE}', Start, Model)) AS BelowModel FROM {models}
           WHERE {_ANY_MODELS.format(models=models)} AND TraceId IN (SELECT TraceId FROM {table} WHERE ({where}) AND Model = '')
           GROUP BY TraceId) AS s ON r.TraceId = s.TraceId"""


def trace_models_sql(traces: str, where: str = "1", table: str = "stagetrace_requests") -> str:
    """(TraceId, Model) of the traces in ``traces`` (a subquery of trace IDs) that have a model, by the rule of
    ``requests_sql(where, table, model=True)``, in one pass over the rows that name one (root rows of ``table``
    matching ``where`` first, then the ``MODEL_STAGE`` span below them, then the earliest): what a query that needs
    only the model reads, without grouping every root row of the traces."""
    models = table.replace("stagetrace_requests", "stagetrace_models")
    return f"""SELECT TraceId, argMin(Model, (Tier, Key, Model)) AS Model FROM (
    SELECT TraceId, toUInt8(0) AS Tier, {ROOT_ORDER_SQL.format(start="Start")} AS Key, Model FROM {table}
    WHERE ({where}) AND Model != '' AND TraceId IN ({traces})
    UNION ALL
    SELECT TraceId, toUInt8(1 + (Stage != '{MODEL_STAGE}')) AS Tier, toUInt64(toUnixTimestamp64Nano(Start)) AS Key,
           Model
    FROM {models} WHERE {_ANY_MODELS.format(models=models)} AND TraceId IN ({traces}))
GROUP BY TraceId"""

"""Synthetic stores for benchmarks: requests of five stages in the real schema, generated inside ClickHouse.

``INSERT ... SELECT FROM numbers(N)`` builds every span row in the engine (no Python objects, no
SDK), so a million requests take seconds rather than minutes. Requests share inputs 20 at a time;
5% deviate from their group's output at a random stage, and that stage's ``setting.<stage>``
attribute says ``b`` where the agreeing requests say ``a``. Every process recorded its configuration with the
resource detector, and one host in sixteen runs another GPU model whose outputs agree. The materialized views fill
``stagetrace_requests`` and ``otel_traces_trace_id_ts`` as they would for real traffic.

``style="openinference"`` writes the same requests as an OpenInference-instrumented framework would: span kinds
instead of stage names, content (``input.value``, ``output.value``, ``retrieval.documents.*``) instead of digests,
a retriever and a reranker in one stage, so the store's views map stages and hash content as they do in the field.
"""

from __future__ import annotations

from stagetrace.store import Store

GROUP = 20  # requests per input digest
DEVIATING_PERCENT = 5
HOSTS = 16

_STAGES = "['retrieval', 'cache', 'context_assembly', 'allreduce', 'decode']"
# OpenInference: retrieval (retriever, reranker), a chain span that is no stage, context assembly, decode
_KINDS = "['RETRIEVER', 'RERANKER', 'CHAIN', 'PROMPT', 'LLM']"
_OPENINFERENCE_ATTRIBUTES = f"""if(k = 0,
       map('openinference.span.kind', 'CHAIN', 'input.value', concat('question ', input), 'output.value',
           concat('answer ', outs[6])),
       map('openinference.span.kind', {_KINDS}[k], 'input.value', concat('text ', outs[k]),
           if(k = 1, 'retrieval.documents.0.document.content', 'output.value'), concat('text ', outs[k + 1]),
           if(k = 1, 'retrieval.documents.0.document.score', 'llm.token_count.total'), toString(k * 7),
           concat('setting.', lower({_KINDS}[k])), if(deviating AND k = at, 'b', 'a'),
           'gpu.uuid', concat('GPU-', toString(n % {HOSTS}), '-0')))"""

INSERT_SQL = f"""
INSERT INTO {{db:Identifier}}.otel_traces
    (Timestamp, TraceId, SpanId, ParentSpanId, SpanName, SpanKind, ServiceName, ResourceAttributes, ScopeName,
     SpanAttributes, Duration, StatusCode)
SELECT
    fromUnixTimestamp64Nano(start + k * 1000000) AS Timestamp,
    trace AS TraceId,
    substring(lower(hex(MD5(concat(trace, toString(k))))), 1, 16) AS SpanId,
    if(k = 0, '', substring(lower(hex(MD5(concat(trace, '0')))), 1, 16)) AS ParentSpanId,
    if(k = 0, 'inference.request', concat('stage.', {_STAGES}[k])) AS SpanName,
    if(k = 0, 'Server', 'Internal') AS SpanKind,
    'bench' AS ServiceName,
    map('service.name', 'bench', 'host.name', concat('host-', toString(n % {HOSTS})),
        'gpu.model', if(n % {HOSTS} = 3, 'NVIDIA H100 80GB HBM3', 'NVIDIA H200'), 'gpu.driver.version', '570.133.20',
        'cuda.driver.version', '12.8', 'engine', 'vllm', 'engine.attention_backend', 'FLASH_ATTN',
        'engine.tensor_parallel_size', '4') AS ResourceAttributes,
    'stagetrace' AS ScopeName,
    {{attributes}} AS SpanAttributes,
    if(k = 0, 6000000, 1000000) AS Duration,
    'Unset' AS StatusCode
FROM (
    SELECT number AS n,
           lower(hex(MD5(concat('trace', toString(n + {{offset:UInt64}}))))) AS trace,
           lower(hex(MD5(concat('input', toString({{inputs_from:UInt64}} + n % greatest(1, intDiv({{requests:UInt64}}, {{group:UInt64}}))))))) AS input,
           cityHash64(n, 'deviates') % 1000000 < {{deviating_ppm:UInt64}} AS deviating,
           1 + cityHash64(n, 'stage') % 5 AS at,
           -- the digest entering stage k is outs[k]; outs[6] is the request's output
           arrayMap(i -> if(i = 1, input, lower(hex(MD5(concat(input, toString(i),
                        if(deviating AND i - 1 >= at, toString(n), '')))))), range(1, 7)) AS outs,
           {{t0:Int64}} + toInt64(n) * {{step:Int64}} AS start
    FROM numbers({{requests:UInt64}})
)
ARRAY JOIN range(0, 6) AS k
"""
_STAGETRACE_ATTRIBUTES = f"""if(k = 0,
       map('stagetrace.request.id', concat('req-', toString(n + {{offset:UInt64}})), 'stagetrace.input.digest', input,
           'stagetrace.output.digest', outs[6]),
       map('stagetrace.stage', {_STAGES}[k], 'stagetrace.stage.input_digest', outs[k],
           'stagetrace.stage.output_digest', outs[k + 1], concat('setting.', {_STAGES}[k]),
           if(deviating AND k = at, 'b', 'a'), 'gpu.uuid', concat('GPU-', toString(n % {HOSTS}), '-0')))"""
STYLES = {"stagetrace": _STAGETRACE_ATTRIBUTES, "openinference": _OPENINFERENCE_ATTRIBUTES}


def fill(
    store: Store,
    requests: int,
    t0_ns: int,
    seconds: float = 3600.0,
    offset: int = 0,
    style: str = "stagetrace",
    group: int = GROUP,
    deviating_percent: float = DEVIATING_PERCENT,
    inputs_from: int = 0,
) -> int:
    """Insert ``requests`` requests (six spans each) spread over ``seconds`` from ``t0_ns``, ``group`` of them to an
    input (numbered from ``inputs_from``), ``deviating_percent`` of them deviating; returns the spans."""
    step = int(seconds * 1e9 / max(requests, 1))
    store.client.command(
        INSERT_SQL.replace("{attributes}", STYLES[style]),
        parameters={
            "db": store.database,
            "requests": requests,
            "t0": t0_ns,
            "step": step,
            "offset": offset,
            "inputs_from": inputs_from,
            "group": group,
            "deviating_ppm": int(deviating_percent * 10_000),
        },
        settings={"max_insert_threads": 2},
    )
    return requests * 6

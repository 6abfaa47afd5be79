"""What an application records above an engine's spans, added to an export recorded from the engine: the engines
trace no content, so a test that compares requests puts the prompt's and the answer's digests where an application
that called the engine would have them."""

from __future__ import annotations

from stagetrace import conventions


def application_above(message, root, resource: dict[str, str], prompt: str, output: str, span_ids: tuple) -> None:
    """Add to ``message`` an application's request span (``prompt``'s and ``output``'s digests) and, under it, the
    decode stage that called the engine (``output``'s digest), with ``resource``'s attributes; the engine's ``root``
    becomes a child of that decode span. ``span_ids``: the request's and the decode span's IDs."""
    app = message.resource_spans.add()
    for key, value in resource.items():
        app.resource.attributes.add(key=key, value={"string_value": value})
    scope = app.scope_spans.add()
    start, end = root.start_time_unix_nano - 10**6, root.end_time_unix_nano + 10**6
    request_id, decode_id = span_ids
    request = scope.spans.add(
        name="chat", trace_id=root.trace_id, span_id=request_id, start_time_unix_nano=start, end_time_unix_nano=end
    )
    decode = scope.spans.add(
        name="generate",
        trace_id=root.trace_id,
        span_id=decode_id,
        parent_span_id=request.span_id,
        start_time_unix_nano=start + 1,
        end_time_unix_nano=end - 1,
    )
    root.parent_span_id = decode.span_id
    request_content = {conventions.INPUT_DIGEST: prompt, conventions.OUTPUT_DIGEST: output}
    decode_content = {
        conventions.STAGE: "decode",
        conventions.STAGE_INPUT_DIGEST: prompt,
        conventions.STAGE_OUTPUT_DIGEST: output,
    }
    for span, attributes in ((request, request_content), (decode, decode_content)):
        for key, value in attributes.items():
            span.attributes.add(key=key, value={"string_value": value})

"""Who deviates: majority outputs, deviating requests and their baselines, computed in ClickHouse.

Requests are grouped by ``InputDigest``; a group's majority output is its most common output when
at least two requests share it and no other output is as common. A request deviates when its
output differs from its group's majority. Its baseline is the agreeing request of its group nearest
in time, on another host when there is one (so that the hardware differs). Grouping, majorities and
baselines run as SQL; only deviating requests come back, and the callers compare the stages of those
they analyse (``comparison.compare_stages``). The stage contrasts that weigh attribute differences run
here too.
"""

from __future__ import annotations

from dataclasses import dataclass

from stagetrace import config, conventions
from stagetrace.analysis.inventory import Inventory, value_sql
from stagetrace.store import Store

# Requests in the window (one per trace, by the conventions' root rule), latest trace per request ID (a retry
# reuses the ID).
# Nondeterministic requests (sampling without a seed) are left out: their outputs differ by design. Each
# request falls in an epoch, its side of every rollout's fleet-wide moment, and is compared only within it.
_IN_WINDOW = "Start >= fromUnixTimestamp64Nano({t0:Int64}) AND Start < fromUnixTimestamp64Nano({t1:Int64})"


# A request's side of every rollout of its own service (a rollout in one service is no move of another's requests).
EPOCH_SQL = "arrayMap((t, s) -> s = {service} AND {ts} >= t, {{epochs:Array(Int64)}}, {{epoch_services:Array(String)}})"


def _requests(only: str = "") -> str:
    """The window's requests; ``only``: a further condition on their trace IDs, ending in AND. Each with its peer
    key (``conventions.peer_sql``): requests are compared only with their peers."""
    epoch = EPOCH_SQL.format(service="ServiceName", ts="toUnixTimestamp64Nano(Start)")
    return f"""
    SELECT RequestId, argMax(TraceId, S) AS TraceId, argMax(InputDigest, S) AS InputDigest,
           argMax(OutputDigest, S) AS OutputDigest, max(S) AS Start, argMax(HostName, S) AS HostName,
           argMax(ServiceName, S) AS ServiceName, argMax(Model, S) AS Model,
           {epoch} AS Epoch, {conventions.peer_sql()} AS Peer
    FROM (SELECT RequestId, TraceId, InputDigest, OutputDigest, Start AS S, HostName, ServiceName, Model
          FROM ({conventions.requests_sql(_IN_WINDOW, "{db:Identifier}.stagetrace_requests", model=True)})
          WHERE {only}TraceId NOT IN ({
        conventions.nondeterministic_traces_sql(
            _IN_WINDOW, "{db:Identifier}.stagetrace_requests", "{db:Identifier}.stagetrace_stages"
        )
    }))
    GROUP BY RequestId
    HAVING InputDigest != ''"""


# Requests that sample nondeterministically by design, by the service of their root span (a fleet's services sample
# differently)
NONDETERMINISTIC_BY_SERVICE_SQL = f"""
SELECT ServiceName, count() FROM (
    SELECT TraceId, any(ServiceName) AS ServiceName FROM {{db:Identifier}}.stagetrace_requests
    WHERE {_IN_WINDOW} AND TraceId IN ({
    conventions.nondeterministic_traces_sql(
        _IN_WINDOW, "{db:Identifier}.stagetrace_requests", "{db:Identifier}.stagetrace_stages"
    )
})
    GROUP BY TraceId)
GROUP BY ServiceName ORDER BY count() DESC, ServiceName"""


REFERENCES = 2  # other requests with the majority output that a TP stage's ranks are checked against (``confirmed``)


def _pairs(requests: str, references: int = 0) -> str:
    """Each deviating request with its baseline, in one pass over ``requests``: the members of an input group are
    gathered into an array, and its majority and the baselines found with array functions. ``references``: a 14th
    column, the trace IDs of that many other agreeing members nearest the request in time (``comparison.confirmed``)."""
    refs = (
        ""
        if not references
        else f""", arraySlice(arrayMap(a -> tupleElement(a, 2), arraySort(
           a -> (abs(tupleElement(a, 4) - tupleElement(d, 4)), tupleElement(a, 1)),
           arrayFilter(a -> tupleElement(a, 1) != tupleElement(b, 1), agreeing))), 1, {int(references)})"""
    )
    return f"""
SELECT tupleElement(d, 1), tupleElement(d, 2), InputDigest, tupleElement(d, 3), Majority, Support, length(members),
       tupleElement(d, 4), tupleElement(d, 5), tupleElement(b, 1), tupleElement(b, 2), tupleElement(d, 6),
       tupleElement(d, 7){refs}
FROM (
    SELECT InputDigest, members, Majority, Support,
           arrayFilter(m -> tupleElement(m, 3) = Majority, members) AS agreeing,
           arrayFilter(m -> tupleElement(m, 3) != Majority, members) AS deviating
    FROM (
        SELECT InputDigest, members, arrayMap(m -> tupleElement(m, 3), members) AS outs, arrayDistinct(outs) AS outputs,
               arrayMap(o -> countEqual(outs, o), outputs) AS counts,
               arrayMax(counts) AS Support, outputs[indexOf(counts, Support)] AS Majority
        FROM (SELECT InputDigest, groupArray((RequestId, TraceId, OutputDigest, toUnixTimestamp64Nano(Start), HostName,
                                             ServiceName, Model)) AS members
              FROM ({requests}) GROUP BY InputDigest, Epoch, Peer)
        WHERE Support >= 2 AND countEqual(counts, Support) = 1)
    WHERE notEmpty(deviating))
ARRAY JOIN deviating AS d
-- ties go to the earlier request, so that the baseline does not depend on the order rows were read in
ARRAY JOIN [arraySort(a -> (tupleElement(a, 5) = tupleElement(d, 5), abs(tupleElement(a, 4) - tupleElement(d, 4)),
                            tupleElement(a, 4), tupleElement(a, 1)), agreeing)[1]] AS b
ORDER BY tupleElement(d, 4)
"""


# A live pass's groups: only the window's requests whose input also arrived in [inputs_from, t1), so that grouping
# costs what the new traffic's groups cost, not the window's. Those groups are whole: their deviations are the same.
_NEW_INPUTS = (
    """TraceId IN (
              SELECT TraceId FROM {db:Identifier}.stagetrace_requests WHERE %s AND InputDigest IN (
                  SELECT InputDigest FROM {db:Identifier}.stagetrace_requests
                  WHERE Start >= fromUnixTimestamp64Nano({inputs_from:Int64})
                        AND Start < fromUnixTimestamp64Nano({t1:Int64}) AND InputDigest != ''))
          AND """
    % _IN_WINDOW
)
PAIRS_SQL = _pairs(_requests())
PAIRS_OF_NEW_INPUTS_SQL = _pairs(_requests(_NEW_INPUTS))


@dataclass
class Deviation:
    """A request whose output differs from its group's majority, its baseline, and the stage where it first differed."""

    request_id: str
    trace_id: str
    input_digest: str
    output_digest: str
    majority_output: str
    support: int  # requests with the majority output
    group_size: int  # requests with this input
    start_ns: int
    host: str
    baseline_request_id: str
    baseline_trace_id: str
    service: str = ""  # the service of the request's root span
    model: str = ""  # the model it names: on its root rows, else a span below (``conventions.request_model``)

    @property
    def peer(self) -> tuple[str, str]:
        """The request's peer key (``conventions.peer_of``) under the configured key."""
        return conventions.peer_of(self.service, self.model, config.peer_key())


def _window(store: Store, t0_ns: int, t1_ns: int, epochs=()) -> dict:
    """The parameters of a window; ``epochs``: (fleet-wide moment, service) of each rollout."""
    epochs = sorted(epochs)
    return {
        "db": store.database,
        "t0": t0_ns,
        "t1": t1_ns,
        "epochs": [t for t, _ in epochs],
        "epoch_services": [s for _, s in epochs],
        **conventions.peer_parameters(config.peer_key()),
    }


def epochs_of(found_rollouts) -> list[tuple[int, str]]:
    """The epochs (``_window``) the rollouts make."""
    return [(r.fleet_ns, r.service) for r in found_rollouts]


def deviations(store: Store, t0_ns: int, t1_ns: int, epochs=(), inputs_from_ns: int = 0) -> list[Deviation]:
    """Every deviating request that started in [t0, t1), oldest first, with its baseline among its peers.

    ``epochs``: (fleet-wide moment, service) of rollouts; a service's requests are compared only with those on the
    same sides of its own. ``inputs_from_ns``: only the groups of inputs that arrived in [inputs_from, t1) (the
    live analyser's new ones).
    """
    parameters = _window(store, t0_ns, t1_ns, epochs)
    if inputs_from_ns:
        parameters["inputs_from"] = inputs_from_ns
    sql = PAIRS_OF_NEW_INPUTS_SQL if inputs_from_ns else PAIRS_SQL
    rows = store.client.query(sql, parameters=parameters).result_rows
    return [
        Deviation(rid, tid, din, dout, maj, int(sup), int(size), int(start), host, base_rid, base_tid, service, model)
        for (rid, tid, din, dout, maj, sup, size, start, host, base_rid, base_tid, service, model) in rows
    ]


REQUESTS_IN_SQL = """
SELECT count() FROM {db:Identifier}.stagetrace_requests
WHERE Start >= fromUnixTimestamp64Nano({t0:Int64}) AND Start < fromUnixTimestamp64Nano({t1:Int64})"""


def requests_in(store: Store, t0_ns: int, t1_ns: int) -> int:
    """How many requests started in [t0, t1)."""
    return int(store.client.command(REQUESTS_IN_SQL, parameters={"db": store.database, "t0": t0_ns, "t1": t1_ns}))


def nondeterministic_by_service(store: Store, t0_ns: int, t1_ns: int) -> dict[str, int]:
    """How many requests in [t0, t1) sample nondeterministically by design, by service, most first."""
    rows = store.client.query(
        NONDETERMINISTIC_BY_SERVICE_SQL, parameters={"db": store.database, "t0": t0_ns, "t1": t1_ns}
    ).result_rows
    return {service: int(n) for service, n in rows}


@dataclass
class Member:
    request_id: str
    trace_id: str
    start_ns: int
    host: str


def nearest(members: list[Member], start_ns: int, host: str) -> Member | None:
    """The baseline among agreeing requests: on another host if one exists (to tell hardware apart), nearest in time;
    ties to the earlier request, as ``PAIRS_SQL`` breaks them (not to whichever the store read first: other services'
    rows change that order)."""
    return min(
        members, key=lambda m: (m.host == host, abs(m.start_ns - start_ns), m.start_ns, m.request_id), default=None
    )


def contrast(
    store: Store,
    stage: str,
    keys: list[str],
    t0_ns: int,
    t1_ns: int,
    found_rollouts=(),
    majority_window: tuple[int, int] | None = None,
    margin_ns: int = 60_000_000_000,
    inventory: Inventory | None = None,
    peer: tuple[str, str] | None = None,
):
    """One stage's :func:`contrasts` among one peer key's requests (``Deviation.peer``); None: the window's only one."""
    found = contrasts(store, {stage: keys}, t0_ns, t1_ns, found_rollouts, majority_window, margin_ns, inventory)
    if peer is None:
        return found[next(iter(found))] if len(found) == 1 else None
    return found.get((stage, peer))


def contrasts(
    store: Store,
    keys: dict[str, list[str]],
    t0_ns: int,
    t1_ns: int,
    found_rollouts=(),
    majority_window: tuple[int, int] | None = None,
    margin_ns: int = 60_000_000_000,
    inventory: Inventory | None = None,
    sample: int = 1,
) -> dict:
    """Per (stage, peer key), counts for :class:`~stagetrace.analysis.causes.Contrast` over its spans in [t0, t1).

    A span *diverged first at the stage* when its output differs from the majority output of the stage's
    spans with the same stage input among its request's peers (same service and model: ``conventions.peer_sql``),
    within the same rollout epochs of its service, over ``majority_window`` (default the window itself). Spans of
    nondeterministic requests, and those a rollout's wave explains, are no evidence either way (in the majority, a
    span's own sampling attributes decide, so that the scan stays narrow). Settings are counted by value and
    measurements by bucket; a key with a distinct value on nearly every span is an identifier and comes
    back as one summary row, not a row per span. A span whose process recorded no GPU model or driver is counted
    with its value in the ``inventory`` (``analysis.inventory``), as the spans compared were. ``sample``: count
    the spans of one input in ``sample`` (chosen by the input's digest, so that each counted group is whole).

    Several faults at once: a value that diverged far more often than the rest of its stage (``causes.suspect``'s
    rule, over every setting and identity the spans record, under any name) *explains* its divergences. Per key, a
    diverged span that another key's suspect value explains is counted apart (``explained``), so that weighing a
    key's baseline value can set it aside: one host's fault does not count against another's cause.
    """
    from stagetrace.analysis.causes import RESOURCE, Contrast, is_measurement

    pairs = [(stage, key) for stage, ks in sorted(keys.items()) for key in sorted(set(ks))]
    if not pairs:
        return {}
    w0, w1 = majority_window or (t0_ns, t1_ns)
    waves = [r for r in found_rollouts if r.stage in keys]
    peer_key = config.peer_key()
    epochs = sorted(epochs_of(found_rollouts))
    params = {
        "db": store.database,
        "stages": [s for s, _ in pairs],
        "keys": [k for _, k in pairs],
        "measured": [k for _, k in pairs if is_measurement(k)],
        "t0": t0_ns - margin_ns,
        "t1": t1_ns + margin_ns,
        "w0": w0 - margin_ns,
        "w1": w1 + margin_ns,
        "epochs": [t for t, _ in epochs],
        "epoch_services": [s for _, s in epochs],
        "rs": [r.stage for r in waves],
        "rsv": [r.service for r in waves],
        "rk": [r.key for r in waves],
        "rold": [r.old for r in waves],
        "rnew": [r.new for r in waves],
        "rt": [r.fleet_ns for r in waves],
        "runtil": [r.until_ns for r in waves],
        "sample": max(1, sample),
        **conventions.peer_parameters(peer_key),
    }
    # Each service's requests resolve to one model in almost every window (``models_by_service``: by the request's
    # service and model, which an engine's span of another service may name): then the service alone tells peers apart
    # as the (service, model) key does, and the spans' models need not be read (a join that costs as much as the
    # contrast)
    models = conventions.PEER_MODEL in peer_key
    if models and conventions.PEER_SERVICE in peer_key:
        by_service = models_by_service(store, min(t0_ns, w0) - margin_ns, max(t1_ns, w1) + margin_ns)
        if all(len(m) <= 1 for m in by_service.values()):
            models, params["peer_model"] = False, 0
    result = []
    for stage in sorted(keys):  # one query per stage: each reads only its stage's part of the table (by stage, time)
        stage_keys = [k for s, k in pairs if s == stage]
        # the inventory's entries of the GPU settings weighed here; none: the query that reads no inventory, as cheap
        # as without one
        resource_names = [k.removeprefix(RESOURCE) for k in stage_keys if k.startswith(RESOURCE)]
        entries = inventory.entries(resource_names) if inventory else {}
        stage_params = {**params, "stages": [stage] * len(stage_keys), "keys": stage_keys}
        if entries:
            stage_params.update({"ik": list(entries), "iv": list(entries.values())})
        rows = store.client.query(CONTRAST_SQLS[(bool(waves), bool(entries), models)], parameters=stage_params)
        for service, model, kind, key, value, profile, n, d in rows.result_rows:
            if conventions.PEER_MODEL in peer_key and not models:  # the service's one model, as the key has it
                model = next(iter(by_service.get(service) or [""]))
            result.append((stage, (service, model), kind, key, value, profile, int(n), int(d)))
    return _weighed(result)


def _weighed(rows) -> dict:
    """The :class:`Contrast` of each (stage, peer key) from the contrast query's rows: (stage, peer, kind, key, value,
    profile, spans, diverged), where kind 0 counts a weighed key's value, 1 a recorded setting's or identity's, and 2
    the diverged spans of one profile (their weighed keys' values and recorded pairs): ``causes.suspect`` values, and
    per weighed (key, value) the diverged spans another key's suspect value explains."""
    from stagetrace.analysis.causes import IDENTIFIER_SHARE, IDENTIFIER_SPANS, Contrast, suspect

    out = {}
    by: dict[tuple, list] = {}
    for stage, peer, *row in rows:
        by.setdefault((stage, peer), []).append(row)
    for at, items in by.items():
        counts = {(key, value): (n, d) for kind, key, value, _, n, d in items if kind == 0}
        per_key: dict[str, list[tuple[int, int]]] = {}
        for (key, _), nd in counts.items():
            per_key.setdefault(key, []).append(nd)
        # every span counts once for each weighed key: the stage's spans and diverged ones, from any of them
        spans, diverged = (sum(x) for x in zip(*next(iter(per_key.values()), [(0, 0)])))
        identifiers = {
            key
            for key, nds in per_key.items()
            if sum(n for n, _ in nds) >= IDENTIFIER_SPANS and len(nds) >= IDENTIFIER_SHARE * sum(n for n, _ in nds)
        }
        counts = {kv: nd for kv, nd in counts.items() if kv[0] not in identifiers}
        suspects = {(key, value) for kind, key, value, _, n, d in items if kind == 1 and suspect(n, d, spans, diverged)}
        explained: dict[tuple[str, str], int] = {}
        for kind, _, _, profile, _, d in items:
            if kind != 2:
                continue
            weighed = [(k, v) for k, v in profile if k.startswith("\0")]
            recorded = [(k, v) for k, v in profile if not k.startswith("\0")]
            for k, v in weighed:
                key = k[1:]
                if any(rk != key and (rk, rv) in suspects for rk, rv in recorded):
                    explained[(key, v)] = explained.get((key, v), 0) + d
        out[at] = Contrast(counts, spans, diverged, frozenset(identifiers), explained)
    return out


# the models each service's requests named in a window (``contrasts``), by their root rows alone: where no span below
# a root names one (``stagetrace_models`` holds no row in the window), a request's model is its roots'
_MODEL_WINDOW = "Start >= fromUnixTimestamp64Nano({t0:Int64}) AND Start <= fromUnixTimestamp64Nano({t1:Int64})"
MODELS_BY_SERVICE_SQL = f"""
SELECT ServiceName, groupUniqArray(2)(Model) FROM {{db:Identifier}}.stagetrace_requests WHERE {_MODEL_WINDOW}
GROUP BY ServiceName"""

# whether any span below a root names a model in the window
MODEL_ROWS_SQL = (
    f"SELECT count() FROM (SELECT 1 FROM {{db:Identifier}}.stagetrace_models WHERE {_MODEL_WINDOW} LIMIT 1)"
)

# The same where spans below the roots name models: each request's model by ``conventions.requests_sql``'s rule (its
# root rows' first, else the decode span's, else the earliest span's), counted under the request's service, that of
# its root rows (an engine's span that names the model may be of another service: an application's root of service
# `app` above vLLM's). In one pass over the root rows and the rows that name a model, grouped by trace (by the trace
# ID's hash: a number groups faster than a string; a collision merges two traces' models into one trace's, rarely
# enough for a check whose error is a join more or less). A service's own spans that name a model below another's
# roots count that model under the service too: the contrast keys a span by its own service.
_ROOT_KEY = conventions.ROOT_ORDER_SQL.format(start="Start")  # the roots' order, as requests_sql reads them
REQUEST_MODELS_BY_SERVICE_SQL = f"""
SELECT ServiceName, groupUniqArray(2)(Model) FROM (
    SELECT argMinIf(ServiceName, Key, Tier = 0) AS ServiceName,
           argMinIf(Model, (Tier, Key, Model), Model != '') AS Model
    FROM (SELECT cityHash64(TraceId) AS Trace, toUInt8(0) AS Tier, {_ROOT_KEY} AS Key, ServiceName, Model
          FROM {{db:Identifier}}.stagetrace_requests WHERE {_MODEL_WINDOW}
          UNION ALL
          SELECT cityHash64(TraceId) AS Trace, toUInt8(1 + (Stage != '{conventions.MODEL_STAGE}')) AS Tier,
                 toUInt64(toUnixTimestamp64Nano(Start)) AS Key, ServiceName, Model
          FROM {{db:Identifier}}.stagetrace_models WHERE {_MODEL_WINDOW})
    GROUP BY Trace
    HAVING countIf(Tier = 0) > 0  -- a request of the window
    UNION ALL
    SELECT ServiceName, Model FROM {{db:Identifier}}.stagetrace_models WHERE {_MODEL_WINDOW})
GROUP BY ServiceName"""


def models_by_service(store: Store, t0_ns: int, t1_ns: int) -> dict[str, list[str]]:
    """Service → up to two of the models its requests that started in [t0, t1] resolve to ('' for none), by the
    request's service and ``conventions.requests_sql``'s rule: one model means the service alone tells its requests'
    peers apart."""
    parameters = {"db": store.database, "t0": t0_ns, "t1": t1_ns}
    below = int(store.client.command(MODEL_ROWS_SQL, parameters=parameters))
    sql = REQUEST_MODELS_BY_SERVICE_SQL if below else MODELS_BY_SERVICE_SQL
    return {service: list(models) for service, models in store.client.query(sql, parameters=parameters).result_rows}


def _contrast_sql(waves: bool, inventory: bool = False, models: bool = True) -> str:
    """The contrast query; with ``inventory``, a resource attribute a span lacks is read from the GPU inventory's
    entries (parameters ``ik`` and ``iv``: ``inventory.value_sql``); with ``models``, the spans' requests' models are
    read for their peer keys (a key without the model does not read them)."""
    from stagetrace.analysis.causes import BUCKET_SQL, RESOURCE

    def value(k: str) -> str:
        """A span's value of the contrast key ``k`` (an SQL expression)."""
        name = f"substring({k}, {len(RESOURCE) + 1})"
        resource = f"ResourceAttributes[{name}]"
        if inventory:  # never over what the process recorded
            resource = f"if({resource} != '', {resource}, {value_sql(name)})"
        return f"if(startsWith({k}, '{RESOURCE}'), {resource}, Attributes[{k}])"

    ts = "toUnixTimestamp64Nano(Start)"
    # a rollout's wave (of the span's own service): the new value before the fleet moved, or the old one while the
    # wave still rolled
    wave = (
        f"arrayExists((s, sv, k, o, n, t, u) -> s = Stage AND sv = ServiceName "
        f"AND (({value('k')} = n AND {ts} < t) OR ({value('k')} = o AND {ts} >= t AND {ts} <= u)), {{rs:Array(String)}}, {{rsv:Array(String)}}, "
        "{rk:Array(String)}, {rold:Array(String)}, {rnew:Array(String)}, {rt:Array(Int64)}, {runtil:Array(Int64)})"
    )

    def comparable(t0: str, t1: str, whole_requests: bool) -> str:
        window = (
            f"Start >= fromUnixTimestamp64Nano({{{t0}:Int64}}) AND Start <= fromUnixTimestamp64Nano({{{t1}:Int64}})"
        )
        # a span's own sampling always; its request's (which may say so on another span) where it is counted
        unseeded = (
            "TraceId NOT IN ("
            + conventions.nondeterministic_traces_sql(
                window, "{db:Identifier}.stagetrace_requests", "{db:Identifier}.stagetrace_stages"
            )
            + ")"
            if whole_requests
            else "Nondeterministic = ''"
        )
        # without rollouts the wave test is left out: it would read every span's attribute maps
        return (
            f"{window} AND Stage IN {{stages:Array(String)}} AND InputDigest != '' AND {unseeded}"
            " AND cityHash64(InputDigest) % {sample:UInt64} = 0" + (f" AND NOT {wave}" if waves else "")
        )

    def with_model(spans: str, t0: str, t1: str) -> str:
        """``spans`` (a subquery with TraceId) with the model of each span's request ('' without ``models``)."""
        if not models:
            return f"SELECT *, '' AS Model FROM ({spans})"
        window = (
            f"Start >= fromUnixTimestamp64Nano({{{t0}:Int64}}) AND Start <= fromUnixTimestamp64Nano({{{t1}:Int64}})"
        )
        named = conventions.trace_models_sql(
            f"SELECT TraceId FROM ({spans})", window, "{db:Identifier}.stagetrace_requests"
        )
        return f"""SELECT s.*, m.RequestModel AS Model FROM ({spans}) AS s
            LEFT JOIN (SELECT TraceId, Model AS RequestModel FROM ({named})) AS m ON s.TraceId = m.TraceId"""

    epoch = EPOCH_SQL.format(service="ServiceName", ts=ts)
    peer = conventions.peer_sql("ServiceName", "Model")
    host = ", HostName" if inventory else ""
    # The attribute names a counted span keeps: the weighed keys, the GPU's UUID (the inventory's lookup) and every
    # candidate (``conventions.candidate_sql``). The rule runs once per distinct name in the window rather than on
    # every span's every attribute (a million spans' attributes cost a second of CPU); what it drops (digests,
    # content, measurements) is what makes each span's attributes unique, so the spans fold into few profiles below.
    kept = f"""(SELECT arrayFilter(k -> k IN {{keys:Array(String)}} OR k = '{conventions.GPU_UUID}'
                                     OR {conventions.candidate_sql("k")}, groupUniqArrayArray(mapKeys(Attributes)))
        FROM {{db:Identifier}}.stagetrace_stages
        WHERE Start >= fromUnixTimestamp64Nano({{t0:Int64}}) AND Start <= fromUnixTimestamp64Nano({{t1:Int64}})
              AND Stage IN {{stages:Array(String)}})"""
    # every setting and identity a span records, as (contrast key, value): what may explain its divergence
    recorded = (
        "arrayConcat(arrayFilter(p -> {a}, arrayZip(mapKeys(Attributes), mapValues(Attributes))), "
        "arrayMap(p -> (concat('{r}', tupleElement(p, 1)), tupleElement(p, 2)), arrayFilter(p -> {a}, "
        "arrayZip(mapKeys(ResourceAttributes), mapValues(ResourceAttributes)))))"
    ).format(a=conventions.candidate_sql("tupleElement(p, 1)"), r=RESOURCE)
    counted_spans = f"""SELECT Stage, TraceId, InputDigest, OutputDigest, ServiceName, Start, Attributes,
               ResourceAttributes{host}
        FROM {{db:Identifier}}.stagetrace_stages WHERE {comparable("t0", "t1", True)}"""
    majority_spans = f"""SELECT Stage, TraceId, InputDigest, OutputDigest, ServiceName, Start
                FROM {{db:Identifier}}.stagetrace_stages
                WHERE InputDigest IN (SELECT InputDigest FROM counted) AND {comparable("w0", "w1", False)}"""
    return f"""
WITH {kept} AS Kept,
counted AS (
    SELECT Stage, InputDigest, OutputDigest, {epoch} AS Epoch, {peer} AS Peer,
           mapFilter((k, v) -> has(Kept, k), Attributes) AS Attributes, ResourceAttributes{host}
    FROM ({with_model(counted_spans, "t0", "t1")})),
majority AS (
    SELECT Stage, InputDigest, Epoch, Peer, outputs[indexOf(counts, top)] AS Majority
    FROM (SELECT Stage, InputDigest, Epoch, Peer, groupArray(OutputDigest) AS outs, arrayDistinct(outs) AS outputs,
                 arrayMap(o -> countEqual(outs, o), outputs) AS counts, arrayMax(counts) AS top
          FROM (SELECT Stage, InputDigest, OutputDigest, {epoch} AS Epoch, {peer} AS Peer
                FROM ({with_model(majority_spans, "w0", "w1")}))
          GROUP BY Stage, InputDigest, Epoch, Peer)
    WHERE top >= 2 AND countEqual(counts, top) = 1),
-- the judged spans folded by profile (peer, diverged or not, what they recorded): a process's spans are alike, so
-- the values below unfold once per profile, not once per span
profiles AS (
    SELECT Peer, Diverged, Attributes, ResourceAttributes{host}, count() AS Spans
    FROM (SELECT c.Peer AS Peer, c.OutputDigest != m.Majority AS Diverged, c.Attributes AS Attributes,
                 c.ResourceAttributes AS ResourceAttributes{host.replace("HostName", "c.HostName AS HostName")}
          FROM counted AS c
          INNER JOIN majority AS m ON c.Stage = m.Stage AND c.InputDigest = m.InputDigest AND c.Epoch = m.Epoch
                                      AND c.Peer = m.Peer)
    GROUP BY Peer, Diverged, Attributes, ResourceAttributes{host}),
judged AS (
    SELECT Peer, Diverged, Spans,
           -- the weighed keys' values, measurements by magnitude, each key marked with a leading NUL
           arrayMap(k -> (concat('\\0', k), if(k IN {{measured:Array(String)}}, {BUCKET_SQL.replace("{v}", value("k"))},
                                                {value("k")})), {{keys:Array(String)}}) AS Weighed,
           {recorded} AS Recorded
    FROM profiles)
-- one pass: each weighed value (kind 0), each recorded setting or identity (1), and each diverged span's profile (2)
SELECT tupleElement(Peer, 1), tupleElement(Peer, 2), tupleElement(item, 1) AS kind, tupleElement(item, 2),
       tupleElement(item, 3), tupleElement(item, 4), sum(Spans), sumIf(Spans, Diverged)
FROM judged
ARRAY JOIN arrayConcat(arrayMap(p -> (0, substring(tupleElement(p, 1), 2), tupleElement(p, 2), []), Weighed),
                       arrayMap(p -> (1, tupleElement(p, 1), tupleElement(p, 2), []), Recorded),
                       if(Diverged, [(2, '', '', arrayConcat(Weighed, Recorded))], [])) AS item
GROUP BY Peer, item"""


# by (rollouts' waves left out, the GPU inventory read, the requests' models read)
CONTRAST_SQLS = {
    (waves, inventory, models): _contrast_sql(waves, inventory, models)
    for waves in (False, True)
    for inventory in (False, True)
    for models in (False, True)
}


# Where every deviating request first differs from its baseline, for the tally of ``divergences`` (which covers all
# of them, not only those analysed in full). The SQL twin of ``comparison.compare_stages`` and ``first_divergence`` at
# the level of whole stages: a stage's output is the set of its spans' outputs (every rank and pass: a TP group on
# several hosts compares with an engine's one span by its outputs, as there), a stage one side lacks differs, and
# stages go in pipeline order, then by start. Its attributes are those of the first pass of the rank that began the
# difference (``ranks.locate``'s rule: the ranks whose input, or step input where both record them, first differs
# from the baseline's same rank while other ranks' match; else the lowest rank), against the baseline's same rank;
# only those that differ come back (with the request's and the baseline's values), so the rows stay small. Where
# several ranks began it against the baseline, they are checked against ``REFERENCES`` other requests with the
# majority output, nearest in time, as ``comparison.confirmed`` checks them: a rank is kept when it began the difference
# against most of the baseline and those (the baseline may carry a masked difference of its own on a rank).
# ``pairs``: the deviations (``_pairs``, with their references), read in the same query rather than sent as
# parameters (100,000 trace IDs bound as an array took 43 s to parse in chdb, far more than grouping again).
def _first_differences(pairs: str) -> str:
    stages = "[" + ", ".join(f"'{s}'" for s in conventions.PIPELINE_STAGES) + "]"
    differing = """arrayMap(k -> (k, mine[k], theirs[k]), arrayFilter(k -> mine[k] != theirs[k],
                     arrayDistinct(arrayConcat(mapKeys(mine), mapKeys(theirs)))))"""
    steps, gpu, host = conventions.STAGE_STEP_INPUT_DIGESTS, conventions.GPU_UUID, conventions.HOST
    gpus = conventions.CONFIGURATION_GPU_UUIDS  # the one GPU a rank process could see (``ranks.gpu_of``)

    # per rank of the request's stage: where its input first differs from the baseline's same rank (1-based step,
    # 1 for the input as a whole, 0 nowhere); with steps only where every rank on both sides records them
    def where(ranks: str, steps: str, inputs: str) -> str:
        """Per rank of the request's stage against another's (the baseline's, or a reference's): its ``ranks``,
        their ``steps`` and ``inputs`` (expressions)."""
        theirs_at = f"indexOf({ranks}, r)"
        step_at = (
            f"arrayFirstIndex(k -> splitByChar(',', s)[k] != splitByChar(',', {steps}[{theirs_at}])[k], "
            f"range(1, greatest(length(splitByChar(',', s)), "
            f"length(splitByChar(',', {steps}[{theirs_at}]))) + 1))"
        )
        return (
            f"if(arrayAll(x -> x != '', arrayConcat(m.Steps, {steps})), arrayMap((r, s) -> {step_at}, m.Ranks, "
            f"m.Steps), arrayMap((r, i) -> toUInt64(i != {inputs}[{theirs_at}]), m.Ranks, m.Inputs))"
        )

    def began(ranks: str, at: str) -> str:
        """The ranks that began it against another stage of ``ranks`` by their contribution (only some ranks' inputs
        differ at the earliest place, ``at`` per rank; both ran the same ranks), else []: ``ranks.locate``'s INPUT."""
        first = f"arrayMin(arrayFilter(a -> a > 0, {at}))"
        return (
            f"if(arrayExists(a -> a > 0, {at}) AND countEqual({at}, {first}) < length({at}) "
            f"AND arrayAll(r -> has({ranks}, r), m.Ranks) AND length(m.Ranks) = length({ranks}), "
            f"arrayFilter((r, a) -> a = {first}, m.Ranks, {at}), [])"
        )

    lowest = "arraySort(x -> (toUInt64OrZero(x), x), {r})[1]"
    return f"""
WITH pairs AS (SELECT c2 AS Dev, c11 AS Base, c14 AS Refs
               FROM ({pairs}) AS p(c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14)),
rank_passes AS (
    SELECT TraceId, Stage, Rank, min(Start) AS First, groupUniqArray(OutputDigest) AS Outputs,
           argMin(InputDigest, Start) AS Input, argMin(Attributes['{steps}'], Start) AS Steps,
           argMin(Attributes, Start) AS Attrs, argMin(ResourceAttributes, Start) AS Resource,
           -- a ranked stage's spans, each with its output and place, in start order: where the rank's difference
           -- showed first (``ranks.at``); an unranked stage has no rank to place (and costs no array)
           arraySort(p -> p.1, groupArrayIf((Start, OutputDigest, Attributes['{gpu}'], ResourceAttributes['{gpu}'],
                                             ResourceAttributes['{gpus}'], ResourceAttributes['{host}']),
                                            Rank != '')) AS Spans,
           groupUniqArrayIf(OutputDigest, Rank != '') AS SpanOutputs  -- Outputs, by a name passes' does not hide
    FROM {{db:Identifier}}.stagetrace_stages
    WHERE Start >= fromUnixTimestamp64Nano({{s0:Int64}}) AND Start < fromUnixTimestamp64Nano({{s1:Int64}})
      AND TraceId IN (SELECT Dev FROM pairs UNION ALL SELECT Base FROM pairs)
    GROUP BY TraceId, Stage, Rank),
-- the references' ranked stages only (a stage without ranks has no rank to confirm): where no stage records ranks,
-- they cost a scan of the Rank column
ref_passes AS (
    SELECT TraceId, Stage, groupArray(Rank) AS Ranks, groupArray(Input) AS Inputs, groupArray(Steps) AS Steps
    FROM (SELECT TraceId, Stage, Rank, argMin(InputDigest, Start) AS Input,
                 argMin(Attributes['{steps}'], Start) AS Steps
          FROM {{db:Identifier}}.stagetrace_stages
          WHERE Start >= fromUnixTimestamp64Nano({{s0:Int64}}) AND Start < fromUnixTimestamp64Nano({{s1:Int64}})
            AND Rank != '' AND TraceId IN (SELECT arrayJoin(Refs) FROM pairs)
          GROUP BY TraceId, Stage, Rank)
    GROUP BY TraceId, Stage),
passes AS (
    SELECT TraceId, Stage, min(First) AS First, arraySort(arrayDistinct(arrayFlatten(groupArray(Outputs)))) AS Outputs,
           groupArray(Rank) AS Ranks, groupArray(Input) AS Inputs, groupArray(Steps) AS Steps,
           groupArray(Attrs) AS Attrs, groupArray(Resource) AS Resources, groupArray(Spans) AS RankSpans,
           groupArray(SpanOutputs) AS RankOutputs
    FROM rank_passes GROUP BY TraceId, Stage),
mine AS (SELECT Dev, Stage, First, Outputs, Ranks, Inputs, Steps, Attrs, Resources, RankSpans,
                length(Refs) AS References
         FROM pairs INNER JOIN passes ON passes.TraceId = pairs.Dev),
theirs AS (SELECT Dev, Stage, First, Outputs, Ranks, Inputs, Steps, Attrs, Resources, RankOutputs
           FROM pairs INNER JOIN passes ON passes.TraceId = pairs.Base),
-- per request and stage, the references' ranks, inputs and steps (a reference without the stage: none)
refs AS (
    SELECT Dev, Stage, groupArray(Ranks) AS RefRanks, groupArray(Inputs) AS RefInputs, groupArray(Steps) AS RefSteps
    FROM (SELECT Dev, arrayJoin(Refs) AS Ref FROM pairs) AS r INNER JOIN ref_passes ON ref_passes.TraceId = r.Ref
    GROUP BY Dev, Stage)
SELECT Dev, argMin((Stage, Attributes, ResourceAttributes, Began, BeganGpu, BeganHost), Place)
FROM (
    SELECT Dev, Stage, Place, Began,
           if(notEmpty(BeganSpans),
              multiIf(BeganSpan.3 != '', BeganSpan.3, BeganSpan.4 != '', BeganSpan.4,
                      position(BeganSpan.5, ',') = 0, BeganSpan.5, ''),
              multiIf(MineAttrs['{gpu}'] != '', MineAttrs['{gpu}'], MineResource['{gpu}'] != '', MineResource['{gpu}'],
                      position(MineResource['{gpus}'], ',') = 0, MineResource['{gpus}'], '')) AS BeganGpu,
           if(notEmpty(BeganSpans), BeganSpan.6, MineResource['{host}']) AS BeganHost,
           {differing.replace("mine", "MineAttrs").replace("theirs", "TheirAttrs")} AS Attributes,
           {differing.replace("mine", "MineResource").replace("theirs", "TheirResource")} AS ResourceAttributes
    FROM (
        SELECT Dev, Stage, (if(indexOf({stages}, Stage) = 0, {len(conventions.PIPELINE_STAGES) + 1},
                                indexOf({stages}, Stage)), if(empty(t.Outputs), m.First, t.First)) AS Place,
               {where("t.Ranks", "t.Steps", "t.Inputs")} AS At,
               -- the ranks that began it, when only some ranks' inputs differ at the earliest place; else the lowest.
               -- Several: those that began it against most of the baseline and the references, where any did
               {began("t.Ranks", "At")} AS Against,
               arrayFlatten(arrayMap((rr, rs, ri) -> {began("rr", where("rr", "rs", "ri"))}, v.RefRanks, v.RefSteps,
                                     v.RefInputs)) AS Voted,
               arrayFilter(r -> 2 * (has(Against, r) + countEqual(Voted, r)) > 1 + m.References,
                           arrayDistinct(arrayConcat(Against, Voted))) AS Kept,
               if(notEmpty(Against),
                  {lowest.format(r="if(length(Against) > 1 AND notEmpty(Kept), Kept, Against)")},
                  {lowest.format(r="m.Ranks")}) AS Began,
               m.Attrs[indexOf(m.Ranks, Began)] AS MineAttrs, m.Resources[indexOf(m.Ranks, Began)] AS MineResource,
               if(has(t.Ranks, Began), indexOf(t.Ranks, Began),
                  indexOf(t.Ranks, {lowest.format(r="t.Ranks")})) AS TheirIndex,
               t.Attrs[TheirIndex] AS TheirAttrs, t.Resources[TheirIndex] AS TheirResource,
               -- the began rank's first span whose output is none of the baseline's same rank's, else its first
               m.RankSpans[indexOf(m.Ranks, Began)] AS BeganSpans,
               if(has(t.Ranks, Began), t.RankOutputs[indexOf(t.Ranks, Began)], []) AS TheirOutputs,
               arrayFirstIndex(p -> p.2 != '' AND notEmpty(TheirOutputs) AND NOT has(TheirOutputs, p.2),
                               BeganSpans) AS ShownAt,
               BeganSpans[if(ShownAt = 0, 1, ShownAt)] AS BeganSpan
        FROM mine AS m FULL OUTER JOIN theirs AS t USING (Dev, Stage) LEFT JOIN refs AS v USING (Dev, Stage)
        WHERE m.Outputs != t.Outputs))
GROUP BY Dev"""


FIRST_DIFFERENCES_SQL = _first_differences(_pairs(_requests(), REFERENCES))
FIRST_DIFFERENCES_OF_NEW_INPUTS_SQL = _first_differences(_pairs(_requests(_NEW_INPUTS), REFERENCES))


@dataclass
class Difference:
    """Where a deviating request first differs from its baseline (``first_differences``)."""

    stage: str
    attributes: list[tuple[str, str, str]]  # (name, value, baseline value) of the stage's span that differ
    resource: list[tuple[str, str, str]]  # the same of its resource
    rank: str = ""  # the TP rank whose span that is: the one that began the difference (``ranks.locate``'s rule)
    gpu: str = ""  # its GPU (the span's gpu.uuid, else its process's)
    host: str = ""  # its host


def first_differences(
    store: Store, t0_ns: int, t1_ns: int, window: tuple[int, int], epochs=(), inputs_from_ns: int = 0
) -> dict[str, Difference]:
    """Trace ID → where each of :func:`deviations` (same arguments) first differs from its baseline; the stage spans
    read within ``window``. A request none of whose recorded stages differs has no entry."""
    parameters = {**_window(store, t0_ns, t1_ns, epochs), "s0": window[0], "s1": window[1]}
    if inputs_from_ns:
        parameters["inputs_from"] = inputs_from_ns
    sql = FIRST_DIFFERENCES_OF_NEW_INPUTS_SQL if inputs_from_ns else FIRST_DIFFERENCES_SQL
    rows = store.client.query(sql, parameters=parameters).result_rows
    return {
        trace_id: Difference(stage, list(attributes), list(resource), rank, gpu, host)
        for trace_id, (stage, attributes, resource, rank, gpu, host) in rows
    }


# Other requests of a deviation's service with its input and its group's majority output, the earliest few of each:
# the references ``comparison.confirmed`` checks a TP stage's ranks against when several began the difference against
# the baseline (which agrees in output but may carry a masked difference of its own on a rank).
MAJORITY_MEMBERS_SQL = f"""
SELECT ServiceName, InputDigest, OutputDigest, groupArray({{n:UInt32}})(TraceId)
FROM (SELECT ServiceName, InputDigest, OutputDigest, TraceId, Start
      FROM ({
    conventions.requests_sql(
        _IN_WINDOW + " AND InputDigest IN {inputs:Array(String)}", "{db:Identifier}.stagetrace_requests"
    )
})
      WHERE InputDigest IN {{inputs:Array(String)}} AND OutputDigest IN {{outputs:Array(String)}}
      ORDER BY Start, TraceId)
GROUP BY ServiceName, InputDigest, OutputDigest"""


def majority_members(store: Store, keys, t0_ns: int, t1_ns: int, n: int) -> dict[tuple[str, str, str], list[str]]:
    """(service, input, majority output) → the trace IDs of up to ``n`` requests in [t0, t1) of that service with
    both, earliest first."""
    keys = set(keys)
    if not keys:
        return {}
    rows = store.client.query(
        MAJORITY_MEMBERS_SQL,
        parameters={
            "db": store.database,
            "t0": t0_ns,
            "t1": t1_ns,
            "n": n,
            "inputs": sorted({i for _, i, _ in keys}),
            "outputs": sorted({o for _, _, o in keys}),
        },
    ).result_rows
    return {(s, i, o): list(tids) for s, i, o, tids in rows if (s, i, o) in keys}


# The rank that began a TP difference has an input of its own (its partial product differs), so the stage contrast,
# which judges a span among spans with the same stage input, never counts its settings as diverged. Per (stage, rank,
# service): each request's first pass of that rank, judged among the requests with the same request input: it began a
# difference when its first contribution (its first step's input where it records its steps, else its stage input)
# differs from the majority's of the same rank there. The first step, because later steps take in the sums of every
# rank: another rank's fault reaches them too (a setting that changes numerics changes the first one already).
# Counted per (key, value) of the weighed settings (``rank_contrasts``). Nondeterministic spans are no evidence.
RANK_CONTRAST_SQL = f"""
WITH spans AS (
    SELECT Stage, Rank, ServiceName, TraceId,
           argMin(if(Attributes['{conventions.STAGE_STEP_INPUT_DIGESTS}'] != '',
                     splitByChar(',', Attributes['{conventions.STAGE_STEP_INPUT_DIGESTS}'])[1], InputDigest),
                  Start) AS Input,
           argMin(Attributes, Start) AS Attrs, argMin(ResourceAttributes, Start) AS Resource
    FROM {{db:Identifier}}.stagetrace_stages
    WHERE Start >= fromUnixTimestamp64Nano({{t0:Int64}}) AND Start <= fromUnixTimestamp64Nano({{t1:Int64}})
      AND (Stage, Rank, ServiceName) IN {{wanted:Array(Tuple(String, String, String))}}
      AND InputDigest != '' AND Nondeterministic = ''
    GROUP BY Stage, Rank, ServiceName, TraceId),
requests AS (
    SELECT TraceId, any(InputDigest) AS RequestInput FROM {{db:Identifier}}.stagetrace_requests
    WHERE Start >= fromUnixTimestamp64Nano({{t0:Int64}}) AND Start <= fromUnixTimestamp64Nano({{t1:Int64}})
      AND InputDigest != '' AND TraceId IN (SELECT TraceId FROM spans)
    GROUP BY TraceId),
judged AS (
    SELECT s.Stage AS Stage, s.Rank AS Rank, s.ServiceName AS ServiceName, s.Input AS Input,
           r.RequestInput AS RequestInput, s.Attrs AS Attrs, s.Resource AS Resource
    FROM spans AS s INNER JOIN requests AS r ON s.TraceId = r.TraceId),
majority AS (
    SELECT Stage, Rank, ServiceName, RequestInput, inputs[indexOf(counts, top)] AS Majority
    FROM (SELECT Stage, Rank, ServiceName, RequestInput, groupArray(Input) AS ins, arrayDistinct(ins) AS inputs,
                 arrayMap(i -> countEqual(ins, i), inputs) AS counts, arrayMax(counts) AS top
          FROM judged GROUP BY Stage, Rank, ServiceName, RequestInput)
    WHERE top >= 2 AND countEqual(counts, top) = 1)
SELECT j.Stage, j.Rank, j.ServiceName, k,
       if(startsWith(k, {{resource:String}}), j.Resource[substring(k, length({{resource:String}}) + 1)],
          j.Attrs[k]) AS Value, count(), countIf(j.Input != m.Majority)
FROM judged AS j
INNER JOIN majority AS m ON j.Stage = m.Stage AND j.Rank = m.Rank AND j.ServiceName = m.ServiceName
                            AND j.RequestInput = m.RequestInput
ARRAY JOIN {{keys:Array(String)}} AS k
GROUP BY j.Stage, j.Rank, j.ServiceName, k, Value"""


def rank_contrasts(store: Store, wanted: dict[tuple[str, str, str], list[str]], t0_ns: int, t1_ns: int) -> dict:
    """(stage, rank, service) → a :class:`~stagetrace.analysis.causes.Contrast` of that rank's settings (``wanted``:
    their contrast keys) over its spans in [t0, t1]: a span counts as diverged when its rank began a difference
    (``RANK_CONTRAST_SQL``). One query for all of them."""
    from stagetrace.analysis.causes import RESOURCE, Contrast

    wanted = {at: sorted(set(keys)) for at, keys in wanted.items() if keys}
    if not wanted:
        return {}
    rows = store.client.query(
        RANK_CONTRAST_SQL,
        parameters={
            "db": store.database,
            "t0": t0_ns,
            "t1": t1_ns,
            "wanted": sorted(wanted),
            "resource": RESOURCE,
            "keys": sorted({k for keys in wanted.values() for k in keys}),
        },
    ).result_rows
    counts: dict[tuple, dict[tuple[str, str], tuple[int, int]]] = {}
    for stage, rank, service, key, value, n, d in rows:
        if key in wanted.get((stage, rank, service), ()):
            counts.setdefault((stage, rank, service), {})[(key, value)] = (int(n), int(d))
    out = {}
    for at, found in counts.items():
        # every span counts once for each key: the rank's spans and those that began a difference, from any key
        per_key: dict[str, tuple[int, int]] = {}
        for (key, _), (n, d) in found.items():
            s = per_key.get(key, (0, 0))
            per_key[key] = (s[0] + n, s[1] + d)
        spans, diverged = next(iter(per_key.values()))
        out[at] = Contrast(found, spans, diverged)
    return out

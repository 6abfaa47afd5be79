"""What the agent's query endpoint runs: reads of the store, decided by the engine's own parser.

The agent runs beside the GPUs, often as root, and its embedded engine is ClickHouse's *local* mode, in which the
scalar ``file()`` reads any path (``user_files_path`` is not enforced there) and the ``default`` database is an
overlay over the filesystem (``SELECT * FROM `/etc/shadow```). ``readonly = 1`` stops writes and settings, not
those reads. So every statement passes an allow-list before it runs, decided on the engine's parse tree:

1. ``formatQuery()`` parses the text (bound as a parameter, so it is never run) into one statement, or fails:
   several statements, comments, odd case and spacing all end here. The formatted text is what runs, so what was
   checked is exactly what the engine executes.
2. ``EXPLAIN AST`` of that statement, with the request's parameters bound (``{db:Identifier}`` included), gives
   the engine's tree. It must be one read statement (``READ_STATEMENTS``) without ``INTO OUTFILE``, and every
   node, wherever it sits (CTE, subquery, lambda, ``IN``, a table function's arguments), must pass:
   - a function is one of the engine's own pure categories (``FUNCTION_CATEGORIES``), or named in
     ``OTHER_FUNCTIONS`` / ``SYNTAX_FUNCTIONS`` / ``TABLE_FUNCTIONS``; aliases and aggregate combinators
     (``countIf``, ``uniqState``) count as the function they name;
   - a name qualified by a database names the store's database, an allowed system table (``SYSTEM_TABLES``),
     or ``information_schema``; never another database of the engine (its ``default`` is the filesystem).
     Unqualified names resolve in the session's database, which is always the store's;
   - every node is of a kind listed in ``NODE_KINDS``: the dump does not print every expression a node keeps
     (the APPLY column transformer's function, a SHOW statement's LIMIT), so an unlisted kind is refused, and
     SHOW runs only as ``SHOW DATABASES`` / ``SHOW TABLES [FROM database]``.
The checks look at every node alone, not at where it sits, so a node the tree's text places oddly (a quoted
identifier with a line break in it) is checked all the same. Refusals are ClickHouse's own codes: 164 (READONLY)
for a statement that is not a read, 497 (ACCESS_DENIED) for a function or table outside the store.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

# the parse trees' root kinds that read: SELECT (WITH, UNION, INTERSECT and EXCEPT included), DESCRIBE, the SHOW
# statements that list names (databases, tables), EXISTS and SHOW CREATE TABLE
READ_STATEMENTS = frozenset(
    {"SelectWithUnionQuery", "DescribeQuery", "ShowTables", "ExistsTableQuery", "ShowCreateTableQuery"}
)

# system tables that clients ask for: clickhouse-connect reads settings; the Grafana data source lists databases,
# tables, columns and functions (its schema browser and editor); a SELECT without FROM reads one
SYSTEM_TABLES = frozenset(
    {
        "one",
        "databases",
        "tables",
        "columns",
        "functions",
        "settings",
        "data_type_families",
        "aggregate_function_combinators",
        "time_zones",
    }
)
METADATA_DATABASES = frozenset({"information_schema", "INFORMATION_SCHEMA"})  # views over the tables above

# system.functions categories whose functions compute on their arguments alone (no file, network, server state or
# configuration); a category the engine adds later is refused until it is listed here
FUNCTION_CATEGORIES = frozenset(
    {
        "Aggregate Functions",
        "Arithmetic",
        "Arrays",
        "Bit",
        "Bitmap",
        "Comparison",
        "Conditional",
        "Dates and Times",
        "Distance",
        "Encoding",
        "Encryption",
        "Financial",
        "Geo",
        "Geo Polygon",
        "Hash",
        "IP Address",
        "JSON",
        "Logical",
        "Map",
        "Mathematical",
        "Null",
        "NumericIndexedVector",
        "QBit",
        "Random Number",
        "Rounding",
        "String",
        "String Replacement",
        "String Search",
        "String Splitting",
        "Time Series",
        "Time Window",
        "Tuple",
        "Type Conversion",
        "URL",
        "UUID",
    }
)
# from the category "Other", those that read only their arguments, the query itself or the session's settings
# (clickhouse-go's hello asks displayName(), version(), revision(), timezone(); Grafana's check asks getSetting)
OTHER_FUNCTIONS = frozenset(
    {
        "version",
        "revision",
        "displayName",
        "currentDatabase",
        "currentQueryID",
        "queryID",
        "initialQueryID",
        "getSetting",
        "getSettingOrDefault",
        "toTypeName",
        "toColumnTypeName",
        "isConstant",
        "materialize",
        "ignore",
        "identity",
        "bar",
        "formatReadableSize",
        "formatReadableDecimalSize",
        "formatReadableQuantity",
        "formatReadableTimeDelta",
        "parseTimeDelta",
        "parseReadableSize",
        "parseReadableSizeOrNull",
        "parseReadableSizeOrZero",
        "parseISO8601Duration",
        "transform",
        "throwIf",
        "neighbor",
        "runningDifference",
        "runningDifferenceStartingWithFirstValue",
        "runningAccumulate",
        "finalizeAggregation",
        "initializeAggregation",
        "blockSize",
        "blockNumber",
        "rowNumberInBlock",
        "rowNumberInAllBlocks",
        "indexHint",
        "byteSize",
        "visibleWidth",
        "defaultValueOfArgumentType",
        "defaultValueOfTypeName",
        "getSizeOfEnumType",
        "isDecimalOverflow",
        "countDigits",
        "getSubcolumn",
        "variantElement",
        "variantType",
        "errorCodeToName",
        "lowCardinalityIndices",
        "lowCardinalityKeys",
        "MACNumToString",
        "MACStringToNum",
        "MACStringToOUI",
    }
)
# what the parser itself writes for syntax: x -> y, EXISTS (...), untuple, GROUPING, x::T and query parameters,
# CASE x WHEN
SYNTAX_FUNCTIONS = frozenset({"lambda", "exists", "untuple", "grouping", "_CAST", "caseWithExpression"})
# table functions that generate rows or wrap a subquery (whose own nodes are checked like any other)
TABLE_FUNCTIONS = frozenset(
    {"numbers", "numbers_mt", "zeros", "zeros_mt", "values", "generateSeries", "generate_series", "view", "format"}
)

# the parse tree's node kinds a read may hold. EXPLAIN AST does not print every expression a node keeps (the APPLY
# column transformer's function, a SHOW statement's LIMIT), so a kind not listed here is refused, and one the engine
# adds later is refused until it is looked at and listed
NODE_KINDS = frozenset(
    {
        *READ_STATEMENTS,
        "SelectQuery",
        "SelectIntersectExceptQuery",
        "ExpressionList",
        "Subquery",
        "WithElement",
        "TablesInSelectQuery",
        "TablesInSelectQueryElement",
        "TableExpression",
        "TableIdentifier",
        "TableJoin",
        "ArrayJoin",
        "Identifier",
        "Literal",
        "Function",
        "OrderByElement",
        "InterpolateElement",
        "WindowDefinition",
        "WindowListElement",
        "Asterisk",
        "QualifiedAsterisk",
        "ColumnsRegexpMatcher",
        "ColumnsListMatcher",
        "QualifiedColumnsRegexpMatcher",
        "QualifiedColumnsListMatcher",
        "ColumnsTransformerList",
        "ColumnsExceptTransformer",
        "ColumnsReplaceTransformer",
        "ColumnsReplaceTransformer::Replacement",
        "Set",  # a SETTINGS clause: the readonly session refuses it with the engine's own message
    }
)
# SHOW statements keep their LIKE and LIMIT outside the printed tree: only these forms, as the engine formats them
_SHOW = re.compile(r"SHOW (?:DATABASES|TABLES(?: FROM [A-Za-z_][A-Za-z0-9_]*)?)(?:\nFORMAT \w+)?")
# URL functions that read the top-level-domain lists the server's configuration names
_CONFIGURED_PREFIXES = ("firstSignificantSubdomainCustom", "cutToFirstSignificantSubdomainCustom")

READONLY, ACCESS_DENIED = 164, 497
_CHILDREN = re.compile(r" \(children (\d+)\)$")


class Denied(Exception):
    """A statement the endpoint does not run, with ClickHouse's error code for why."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Checked:
    sql: str  # the statement as the engine formatted it: what runs
    format: str | None  # its FORMAT clause, if any (the engine writes it on a line of its own)


@dataclass
class _Node:
    kind: str
    name: str
    depth: int
    children: int


class QueryGuard:
    """Checks statements for the store's database ``database``. ``query(sql, params)`` runs one statement on the
    endpoint's session and returns its answer as text (TabSeparatedRaw)."""

    def __init__(self, query: Callable[[str, dict], str], database: str):
        self._query = query
        self.database = database
        self._functions, self._case_insensitive, self._aggregates = _allowed_functions(query)
        self._combinators = sorted(
            query("SELECT name FROM system.aggregate_function_combinators", {}).split(), key=len, reverse=True
        )

    def check(self, sql: str, params: dict[str, str], database: str = "") -> Checked:
        """The statement to run for ``sql``; raises Denied, or the engine's own error for one that does not parse."""
        if database and database != self.database:
            raise Denied(ACCESS_DENIED, f"only the store's database {self.database} is readable here, not {database}")
        try:
            canonical = self._query("SELECT formatQuery({statement:String})", {"statement": _escaped(sql)})[:-1]
        except Exception as exc:  # the parser's message on one line, without the scope that repeats the statement
            message = " ".join(str(exc).split(": In scope SELECT formatQuery(", 1)[0].split())
            if "Multi-statements are not allowed" in message:
                raise Denied(READONLY, "the query endpoint runs one statement per request") from None
            raise type(exc)(message) from None
        nodes = _tree(self._query(f"EXPLAIN AST {canonical}", params))
        root = nodes[0]
        if root.kind not in READ_STATEMENTS:
            raise Denied(READONLY, "the query endpoint runs only reads: SELECT, WITH, SHOW, DESCRIBE or EXISTS")
        if root.kind == "ShowTables" and not _SHOW.fullmatch(canonical):
            raise Denied(
                READONLY,
                "of SHOW statements the query endpoint runs SHOW DATABASES and SHOW TABLES "
                "[FROM database], without LIKE or LIMIT",
            )
        databases: list[set[str]] = []  # the engine's databases, asked at most once per statement
        for node in nodes[1:]:
            if node.kind not in NODE_KINDS:
                raise Denied(
                    ACCESS_DENIED,
                    f"the query endpoint does not run {node.kind} (a part of the statement it cannot check)",
                )
            if node.depth == 1 and node.kind == "Literal":  # a root's literal child is INTO OUTFILE's path
                raise Denied(READONLY, "the query endpoint does not write files (INTO OUTFILE)")
            if node.kind == "Function" and not self._function_allowed(node.name):
                raise Denied(ACCESS_DENIED, f"function {node.name} reaches outside the store")
            elif node.kind in ("TableIdentifier", "Identifier") and not self._name_allowed(node.name, databases):
                raise Denied(ACCESS_DENIED, f"{node.name} is outside the store")
        if root.kind in ("ExistsTableQuery", "ShowCreateTableQuery"):  # [database, ] table as identifier children
            names = [node.name for node in nodes[1:] if node.depth == 1]
            if len(names) == 2 and not self._name_allowed(".".join(names), databases):
                raise Denied(ACCESS_DENIED, f"{'.'.join(names)} is outside the store")
        fmt = next((line[7:] for line in reversed(canonical.split("\n")) if line.startswith("FORMAT ")), None)
        return Checked(canonical, fmt)

    def _function_allowed(self, name: str) -> bool:
        if name in self._functions or name.lower() in self._case_insensitive:
            return True
        base = name  # an aggregate with combinators: quantileExactIf, uniqStateIf, sumForEachOrNull
        while True:
            suffix = next((c for c in self._combinators if base.endswith(c) and len(base) > len(c)), None)
            if suffix is None:
                return False
            base = base[: -len(suffix)]
            if base in self._aggregates:
                return True

    def _name_allowed(self, name: str, databases: list[set[str]]) -> bool:
        parts = name.split(".")
        if len(parts) < 2 or parts[0] == self.database or parts[0] in METADATA_DATABASES:
            return True  # unqualified names resolve in the session's database, which is the store's
        if parts[0] == "system":
            return parts[1] in SYSTEM_TABLES
        if not databases:
            databases.append(set(self._query("SELECT name FROM system.databases", {}).split("\n")))
        return parts[0] not in databases[0]  # a table's alias or a tuple column, not another database


def _allowed_functions(query) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """(names, lower-case names of case-insensitive ones, aggregate names) of the functions statements may call."""
    rows = [
        line.split("\t")
        for line in query(
            "SELECT name, alias_to, is_aggregate, case_insensitive, categories FROM system.functions", {}
        ).splitlines()
    ]
    table_functions = set(query("SELECT name FROM system.table_functions", {}).split())

    def allowed(name: str, categories: str) -> bool:
        if name in OTHER_FUNCTIONS or name in SYNTAX_FUNCTIONS:
            return True
        if name.startswith(_CONFIGURED_PREFIXES):
            return False
        return bool(categories) and all(c.strip() in FUNCTION_CATEGORIES for c in categories.split(","))

    own = {name: allowed(name, categories) for name, _, _, _, categories in rows}
    names = {name for name, alias_to, _, _, _ in rows if own.get(alias_to or name, False)}
    names -= table_functions - TABLE_FUNCTIONS  # a name that is also a table function is that table function too
    names |= SYNTAX_FUNCTIONS | TABLE_FUNCTIONS
    insensitive = {name.lower() for name, _, _, ci, _ in rows if ci == "1" and name in names}
    aggregates = {name for name, _, aggregate, _, _ in rows if aggregate == "1" and name in names}
    return frozenset(names), frozenset(insensitive), frozenset(aggregates)


def _escaped(text: str) -> str:
    """A String parameter's value as the engine reads parameters (escaped as in TabSeparated)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def _tree(text: str) -> list[_Node]:
    """The nodes of an EXPLAIN AST dump in order, checked to form one tree (each node's children as counted)."""
    nodes, open_counts = [], []
    for line in text.rstrip("\n").split("\n"):
        body = line.lstrip(" ")
        depth = len(line) - len(body)
        match = _CHILDREN.search(body)
        children = int(match[1]) if match else 0
        body = body[: match.start()] if match else body
        kind, _, name = body.partition(" ")
        name = name.split(" (alias ", 1)[0]
        if (
            (depth == 0) != (not nodes)
            or depth > len(open_counts)
            or any(open_counts[depth:])
            or (depth and open_counts[depth - 1] <= 0)
        ):
            raise Denied(ACCESS_DENIED, "the statement's parse tree is not one tree")
        if depth:
            open_counts[depth - 1] -= 1
        del open_counts[depth:]
        open_counts.append(children)
        nodes.append(_Node(kind, name, depth, children))
    if not nodes or any(open_counts):
        raise Denied(ACCESS_DENIED, "the statement's parse tree is not one tree")
    return nodes


__all__ = ["ACCESS_DENIED", "READONLY", "READ_STATEMENTS", "SYSTEM_TABLES", "Checked", "Denied", "QueryGuard"]

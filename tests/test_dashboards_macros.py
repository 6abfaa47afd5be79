"""The macro expander against the ClickHouse data source's documented expansions.

Expected strings are those of grafana/clickhouse-datasource (pkg/macros/macros.go and its tests, the
CHDatasource.applyConditionalAll tests, docs) and Grafana's variable format registry.
"""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from tests.grafana_macros import ALL, MacroError, QueryContext, Variable, expand, expand_macros, interpolate

# The time range of the plugin's own macro tests.
FROM = datetime(2014, 11, 12, 11, 45, 26, 371000, tzinfo=timezone.utc)
TO = datetime(2015, 11, 12, 11, 45, 26, 371000, tzinfo=timezone.utc)
CONTEXT = QueryContext(FROM, TO, interval_ms=20_000)


@pytest.mark.parametrize(
    ("macro", "expansion"),
    [
        ("$__timeFilter(ts)", "ts >= toDateTime(1415792726) AND ts <= toDateTime(1447328726)"),
        (
            "$__timeFilter_ms(ts)",
            "ts >= fromUnixTimestamp64Milli(1415792726371) AND ts <= fromUnixTimestamp64Milli(1447328726371)",
        ),
        ("$__dateFilter(d)", "d >= toDate('2014-11-12') AND d <= toDate('2015-11-12')"),
        (
            "$__dateTimeFilter(d, t)",
            "(d >= toDate('2014-11-12') AND d <= toDate('2015-11-12')) AND "
            "(t >= toDateTime(1415792726) AND t <= toDateTime(1447328726))",
        ),
        (
            "$__dt(d, t)",
            "(d >= toDate('2014-11-12') AND d <= toDate('2015-11-12')) AND "
            "(t >= toDateTime(1415792726) AND t <= toDateTime(1447328726))",
        ),
        ("$__fromTime", "toDateTime(1415792726)"),
        ("$__toTime", "toDateTime(1447328726)"),
        ("$__fromTime_ms", "fromUnixTimestamp64Milli(1415792726371)"),
        ("$__toTime_ms", "fromUnixTimestamp64Milli(1447328726371)"),
        ("$__timeFrom(ts)", "ts >= toDateTime(1415792726)"),
        ("$__timeTo(ts)", "ts <= toDateTime(1447328726)"),
        ("$__timeInterval(col)", "toStartOfInterval(toDateTime(col), INTERVAL 20 second)"),
        ("$__timeInterval_ms(col)", "toStartOfInterval(toDateTime64(col, 3), INTERVAL 20000 millisecond)"),
        ("$__interval_s", "20"),
        ("$__timeGroup(col, 5m)", "toStartOfInterval(toDateTime(col), INTERVAL 300 second)"),
    ],
)
def test_backend_macros_expand_as_the_plugin_documents(macro, expansion):
    assert expand_macros(f"SELECT 1 WHERE {macro}", CONTEXT) == f"SELECT 1 WHERE {expansion}"


def test_interval_is_at_least_one_second_or_millisecond():
    short = QueryContext(FROM, TO, interval_ms=0)
    assert expand_macros("$__interval_s", short) == "1"
    assert expand_macros("$__timeInterval(c)", short) == "toStartOfInterval(toDateTime(c), INTERVAL 1 second)"
    assert (
        expand_macros("$__timeInterval_ms(c)", short) == "toStartOfInterval(toDateTime64(c, 3), INTERVAL 1 millisecond)"
    )
    # Go's int(math.Max(seconds, 1)) truncates 1.5 s to 1
    assert expand_macros("$__interval_s", QueryContext(FROM, TO, interval_ms=1500)) == "1"


def test_macro_arguments_are_trimmed_and_may_hold_expressions():
    assert expand_macros("$__timeFilter( toDateTime(a, 'UTC') )", CONTEXT) == (
        "toDateTime(a, 'UTC') >= toDateTime(1415792726) AND toDateTime(a, 'UTC') <= toDateTime(1447328726)"
    )


def test_macros_in_literals_and_comments_are_left_alone():
    sql = "SELECT '$__timeFilter(x)', `$__fromTime` -- $__toTime\n/* $__interval_s */ FROM t WHERE $__timeTo(t)"
    assert expand_macros(sql, CONTEXT) == (
        "SELECT '$__timeFilter(x)', `$__fromTime` -- $__toTime\n/* $__interval_s */ FROM t WHERE t <= toDateTime(1447328726)"
    )


@pytest.mark.parametrize(
    ("sql", "error"),
    [
        ("$__timeFilter()", "expected 1 argument"),
        ("$__timeFilter(a, b)", "expected 1 argument"),
        ("$__dateTimeFilter(a)", "expected 2 argument"),
        ("$__timeFilter", "needs 1 argument"),
        ("$__nosuchmacro(a)", "unknown macro"),
        ("$__timeFilter(a", "not closed"),
        ("$__table", "query-builder table"),
    ],
)
def test_wrong_macros_are_errors_not_silently_passed_on(sql, error):
    with pytest.raises(MacroError, match=error):
        expand_macros(sql, CONTEXT)


# -- $__conditionalAll: the plugin's CHDatasource tests


def test_conditional_all_becomes_1_eq_1_when_all_is_selected():
    sql = "select stuff from table where $__conditionalAll(fieldVal in ($fieldVal), $fieldVal);"
    assert expand(sql, CONTEXT, {"fieldVal": Variable(ALL)}) == "select stuff from table where 1=1;"


def test_conditional_all_keeps_the_condition_otherwise():
    sql = "select stuff from table where $__conditionalAll(fieldVal in ($fieldVal), $fieldVal);"
    from tests.grafana_macros import apply_conditional_all

    assert apply_conditional_all(sql, {"fieldVal": Variable("'val1', 'val2'")}) == (
        "select stuff from table where fieldVal in ($fieldVal);"
    )


def test_every_conditional_all_is_replaced():
    sql = (
        "select stuff from table where $__conditionalAll(fieldVal in ($fieldVal), $fieldVal) and "
        "$__conditionalAll(fieldVal in ($fieldVal2), $fieldVal2);"
    )
    variables = {"fieldVal": Variable(("val1", "val2")), "fieldVal2": Variable((ALL,))}
    assert expand(sql, CONTEXT, variables) == "select stuff from table where fieldVal in ('val1','val2') and 1=1;"


def test_conditional_all_treats_an_empty_selection_as_all_and_takes_braced_variables():
    sql = "WHERE $__conditionalAll(host IN (${host:singlequote}), ${host})"
    assert expand(sql, CONTEXT, {"host": Variable(())}) == "WHERE 1=1"
    assert expand(sql, CONTEXT, {"host": Variable(("a",))}) == "WHERE host IN ('a')"


# -- template variables: templateSrv.replace with the plugin's default format


def test_default_format_quotes_multi_values_and_leaves_single_values_raw():
    variables = {"multi": Variable(("a", "b")), "single": Variable("x")}
    assert interpolate("IN ($multi) = $single", variables) == "IN ('a','b') = x"
    assert interpolate("${multi} [[single]]", variables) == "'a','b' x"


@pytest.mark.parametrize(
    ("reference", "expansion"),
    [
        ("${v:singlequote}", "'a','b\\'c'"),
        ("${v:doublequote}", '"a","b\'c"'),
        ("${v:sqlstring}", "'a','b''c'"),
        ("${v:csv}", "a,b'c"),
        ("${v:pipe}", "a|b'c"),
        ("${v:raw}", "a,b'c"),
        ("${v:json}", '["a","b\'c"]'),
        ("${v:percentencode}", "%7Ba%2Cb%27c%7D"),
        ("${v:regex}", "(a|b'c)"),
        ("${v:glob}", "{a,b'c}"),
        ("[[v:csv]]", "a,b'c"),
    ],
)
def test_variable_formats_match_grafanas_format_registry(reference, expansion):
    assert interpolate(reference, {"v": Variable(("a", "b'c"))}) == expansion


def test_single_value_formats():
    variables = {"v": Variable("it's (1.0)")}
    assert interpolate("${v:singlequote}", variables) == "'it\\'s (1.0)'"
    assert interpolate("${v:percentencode}", variables) == "it%27s%20%281.0%29"
    assert interpolate("${v:regex}", variables) == "it's \\(1\\.0\\)"


def test_all_expands_to_every_option_or_to_the_custom_all_value_unformatted():
    assert interpolate("${h:singlequote}", {"h": Variable((ALL,), options=("n1", "n2"))}) == "'n1','n2'"
    assert interpolate("${h:singlequote}", {"h": Variable(ALL, options=("n1",), all_value=".*")}) == ".*"


def test_unknown_variables_and_backend_macros_are_left_for_later():
    assert (
        interpolate("$nope ${nope} $__timeFilter(t) $__interval_s", {})
        == "$nope ${nope} $__timeFilter(t) $__interval_s"
    )


def test_grafana_globals_are_filled_in_by_the_frontend():
    assert (
        interpolate("${__from} $__to $__interval $__interval_ms", {}, CONTEXT)
        == "1415792726371 1447328726371 20s 20000"
    )
    assert interpolate("$__interval", {}, QueryContext(FROM, TO, interval_ms=90_000)) == "1m"
    assert interpolate("$__interval", {}, QueryContext(FROM, TO, interval_ms=20)) == "20ms"


def test_a_format_the_expander_does_not_model_is_an_error():
    with pytest.raises(MacroError, match="lucene"):
        interpolate("${v:lucene}", {"v": Variable("a")})


def test_order_is_conditional_all_then_variables_then_macros():
    sql = "SELECT * FROM t WHERE $__timeFilter(ts) AND $__conditionalAll(host IN (${host:singlequote}), $host)"
    assert expand(sql, CONTEXT, {"host": Variable(("n'1",))}) == (
        "SELECT * FROM t WHERE ts >= toDateTime(1415792726) AND ts <= toDateTime(1447328726) AND host IN ('n\\'1')"
    )


def test_time_range_must_be_timezone_aware():
    with pytest.raises(ValueError, match="timezone-aware"):
        QueryContext(datetime(2024, 1, 1), TO)

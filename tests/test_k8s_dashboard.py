"""k8s/grafana-dashboard.json: every query parses and asks only for metrics the server exports.

The exported metrics come from the server's single definition table
(`metrics.definitions.METRIC_DEFINITIONS`); METRICS.md section 5 is the design they implement, and
every family of either must have a panel. The `prefix` variable picks the source: `ray_tpserve`
(Ray's metrics port: Ray prefixes every name with `ray_`) or `tpserve` (the HTTP /metrics); every
query is checked under each choice.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest

from k8s_validation import (
    GRAFANA_BUILTINS,
    K8S_DIR,
    METRICS_MD,
    ExportedMetric,
    PromQLError,
    iter_panels,
    metrics_from_definitions,
    metrics_from_design_doc,
    parse_promql,
    series_names,
    substitute_variables,
)

DASHBOARD = K8S_DIR / "grafana-dashboard.json"
# How each choice of the `prefix` variable renames the table's `tpserve_*` names.
PREFIX_SOURCES = {"ray_tpserve": "ray_", "tpserve": ""}
# Labels Prometheus adds to every series of a PodMonitor target (k8s/podmonitor.yaml): the
# scraped pod, not in the exposition itself.
TARGET_LABELS = {"pod"}
# Labels a query may use besides the metrics' own: `le` of histogram buckets, the target labels.
EXTRA_LABELS = {"le"} | TARGET_LABELS
RATE_FUNCTIONS = ("rate", "irate", "increase")


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def exported_metrics() -> list[ExportedMetric]:
    table = metrics_from_definitions()
    assert table is not None, "metrics.definitions.METRIC_DEFINITIONS is the single definition table"
    return table


def variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}


def prefix_choices(dashboard: dict[str, Any]) -> list[str]:
    return [option["value"] for option in variables(dashboard)["prefix"]["options"]]


def targets(dashboard: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(panel title, target) of every query target."""
    return [(p.get("title", "?"), t) for p in iter_panels(dashboard["panels"]) for t in p.get("targets", [])]


def variable_values(prefix: str) -> dict[str, str]:
    # A multi-value `model_name` is interpolated as a regex alternation; ".*" stands for it.
    return {**GRAFANA_BUILTINS, "prefix": prefix, "model_name": ".*", "datasource": "prometheus"}


def dashboard_problems(dashboard: dict[str, Any], table: list[ExportedMetric]) -> list[str]:
    """Everything wrong with the dashboard's queries and variables (empty = good)."""
    problems: list[str] = []
    all_vars = variables(dashboard)
    for required in ("datasource", "prefix", "model_name"):
        if required not in all_vars:
            problems.append(f"missing variable {required!r}")
    if problems:
        return problems
    if all_vars["datasource"].get("type") != "datasource" or all_vars["datasource"].get("query") != "prometheus":
        problems.append("the datasource variable must list Prometheus data sources")
    choices = prefix_choices(dashboard)
    if sorted(choices) != sorted(PREFIX_SOURCES):
        problems.append(f"prefix options {choices} != {sorted(PREFIX_SOURCES)}")
        return problems
    known_labels = {label for metric in table for label in metric.labels} | EXTRA_LABELS
    kinds: dict[str, str] = {}
    for choice, rename in PREFIX_SOURCES.items():
        for metric in table:
            for series in series_names(metric):
                kinds[rename + series] = "histogram-series" if metric.kind == "histogram" else metric.kind

    model_var = all_vars["model_name"]
    if not (model_var.get("multi") and model_var.get("includeAll") and model_var.get("allValue") == ".*"):
        problems.append("model_name: multi-value with All (= .*)")
    query = model_var.get("query")
    query = query.get("query") if isinstance(query, dict) else query
    match = re.fullmatch(r"label_values\((.+),\s*model_name\)", query or "")
    if not match:
        problems.append(f"model_name variable query {query!r} is not label_values(<metric>, model_name)")
    else:
        for choice in PREFIX_SOURCES:
            metric = substitute_variables(match.group(1), variable_values(choice))
            if metric not in kinds:
                problems.append(f"model_name variable: {metric} is not exported")

    for title, target in targets(dashboard):
        if target.get("datasource", {}).get("uid") != "${datasource}":
            problems.append(f"{title}: target not on the ${{datasource}} variable")
        raw = target.get("expr", "")
        if 'model_name=~"$model_name"' not in raw:
            problems.append(f"{title}: query not filtered by the model_name variable")
        for choice in choices:
            try:
                expr = substitute_variables(raw, variable_values(choice))
                info = parse_promql(expr)
            except PromQLError as exc:
                problems.append(f"{title}: {exc}")
                continue
            for metric in sorted(info.metrics - set(kinds)):
                problems.append(f"{title}: {metric} is not exported (prefix={choice})")
            for label in sorted(info.labels - known_labels):
                problems.append(f"{title}: unknown label {label!r}")
            # Counters and buckets only through a rate; gauges never.
            for metric in info.metrics & set(kinds):
                for occurrence in re.finditer(rf"(\w*)\(\s*{re.escape(metric)}\b", expr):
                    inside_rate = occurrence.group(1) in RATE_FUNCTIONS
                    if kinds[metric] in ("counter", "histogram-series") and not inside_rate:
                        problems.append(f"{title}: {metric} used without rate()")
                    if kinds[metric] in ("gauge", "info") and inside_rate:
                        problems.append(f"{title}: rate() of the gauge {metric}")
                if kinds[metric] in ("counter", "histogram-series") and not re.search(
                    rf"\b(?:{'|'.join(RATE_FUNCTIONS)})\(\s*{re.escape(metric)}\b", expr
                ):
                    problems.append(f"{title}: {metric} used without rate()")
            # A quantile of buckets must keep `le` when aggregating.
            for call in re.finditer(r"histogram_quantile\(\s*([0-9.]+)\s*,\s*(\w+)\s*(by|without)?\s*\(([^)]*)\)", expr):
                if not 0 < float(call.group(1)) < 1:
                    problems.append(f"{title}: quantile {call.group(1)} outside (0, 1)")
                if call.group(3) == "by" and "le" not in [x.strip() for x in call.group(4).split(",")]:
                    problems.append(f"{title}: histogram_quantile aggregates away `le`")
            if "histogram_quantile" in info.functions and not any(m.endswith("_bucket") for m in info.metrics):
                problems.append(f"{title}: histogram_quantile without _bucket series")
    return problems


def families_in_panels(dashboard: dict[str, Any], table: list[ExportedMetric]) -> set[str]:
    """Names of the metric families (table names) some panel queries."""
    used: set[str] = set()
    for _, target in targets(dashboard):
        for choice, rename in PREFIX_SOURCES.items():
            try:
                info = parse_promql(substitute_variables(target.get("expr", ""), variable_values(choice)))
            except PromQLError:
                continue
            for metric in table:
                if {rename + s for s in series_names(metric)} & info.metrics:
                    used.add(metric.name)
    return used


# ---------------------------------------------------------------------------------------------
# the dashboard
# ---------------------------------------------------------------------------------------------


def test_definition_table_is_available_and_matches_the_design():
    table = exported_metrics()
    design = {m.name: m for m in metrics_from_design_doc()} if METRICS_MD.exists() else {}
    names = {m.name for m in table}
    assert len(names) == len(table) > 0
    # Every family METRICS.md promises is in the table, with the same kind and labels.
    for name, metric in design.items():
        assert name in names, f"{name} (METRICS.md) is not in METRIC_DEFINITIONS"
        (defined,) = [m for m in table if m.name == name]
        assert defined.kind == metric.kind, name
        assert set(metric.labels) <= set(defined.labels), name


def test_dashboard_queries_parse_and_use_exported_metrics():
    assert dashboard_problems(load_dashboard(), exported_metrics()) == []


def test_dashboard_series_exist_in_a_live_metrics_exposition():
    # The real prometheus-client exporter's GET /metrics body (no Ray needed): every series and
    # label the dashboard asks for under prefix=tpserve is in it.
    from prometheus_client.parser import text_string_to_metric_families

    from metrics.definitions import CACHE_CONFIG_LABELS
    from metrics.prometheus_logger import PrometheusStatLogger

    exporter = PrometheusStatLogger("SmolLM2-135M-Instruct", max_num_batched_tokens=512, max_model_len=2048)
    exporter.log_cache_config({label: "1" for label in CACHE_CONFIG_LABELS})
    labels_by_series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(exporter.render().decode()):
        for sample in family.samples:
            labels_by_series.setdefault(sample.name, set()).update(sample.labels)
    for title, target in targets(load_dashboard()):
        info = parse_promql(substitute_variables(target["expr"], variable_values("tpserve")))
        exposed_labels: set[str] = set()
        for metric in info.metrics:
            assert metric in labels_by_series, f"{title}: {metric} not in /metrics"
            exposed_labels |= labels_by_series[metric]
        # `le` is on the _bucket samples; every other label must be on one of the query's series.
        assert info.labels - TARGET_LABELS <= exposed_labels, f"{title}: {info.labels - exposed_labels}"


def test_every_metric_family_has_a_panel():
    table = exported_metrics()
    design = metrics_from_design_doc() if METRICS_MD.exists() else []
    wanted = {m.name for m in table} | {m.name for m in design}
    missing = wanted - families_in_panels(load_dashboard(), table)
    assert missing == set(), f"no panel for {sorted(missing)}"


def test_dashboard_structure():
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"]
    panels = list(iter_panels(dashboard["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in panels:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel.get("targets"), f"{panel['title']} queries something"
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs)), panel["title"]
    # The panels the operators asked for, by title.
    titles = " | ".join(p["title"].lower() for p in panels)
    for words in (
        "used vs cached vs capacity", "usage", "prefill vs decode", "preemption rate by phase",
        "running / waiting", "time to first token", "inter-token latency", "time per output token",
        "queue / prefill / decode / inference / e2e", "preemption stall", "throughput",
        "finished requests by reason", "epp signal", "kv events rate",
    ):
        assert words in titles, words
    assert sum("p99" in p["title"] for p in panels) >= 5 and sum("p50" in p["title"] for p in panels) >= 5


def test_every_endpoint_picker_signal_has_a_per_pod_panel():
    # The signals the endpoint picker reads (k8s/inference-pool.yaml), each shown per pod: the
    # picker compares pods, so a sum over replicas would hide what it sees.
    from test_gateway_metrics import parse_spec, tpserve_engine_config

    engine = tpserve_engine_config()
    wanted = {parse_spec(engine[field]).name for field in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec")}
    wanted.add("tpserve_kv_cache_capacity_tokens")
    shown: set[str] = set()
    for title, target in targets(load_dashboard()):
        if not title.startswith("EPP signal"):
            continue
        info = parse_promql(substitute_variables(target["expr"], variable_values("tpserve")))
        if "pod" in info.labels:
            shown |= info.metrics
    assert wanted - shown == set()
    # The labels the picker reads from the cache-info metric are columns of its panel.
    info_targets = [t["expr"] for title, t in targets(load_dashboard()) if title.startswith("EPP signal") and "_cache_config_info" in t["expr"]]
    assert any(engine["cacheBlockSizeLabelName"] in e and engine["cacheNumBlocksLabelName"] in e and "num_gpu_blocks" in e
               for e in info_targets)


def exemplar_problems(dashboard: dict[str, Any]) -> list[str]:
    """Targets that should show trace exemplars and do not, or ask for some where there are none:
    a target shows them exactly when it reads the buckets of a histogram whose observations carry
    trace ids (`trace_exemplars` in metrics.definitions, docs/tracing.md)."""
    from metrics.definitions import METRIC_DEFINITIONS

    traced_buckets = {d.name + "_bucket" for d in METRIC_DEFINITIONS if d.trace_exemplars}
    problems, shown = [], set()
    for title, target in targets(dashboard):
        info = parse_promql(substitute_variables(target["expr"], variable_values("tpserve")))
        reads_traced = bool(info.metrics & traced_buckets)
        shown |= info.metrics & traced_buckets
        if target.get("exemplar", False) is not reads_traced:
            problems.append(f"{title} {target['refId']}: exemplar should be {reads_traced}")
    problems += [f"no panel shows the exemplars of {name}" for name in sorted(traced_buckets - shown)]
    return problems


def test_latency_panels_show_trace_exemplars():
    assert exemplar_problems(load_dashboard()) == []
    # The latency panels the issue names are among them.
    titles = {title for title, target in targets(load_dashboard()) if target.get("exemplar")}
    for words in ("Time to first token", "Inter-token latency", "Time per output token", "e2e"):
        assert any(words in title for title in titles), words


def test_exemplar_check_rejects_a_missing_or_stray_exemplar():
    dashboard = copy.deepcopy(load_dashboard())
    _first_expr_target(dashboard, "_time_to_first_token_seconds_bucket").pop("exemplar")
    assert any("Time to first token" in p and "should be True" in p for p in exemplar_problems(dashboard))
    dashboard = copy.deepcopy(load_dashboard())
    _first_expr_target(dashboard, "_iteration_tokens_total_bucket")["exemplar"] = True
    assert any("should be False" in p for p in exemplar_problems(dashboard))


def test_kv_events_rate_panel_reads_the_events_by_type():
    (panel,) = [p for p in iter_panels(load_dashboard()["panels"]) if p.get("title", "").startswith("KV events rate")]
    (target,) = panel["targets"]
    info = parse_promql(substitute_variables(target["expr"], variable_values("tpserve")))
    assert info.metrics == {"tpserve_kv_events_total"} and "event_type" in info.labels
    assert "rate" in info.functions


# ---------------------------------------------------------------------------------------------
# the checks reject broken dashboards
# ---------------------------------------------------------------------------------------------


def _first_expr_target(dashboard: dict[str, Any], containing: str) -> dict[str, Any]:
    for _, target in targets(dashboard):
        if containing in target["expr"]:
            return target
    raise AssertionError(containing)


BROKEN: dict[str, tuple[str, Any, str]] = {
    # case: (query fragment to find, how to break it, message fragment expected)
    "misspelled metric": ("_kv_cache_used_tokens", lambda e: e.replace("_kv_cache_used_tokens", "_kv_cache_use_tokens"), "is not exported"),
    "unknown function": ("rate(", lambda e: e.replace("rate(", "rte(", 1), "unknown function 'rte'"),
    "unbalanced parenthesis": ("histogram_quantile", lambda e: e + ")", "unbalanced"),
    "unclosed brace": ("_num_requests_running", lambda e: e.replace('"$model_name"}', '"$model_name"', 1), "unbalanced ')'"),
    "unknown label": ("finished_reason", lambda e: e.replace("finished_reason", "reason"), "unknown label 'reason'"),
    "unknown variable": ("_num_requests_running", lambda e: e.replace("$model_name", "$model"), "unknown dashboard variable"),
    "counter without rate": ("_generation_tokens_total", lambda e: re.sub(r"rate\((\S+_generation_tokens_total\{[^}]*\})\[\$__rate_interval\]\)", r"\1", e), "without rate()"),
    "rate of a gauge": ("_num_requests_waiting{", lambda e: re.sub(r"(\$\{prefix\}_num_requests_waiting\{[^}]*\})", r"rate(\1[5m])", e, count=1), "rate() of the gauge"),
    "quantile without le": ("histogram_quantile", lambda e: e.replace("by (le, ", "by ("), "aggregates away `le`"),
    "bad matcher": ("_num_requests_running", lambda e: e.replace('model_name=~"$model_name"', "model_name=~model", 1), "quoted label value"),
    "misplaced keyword": ("sum by (model_name)", lambda e: e.replace("sum by (model_name) (", "sum (by model_name) (", 1), "misplaced keyword"),
    "wrong arity": ("histogram_quantile(0.99", lambda e: e.replace("histogram_quantile(0.99, ", "histogram_quantile(", 1), "takes 2..2 arguments"),
    "no model filter": ("_num_requests_running", lambda e: e.replace('{model_name=~"$model_name"}', ""), "not filtered by the model_name"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_dashboard_check_rejects_broken_query(case):
    fragment, breaker, expected = BROKEN[case]
    dashboard = copy.deepcopy(load_dashboard())
    target = _first_expr_target(dashboard, fragment)
    broken = breaker(target["expr"])
    assert broken != target["expr"], case
    target["expr"] = broken
    problems = dashboard_problems(dashboard, exported_metrics())
    assert any(expected in p for p in problems), (case, problems)


def test_dashboard_check_rejects_broken_variables():
    dashboard = copy.deepcopy(load_dashboard())
    variables(dashboard)["model_name"]["query"]["query"] = "label_values(${prefix}_cache_config, model_name)"
    assert any("not exported" in p for p in dashboard_problems(dashboard, exported_metrics()))
    dashboard = copy.deepcopy(load_dashboard())
    dashboard["templating"]["list"] = [v for v in dashboard["templating"]["list"] if v["name"] != "model_name"]
    assert "missing variable 'model_name'" in dashboard_problems(dashboard, exported_metrics())


def test_panel_coverage_check_notices_a_missing_family():
    dashboard = copy.deepcopy(load_dashboard())
    table = exported_metrics()
    for panel in iter_panels(dashboard["panels"]):
        panel["targets"] = [t for t in panel.get("targets", []) if "_num_preemptions_total" not in t["expr"]]
    assert "tpserve_num_preemptions_total" not in families_in_panels(dashboard, table)


# ---------------------------------------------------------------------------------------------
# the PromQL parser itself
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expr",
    [
        'sum by (model_name) (rate(tpserve_generation_tokens_total{model_name=~".*"}[5m]))',
        "histogram_quantile(0.99, sum by (le) (rate(x_bucket[5m])))",
        "sum(rate(a[1m])) / sum(rate(b[1m])) * 100",
        "max without (instance) (a) > bool 0",
        "a / on (model_name) group_left (dtype) b",
        'clamp_min(a{x!="y", z!~"w.*"}, 1) offset 5m',
        "-a + 1.5e3",
        "topk(5, sum by (x) (a))",
        "rate(a[5m:1m])",
        'a unless on (x) b{__name__="c"}',
    ],
)
def test_promql_parser_accepts(expr):
    parse_promql(expr)


@pytest.mark.parametrize(
    "expr,message",
    [
        ("sum(rate(a[5m])", "unclosed"),
        ("sum(rate(a[5m])))", "unbalanced"),
        ("rate(a[5m)]", "unbalanced"),
        ("ratee(a[5m])", "unknown function"),
        ("sum by model_name (a)", "expected '('"),
        ("a{b=c}", "quoted label value"),
        ("a{b=~\"(\"}", "bad regex"),
        ("rate(a[five])", "duration"),
        ("a +", "unexpected"),
        ("a b", "unexpected"),
        ("histogram_quantile(0.5)", "arguments"),
        ("a @ b", "unexpected character"),
    ],
)
def test_promql_parser_rejects(expr, message):
    with pytest.raises(PromQLError, match=re.escape(message)):
        parse_promql(expr)


def test_promql_parser_reports_metrics_labels_functions():
    info = parse_promql('histogram_quantile(0.5, sum by (le, model_name) (rate(m_bucket{phase="x"}[5m])))')
    assert info.metrics == {"m_bucket"}
    assert info.labels == {"le", "model_name", "phase"}
    assert info.functions == {"histogram_quantile", "sum", "rate"}

"""Offline validation helpers for the manifests in k8s/ (used by tests/test_k8s_*.py).

- CRD schemas: the `openAPIV3Schema` of one version of an upstream CustomResourceDefinition
  (`../shared/k8s-schemas/`: KubeRay, Prometheus operator, the Gateway API Inference Extension's
  InferencePool), tightened so that a misspelled field is an error, checked with `jsonschema`.
  The API server prunes unknown fields of a structural schema silently; here they fail. The CEL
  rules on the fields used are evaluated by Python equivalents (`CEL_EQUIVALENTS`).
- Core kinds and object metadata: `kubernetes_validate` (strict) against its bundled schemas.
- NetworkPolicy: ingress rules evaluated for a pod and a peer, with the labels KubeRay gives Ray
  pods (`kuberay_pod_labels`).
- PromQL: a small recursive-descent parser of the PromQL subset a dashboard uses; it rejects
  unbalanced brackets, unknown functions, unknown label names and metrics outside a given set.
"""

from __future__ import annotations

import copy
import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import jsonschema
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
K8S_DIR = REPO_ROOT / "k8s"
# The project's shared/ folder sits beside the repository (the developers' checkout and CI alike).
SHARED_DIR = Path(os.environ.get("TPSERVE_SHARED_DIR", REPO_ROOT.parent / "shared"))
SCHEMAS_DIR = SHARED_DIR / "k8s-schemas"
METRICS_MD = SHARED_DIR / "design" / "METRICS.md"

# Which CRD file describes which (apiVersion, kind).
CRD_FILES = {
    ("ray.io/v1", "RayService"): "ray.io_rayservices.yaml",
    ("ray.io/v1", "RayCluster"): "ray.io_rayclusters.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitors.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
    # Gateway API Inference Extension (k8s/inference-pool.yaml).
    ("inference.networking.k8s.io/v1", "InferencePool"): "inference.networking.k8s.io_inferencepools.yaml",
}
# Kubernetes version the core kinds are checked against (bundled with kubernetes-validate, offline).
K8S_VERSION = "1.33.0"


# ---------------------------------------------------------------------------------------------
# Loading manifests
# ---------------------------------------------------------------------------------------------


def load_manifests(path: Path) -> list[dict[str, Any]]:
    """Every non-empty YAML document of a manifest file."""
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def all_k8s_documents() -> list[tuple[Path, dict[str, Any]]]:
    """(file, document) for every YAML document under k8s/."""
    found = []
    for path in sorted(K8S_DIR.glob("*.y*ml")):
        for doc in load_manifests(path):
            found.append((path, doc))
    return found


# ---------------------------------------------------------------------------------------------
# CRD schemas, tightened
# ---------------------------------------------------------------------------------------------


def tighten(schema: Any) -> Any:
    """A copy of an OpenAPI v3 CRD schema that jsonschema can hold a manifest to strictly.

    - `additionalProperties: false` wherever a node lists `properties`, does not preserve unknown
      fields and says nothing about additional properties: a misspelled field is rejected;
    - `x-kubernetes-int-or-string` nodes accept an integer or a string (the `anyOf` controller-gen
      writes is kept; one is added where missing);
    - `nullable: true` admits null, as the API server does.
    """
    schema = copy.deepcopy(schema)

    def visit(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                visit(item)
            return
        if not isinstance(node, dict):
            return
        if (
            "properties" in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
            and "additionalProperties" not in node
        ):
            node["additionalProperties"] = False
        if node.get("x-kubernetes-int-or-string") and "anyOf" not in node and "oneOf" not in node:
            node.pop("type", None)
            node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        if node.get("nullable") and isinstance(node.get("type"), str):
            node["type"] = [node["type"], "null"]
        for key, value in node.items():
            if key in ("enum", "default", "example", "x-kubernetes-validations"):
                continue  # data, not sub-schemas
            visit(value)

    visit(schema)
    return schema


@functools.lru_cache(maxsize=None)
def _load_crd(path: Path) -> dict[str, Any]:
    # The KubeRay CRDs are ~1 MB of YAML: the C loader reads them ten times faster.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path) as f:
        return yaml.load(f, Loader=loader)


@functools.lru_cache(maxsize=None)
def crd_schema(api_version: str, kind: str, tightened: bool = True) -> dict[str, Any]:
    """The openAPIV3Schema of (apiVersion, kind) from the CRD files in shared/k8s-schemas."""
    try:
        filename = CRD_FILES[(api_version, kind)]
    except KeyError:
        raise KeyError(f"no CRD schema known for {api_version} {kind}") from None
    path = SCHEMAS_DIR / filename
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: the CRD schemas live in the project's shared/k8s-schemas/ "
            "(set TPSERVE_SHARED_DIR if shared/ is elsewhere)"
        )
    crd = _load_crd(path)
    group, version = api_version.split("/")
    assert crd["kind"] == "CustomResourceDefinition", path
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind, path
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            assert entry.get("served", False), f"{api_version} {kind} is not served by {path.name}"
            schema = entry["schema"]["openAPIV3Schema"]
            return tighten(schema) if tightened else schema
    raise KeyError(f"{path.name} has no version {version}")


def _error_path(error: jsonschema.ValidationError) -> str:
    return "/".join(str(p) for p in error.absolute_path) or "(root)"


def _short(message: str, limit: int = 300) -> str:
    # Messages quote the offending instance, which may be a whole sub-document: keep both ends.
    return message if len(message) <= limit else message[: limit // 2] + " ... " + message[-limit // 2 :]


def crd_errors(doc: dict[str, Any], schema: dict[str, Any] | None = None) -> list[str]:
    """Messages of every place where `doc` breaks the tightened schema of its kind."""
    if schema is None:
        schema = crd_schema(doc.get("apiVersion", ""), doc.get("kind", ""))
    validator = jsonschema.Draft202012Validator(schema)
    return sorted(f"{_error_path(e)}: {_short(e.message)}" for e in validator.iter_errors(doc))


def cel_rules(doc: Any, schema: dict[str, Any], path: str = "") -> list[tuple[str, str]]:
    """(path, rule) of every `x-kubernetes-validations` CEL rule on a node the document uses.

    jsonschema can't evaluate CEL; tests list the rules that apply so that none goes unnoticed.
    """
    return [(where, rule) for where, rule, _ in _cel_nodes(doc, schema, path)]


def _kind_defaults_to_service(node: dict[str, Any]) -> bool:
    # endpointPickerRef: `kind` defaults to "Service", and a Service reference needs a port.
    return node.get("kind", "Service") != "Service" or "port" in node


# The CEL rules on fields the manifests use, written out in Python (jsonschema can't run CEL);
# node -> whether the rule holds. "self == oldSelf" (immutability) always holds on create.
CEL_EQUIVALENTS = {
    "self == oldSelf": lambda node: True,
    # InferencePool spec.targetPorts: port numbers are unique.
    "self.all(p1, self.exists_one(p2, p1.number==p2.number))": (
        lambda node: all(sum(p2.get("number") == p1.get("number") for p2 in node) == 1 for p1 in node)
    ),
    # InferencePool spec.endpointPickerRef.
    "self.kind != 'Service' || has(self.port)": _kind_defaults_to_service,
}


def cel_violations(doc: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """CEL rules on nodes `doc` uses that fail (or have no Python equivalent, which fails too)."""
    problems = []
    for where, rule, node in _cel_nodes(doc, schema):
        check = CEL_EQUIVALENTS.get(rule)
        if check is None:
            problems.append(f"{where}: CEL rule not checked offline: {rule}")
        elif not check(node):
            problems.append(f"{where}: CEL rule fails: {rule}")
    return problems


def _cel_nodes(doc: Any, schema: dict[str, Any], path: str = "") -> list[tuple[str, str, Any]]:
    # (path, rule, node) of every CEL rule on a node of `doc`, as cel_rules walks them.
    found = [(path or "/", rule["rule"], doc) for rule in schema.get("x-kubernetes-validations", [])]
    if isinstance(doc, dict):
        properties = schema.get("properties", {})
        for key, value in doc.items():
            if key in properties:
                found += _cel_nodes(value, properties[key], f"{path}/{key}")
            elif isinstance(schema.get("additionalProperties"), dict):
                found += _cel_nodes(value, schema["additionalProperties"], f"{path}/{key}")
    elif isinstance(doc, list) and isinstance(schema.get("items"), dict):
        for index, value in enumerate(doc):
            found += _cel_nodes(value, schema["items"], f"{path}/{index}")
    return found


# ---------------------------------------------------------------------------------------------
# Core kinds (kubernetes-validate, strict)
# ---------------------------------------------------------------------------------------------


def core_errors(doc: dict[str, Any]) -> list[str]:
    """kubernetes_validate.validate(doc, K8S_VERSION, strict=True) as a list of messages."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except jsonschema.ValidationError as exc:  # kubernetes_validate's error subclasses it
        return [f"{_error_path(exc)}: {_short(exc.message)}"]
    return []


def metadata_errors(metadata: dict[str, Any]) -> list[str]:
    """Strict ObjectMeta check of a custom resource's metadata (a CRD schema leaves it open)."""
    return core_errors({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata})


def pod_template_errors(template: dict[str, Any]) -> list[str]:
    """Strict core check of a pod template embedded in a custom resource."""
    return core_errors(
        {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"}, "template": template}
    )


DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def parse_go_duration(text: str) -> float:
    """Seconds of a Go duration ("30m", "1h30m", "90s") or of a plain integer of seconds."""
    if re.fullmatch(r"[0-9]+", text):
        return float(text)
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"([0-9]+(?:\.[0-9]+)?)(ns|us|µs|ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Go duration: {text!r}")
    return sum(float(n) * units[u] for n, u in parts)


def quantity(value: Any) -> float:
    """A Kubernetes resource quantity ("500m", "8", "32Gi", 1) as a number."""
    text = str(value)
    suffixes = {
        "m": 1e-3, "": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
        "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
    }
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)", text)
    if not match or match.group(2) not in suffixes:
        raise ValueError(f"not a quantity: {value!r}")
    return float(match.group(1)) * suffixes[match.group(2)]


# ---------------------------------------------------------------------------------------------
# Exported metrics
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportedMetric:
    name: str
    kind: str  # gauge | counter | histogram | info
    labels: tuple[str, ...]


def metrics_from_definitions() -> list[ExportedMetric] | None:
    """The server's single definition table, or None while it does not exist."""
    try:
        from metrics.definitions import METRIC_DEFINITIONS
    except ImportError:
        return None
    return [ExportedMetric(d.name, d.kind, tuple(d.label_names)) for d in METRIC_DEFINITIONS]


def metrics_from_design_doc(path: Path = METRICS_MD) -> list[ExportedMetric]:
    """The metric families of METRICS.md section 5 ("Exported metrics"), with their labels."""
    text = path.read_text()
    section = text.split("## 5.", 1)[1].split("\n## ", 1)[0]
    found: dict[str, ExportedMetric] = {}
    for paragraph in re.split(r"\n\s*\n", section):
        head = paragraph.lstrip().split(":", 1)[0].lower()
        if head.startswith("info gauge"):
            kind = "info"
        elif head.startswith("gauges"):
            kind = "gauge"
        elif head.startswith("counters"):
            kind = "counter"
        elif head.startswith("histograms"):
            kind = "histogram"
        else:
            continue
        for match in re.finditer(r"`(tpserve_[a-z0-9_]+)(\{([^}]*)\})?`", paragraph):
            labels = ["model_name"]
            for part in (match.group(3) or "").split(","):
                label = part.split("=")[0].strip()
                if label:
                    labels.append(label)
            found[match.group(1)] = ExportedMetric(match.group(1), kind, tuple(labels))
    return list(found.values())


def series_names(metric: ExportedMetric) -> set[str]:
    """Names of the Prometheus series of one metric family (histograms: _bucket/_sum/_count)."""
    if metric.kind == "histogram":
        return {metric.name + suffix for suffix in ("_bucket", "_sum", "_count")}
    return {metric.name}


# ---------------------------------------------------------------------------------------------
# PromQL
# ---------------------------------------------------------------------------------------------

AGGREGATIONS = {
    "sum", "avg", "min", "max", "count", "stddev", "stdvar", "group",
    "topk", "bottomk", "quantile", "count_values",
}
AGGREGATIONS_WITH_PARAM = {"topk", "bottomk", "quantile", "count_values"}
# function -> (min args, max args); arguments are checked for syntax, not type.
FUNCTIONS = {
    "rate": (1, 1), "irate": (1, 1), "increase": (1, 1), "delta": (1, 1), "idelta": (1, 1),
    "deriv": (1, 1), "resets": (1, 1), "changes": (1, 1),
    "histogram_quantile": (2, 2), "histogram_count": (1, 1), "histogram_sum": (1, 1),
    "clamp": (3, 3), "clamp_min": (2, 2), "clamp_max": (2, 2),
    "abs": (1, 1), "ceil": (1, 1), "floor": (1, 1), "round": (1, 2), "sqrt": (1, 1),
    "vector": (1, 1), "scalar": (1, 1), "time": (0, 0), "absent": (1, 1),
    "avg_over_time": (1, 1), "sum_over_time": (1, 1), "max_over_time": (1, 1),
    "min_over_time": (1, 1), "count_over_time": (1, 1), "last_over_time": (1, 1),
    "quantile_over_time": (2, 2),
    "label_replace": (5, 5), "label_join": (3, 99),
}
BINARY_OPS = {"+", "-", "*", "/", "%", "^", "==", "!=", ">", "<", ">=", "<=", "and", "or", "unless"}
COMPARISONS = {"==", "!=", ">", "<", ">=", "<="}

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<duration>(?:[0-9]+(?:ms|s|m|h|d|w|y))+)
  | (?P<number>(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<ident>[a-zA-Z_][a-zA-Z0-9_:]*)
  | (?P<op>=~|!~|==|!=|>=|<=|[-+*/%^<>=,(){}\[\]:])
    """,
    re.VERBOSE,
)


class PromQLError(ValueError):
    pass


@dataclass
class PromQLInfo:
    """What a parsed expression refers to."""

    metrics: set[str] = field(default_factory=set)
    labels: set[str] = field(default_factory=set)
    functions: set[str] = field(default_factory=set)


def tokenize(expr: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        if not match:
            raise PromQLError(f"unexpected character {expr[pos]!r} at {pos} in {expr!r}")
        pos = match.end()
        kind = match.lastgroup
        if kind != "ws":
            tokens.append((kind, match.group()))
    # Balanced brackets, checked on their own for a clear message.
    pairs = {")": "(", "]": "[", "}": "{"}
    stack: list[str] = []
    for kind, text in tokens:
        if kind == "op" and text in "([{":
            stack.append(text)
        elif kind == "op" and text in ")]}":
            if not stack or stack.pop() != pairs[text]:
                raise PromQLError(f"unbalanced {text!r} in {expr!r}")
    if stack:
        raise PromQLError(f"unclosed {stack[-1]!r} in {expr!r}")
    return tokens


class _Parser:
    def __init__(self, expr: str):
        self.expr = expr
        self.tokens = tokenize(expr)
        self.pos = 0
        self.info = PromQLInfo()

    # token helpers
    def peek(self, offset: int = 0) -> tuple[str, str]:
        index = self.pos + offset
        return self.tokens[index] if index < len(self.tokens) else ("eof", "")

    def take(self) -> tuple[str, str]:
        token = self.peek()
        self.pos += 1
        return token

    def expect(self, text: str) -> None:
        kind, got = self.take()
        if got != text:
            self.fail(f"expected {text!r}, got {got or 'end of expression'!r}")

    def fail(self, message: str) -> None:
        raise PromQLError(f"{message} (token {self.pos}) in {self.expr!r}")

    # grammar
    def parse(self) -> PromQLInfo:
        self.expression()
        if self.peek()[0] != "eof":
            self.fail(f"unexpected {self.peek()[1]!r}")
        return self.info

    def expression(self) -> None:
        self.unary()
        while True:
            kind, text = self.peek()
            if not ((kind == "op" and text in BINARY_OPS) or (kind == "ident" and text in BINARY_OPS)):
                return
            self.take()
            if text in COMPARISONS and self.peek() == ("ident", "bool"):
                self.take()
            if self.peek()[1] in ("on", "ignoring"):
                self.take()
                self.label_list()
                if self.peek()[1] in ("group_left", "group_right"):
                    self.take()
                    if self.peek()[1] == "(":
                        self.label_list()
            self.unary()

    def unary(self) -> None:
        if self.peek()[1] in ("-", "+"):
            self.take()
        self.primary()
        self.postfix()

    def postfix(self) -> None:
        if self.peek()[1] == "[":
            self.take()
            if self.take()[0] != "duration":
                self.fail("expected a duration in [...]")
            if self.peek()[1] == ":":
                self.take()
                if self.peek()[0] == "duration":
                    self.take()
            self.expect("]")
        if self.peek()[1] == "offset":
            self.take()
            if self.peek()[1] == "-":
                self.take()
            if self.take()[0] != "duration":
                self.fail("expected a duration after offset")

    def primary(self) -> None:
        kind, text = self.peek()
        if kind in ("number", "string"):
            self.take()
            return
        if text == "(":
            self.take()
            self.expression()
            self.expect(")")
            return
        if text == "{":
            self.matchers()
            return
        if kind != "ident":
            self.fail(f"unexpected {text or 'end of expression'!r}")
        if text in AGGREGATIONS:
            self.aggregation()
            return
        if self.peek(1)[1] == "(":
            if text not in FUNCTIONS:
                self.fail(f"unknown function {text!r}")
            self.function_call()
            return
        if text in BINARY_OPS or text in ("by", "without", "on", "ignoring", "offset", "bool"):
            self.fail(f"misplaced keyword {text!r}")
        self.take()
        self.info.metrics.add(text)
        if self.peek()[1] == "{":
            self.matchers()

    def aggregation(self) -> None:
        name = self.take()[1]
        self.info.functions.add(name)
        if self.peek()[1] in ("by", "without"):
            self.take()
            self.label_list()
        self.expect("(")
        if name in AGGREGATIONS_WITH_PARAM:
            self.expression()
            self.expect(",")
        self.expression()
        self.expect(")")
        if self.peek()[1] in ("by", "without"):
            self.take()
            self.label_list()

    def function_call(self) -> None:
        name = self.take()[1]
        self.info.functions.add(name)
        self.expect("(")
        count = 0
        if self.peek()[1] != ")":
            self.expression()
            count = 1
            while self.peek()[1] == ",":
                self.take()
                self.expression()
                count += 1
        self.expect(")")
        low, high = FUNCTIONS[name]
        if not low <= count <= high:
            self.fail(f"{name}() takes {low}..{high} arguments, got {count}")

    def label_list(self) -> None:
        self.expect("(")
        while self.peek()[1] != ")":
            kind, text = self.take()
            if kind != "ident":
                self.fail(f"expected a label name, got {text!r}")
            self.info.labels.add(text)
            if self.peek()[1] == ",":
                self.take()
            elif self.peek()[1] != ")":
                self.fail("expected ',' or ')' in a label list")
        self.expect(")")

    def matchers(self) -> None:
        self.expect("{")
        while self.peek()[1] != "}":
            kind, name = self.take()
            if kind != "ident":
                self.fail(f"expected a label name in {{...}}, got {name!r}")
            op = self.take()[1]
            if op not in ("=", "!=", "=~", "!~"):
                self.fail(f"expected a label matcher operator, got {op!r}")
            value_kind, value = self.take()
            if value_kind != "string":
                self.fail(f"expected a quoted label value, got {value!r}")
            if op in ("=~", "!~"):
                try:
                    re.compile(value[1:-1])
                except re.error as exc:
                    self.fail(f"bad regex {value}: {exc}")
            if name == "__name__":
                self.info.metrics.add(value[1:-1])
            else:
                self.info.labels.add(name)
            if self.peek()[1] == ",":
                self.take()
            elif self.peek()[1] != "}":
                self.fail("expected ',' or '}' in a selector")
        self.expect("}")


def parse_promql(expr: str) -> PromQLInfo:
    """Parse `expr`; return the metrics, labels and functions it uses, or raise PromQLError."""
    return _Parser(expr).parse()


# Grafana's global variables that may appear in a query, and a value that stands in for them.
GRAFANA_BUILTINS = {
    "__rate_interval": "5m",
    "__interval": "1m",
    "__range": "1h",
    "__range_s": "3600",
}


def substitute_variables(expr: str, values: dict[str, str]) -> str:
    """Replace $name, ${name} and [[name]] by values[name]; unknown variables raise PromQLError."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        name = name.split(":")[0]  # ${var:format}
        if name in values:
            return values[name]
        raise PromQLError(f"unknown dashboard variable ${name} in {expr!r}")

    return re.sub(r"\$\{([A-Za-z0-9_:]+)\}|\$([A-Za-z_][A-Za-z0-9_]*)|\[\[([A-Za-z0-9_:]+)\]\]", replace, expr)


def iter_panels(panels: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels", []))


# ---------------------------------------------------------------------------------------------
# NetworkPolicy semantics (ingress only), for "who can reach which port" checks
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    """A client pod: its labels and its namespace's labels (same_namespace: the policy's own)."""

    labels: dict[str, str] = field(default_factory=dict)
    namespace_labels: dict[str, str] = field(default_factory=dict)
    same_namespace: bool = False


def kuberay_pod_labels(template_labels: dict[str, str], node_type: str, group: str, cluster: str) -> dict[str, str]:
    """The labels KubeRay gives a Ray pod made from a group's template (its labelPod): the
    template's own, plus `ray.io/is-ray-node: "yes"`, the node type, group and cluster where the
    template does not set them (a template's label wins)."""
    added = {
        "ray.io/is-ray-node": "yes",
        "ray.io/node-type": node_type,
        "ray.io/group": group,
        "ray.io/cluster": cluster,
        "app.kubernetes.io/name": "kuberay",
        "app.kubernetes.io/created-by": "kuberay-operator",
    }
    return {**added, **template_labels}


def selector_matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions In/NotIn/Exists/DoesNotExist); {} = all."""
    if selector is None:
        return False
    unknown = set(selector) - {"matchLabels", "matchExpressions"}
    if unknown:
        raise ValueError(f"unknown selector keys {unknown}")
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        present = key in labels
        ok = {
            "In": present and labels.get(key) in values,
            "NotIn": not present or labels.get(key) not in values,
            "Exists": present,
            "DoesNotExist": not present,
        }[op]
        if not ok:
            return False
    return True


def _peer_allowed(rule_from: list[dict[str, Any]] | None, peer: Peer) -> bool:
    if not rule_from:  # absent or empty: every source
        return True
    for source in rule_from:
        if "ipBlock" in source:
            continue  # pods are not addressed by IP here
        pod_sel, ns_sel = source.get("podSelector"), source.get("namespaceSelector")
        if ns_sel is None:
            # podSelector alone: pods of the policy's own namespace.
            if peer.same_namespace and selector_matches(pod_sel, peer.labels):
                return True
        elif selector_matches(ns_sel, peer.namespace_labels) and (
            pod_sel is None or selector_matches(pod_sel, peer.labels)
        ):
            return True
    return False


def _port_allowed(rule_ports: list[dict[str, Any]] | None, port: int, named: dict[str, int]) -> bool:
    if not rule_ports:
        return True
    for entry in rule_ports:
        if entry.get("protocol", "TCP") != "TCP":
            continue
        value = entry.get("port")
        number = named.get(value) if isinstance(value, str) else value
        if value is None or (number is not None and number <= port <= entry.get("endPort", number)):
            return True
    return False


def ingress_allowed(
    policies: list[dict[str, Any]], pod_labels: dict[str, str], named_ports: dict[str, int], port: int, peer: Peer
) -> bool:
    """Whether `peer` may open TCP `port` on a pod with `pod_labels`, under these policies (one
    namespace): allowed when no policy isolates the pod for ingress, else when some rule allows."""
    isolating = [
        p
        for p in policies
        if selector_matches(p["spec"].get("podSelector", {}), pod_labels)
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not isolating:
        return True
    return any(
        _peer_allowed(rule.get("from"), peer) and _port_allowed(rule.get("ports"), port, named_ports)
        for policy in isolating
        for rule in policy["spec"].get("ingress") or []
    )

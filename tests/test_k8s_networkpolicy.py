"""Issue 42 goal 8 (and issue 12 item 10): who may open which port of a tpserve Ray pod.

- Ray's internal ports (GCS, raylets, workers, dashboard agents, the Ray client port) only from
  the RayService's own Ray pods (this namespace, its instance label and KubeRay's
  `ray.io/is-ray-node`), not from any pod that merely says `app.kubernetes.io/name: tpserve`;
- the dashboard / Jobs API (8265) only from the KubeRay operator's pods in the operator's
  namespace (namespaceSelector AND podSelector in one `from` element), closed to everyone else,
  the Ray pods included;
- the Serve port open; Ray's metrics port to Prometheus in the monitoring namespace.

The policy's semantics are evaluated offline (tests/k8s_validation.py: `ingress_allowed`) for
every Ray pod of k8s/rayservice.yaml, with the labels KubeRay gives it, and every port its Ray
container declares; the evaluator itself is checked on hand-made policies so that a wrong reading
of the rules cannot pass.
"""

from __future__ import annotations

import pytest
import yaml

from k8s_validation import K8S_DIR, Peer, core_errors, ingress_allowed, kuberay_pod_labels, load_manifests

POLICY_FILE = K8S_DIR / "networkpolicy.yaml"
DOCS = K8S_DIR.parent / "docs" / "kubernetes.md"
JOBS_API_PORT = 8265
SERVE_PORT = 8000
METRICS_PORT = 8080
# Ray ports the Ray pods must reach on each other: GCS, Ray client, dashboard agent (gRPC and
# HTTP), a node manager / object manager port, worker ports (Ray's default range 10002-19999).
RAY_PEER_PORTS = (6379, 10001, 52365, 8076, 10002, 19999, SERVE_PORT, METRICS_PORT)
# Ports no pod outside the Ray cluster may open.
RAY_INTERNAL_PORTS = (6379, 10001, 52365, 8076, 10002, 19999, JOBS_API_PORT)
OPERATOR_NAMESPACE = {"kubernetes.io/metadata.name": "kuberay-system"}

OUTSIDER = Peer(labels={"app": "curious"}, namespace_labels={"kubernetes.io/metadata.name": "other"})
NEIGHBOUR = Peer(labels={"app": "web"}, same_namespace=True)
# A pod of this namespace that carries the application's name but is no Ray pod (an endpoint
# picker, a benchmark job): the old policy gave it every Ray port.
TPSERVE_LABELLED = Peer(labels={"app.kubernetes.io/name": "tpserve"}, same_namespace=True)
OPERATOR = Peer(labels={"app.kubernetes.io/name": "kuberay-operator"}, namespace_labels=OPERATOR_NAMESPACE)
# The operator's label in some other namespace: anyone who may create pods there could forge it.
FORGED_OPERATOR = Peer(labels={"app.kubernetes.io/name": "kuberay-operator"},
                       namespace_labels={"kubernetes.io/metadata.name": "team-a"})
OPERATOR_NAMESPACE_OTHER_POD = Peer(labels={"app": "webhook"}, namespace_labels=OPERATOR_NAMESPACE)
PROMETHEUS = Peer(labels={"app.kubernetes.io/name": "prometheus"},
                  namespace_labels={"kubernetes.io/metadata.name": "monitoring"})
MONITORING_OTHER_POD = Peer(labels={"app.kubernetes.io/name": "grafana"},
                            namespace_labels={"kubernetes.io/metadata.name": "monitoring"})


def policies() -> list[dict]:
    return [doc for doc in load_manifests(POLICY_FILE) if doc["kind"] == "NetworkPolicy"]


def ray_pods() -> list[tuple[str, dict[str, str], dict[str, int]]]:
    """(group name, labels as KubeRay sets them, named ports of the Ray container) of the head
    and every worker group."""
    (service,) = load_manifests(K8S_DIR / "rayservice.yaml")
    spec = service["spec"]["rayClusterConfig"]
    cluster = service["metadata"]["name"] + "-abcde"  # a RayService's cluster: <name>-<random suffix>
    templates = [("head", "head", spec["headGroupSpec"]["template"])]
    templates += [(g["groupName"], "worker", g["template"]) for g in spec.get("workerGroupSpecs", [])]
    pods = []
    for name, node_type, template in templates:
        container = template["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
        labels = kuberay_pod_labels(template["metadata"]["labels"], node_type, name, cluster)
        pods.append((name, labels, ports))
    return pods


def ray_peers() -> list[Peer]:
    return [Peer(labels=labels, same_namespace=True) for _, labels, _ in ray_pods()]


def allowed(port: int, peer: Peer) -> dict[str, bool]:
    """Whether `peer` may open `port`, per Ray pod."""
    return {name: ingress_allowed(policies(), labels, named, port, peer) for name, labels, named in ray_pods()}


def test_the_policy_validates_and_selects_every_ray_pod():
    (policy,) = policies()
    assert core_errors(policy) == []
    assert "namespace" not in policy["metadata"], "applied in the RayService's namespace"
    for name, labels, _ in ray_pods():
        assert ingress_allowed(policies(), labels, {}, 6379, OUTSIDER) is False, f"{name} is isolated"


@pytest.mark.parametrize("port", RAY_PEER_PORTS)
def test_ray_pods_reach_each_other(port):
    for peer in ray_peers():
        assert all(allowed(port, peer).values()), f"Ray pods must reach each other on {port}"


@pytest.mark.parametrize("port", RAY_INTERNAL_PORTS)
def test_ray_internal_ports_are_closed_to_pods_that_are_not_the_ray_pods(port):
    for peer in (OUTSIDER, NEIGHBOUR, TPSERVE_LABELLED, PROMETHEUS, FORGED_OPERATOR, OPERATOR_NAMESPACE_OTHER_POD):
        assert not any(allowed(port, peer).values()), f"{port} open to {peer}"


def test_jobs_api_is_closed_by_default_and_open_to_the_operator_only():
    # Not even the Ray pods reach the Jobs API: it runs arbitrary code without authentication.
    for peer in ray_peers():
        assert not any(allowed(JOBS_API_PORT, peer).values()), "8265 closed to the Ray pods"
    # The operator (its namespace AND its label) reaches it on the head: it deploys
    # serveConfigV2 through the dashboard's REST API.
    assert allowed(JOBS_API_PORT, OPERATOR)["head"]
    # ... and nothing else of the Ray pods.
    for port in (6379, 10001, 52365, 10002):
        assert not any(allowed(port, OPERATOR).values()), f"operator reaches {port}"
    text = POLICY_FILE.read_text()
    assert "The Jobs API is closed by default" in text and "To submit jobs" in text, "the comments say how to open it"


def test_operator_rule_pairs_namespace_and_pod_selector_in_one_element():
    # Two list elements would be OR: any pod in the operator's namespace, or a pod with the
    # operator's label in the policy's own namespace. One element with both is AND.
    (policy,) = policies()
    rules = [r for r in policy["spec"]["ingress"] if any(p.get("port") == JOBS_API_PORT for p in r.get("ports", []))]
    assert rules, "a rule for 8265"
    for rule in rules:
        for source in rule["from"]:
            assert source.get("namespaceSelector", {}).get("matchLabels"), "a named namespace, not {}"
            assert source.get("podSelector", {}).get("matchLabels"), "and the operator's pods in it"


def test_serve_is_open_and_metrics_only_to_prometheus():
    for name, labels, named in ray_pods():
        assert named.get("serve") == SERVE_PORT
        for peer in (OUTSIDER, NEIGHBOUR, OPERATOR, PROMETHEUS, TPSERVE_LABELLED):
            assert ingress_allowed(policies(), labels, named, SERVE_PORT, peer), f"{name} serve port"
        assert ingress_allowed(policies(), labels, named, METRICS_PORT, PROMETHEUS)
        for peer in (OUTSIDER, MONITORING_OTHER_POD, TPSERVE_LABELLED):
            assert not ingress_allowed(policies(), labels, named, METRICS_PORT, peer), f"{name} metrics to {peer}"


def test_the_dashboard_binds_the_pod_network_only_with_the_policy_guarding_it():
    (service,) = load_manifests(K8S_DIR / "rayservice.yaml")
    params = service["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    if params.get("dashboard-host", "0.0.0.0") != "127.0.0.1":
        # KubeRay's default is 0.0.0.0 too: whichever way, the policy must close 8265.
        _, labels, named = ray_pods()[0]
        assert not ingress_allowed(policies(), labels, named, named["dashboard"], OUTSIDER)
    docs = DOCS.read_text()
    assert "kubectl apply -f k8s/networkpolicy.yaml" in docs
    # The operator is installed where the policy expects it.
    assert f"--namespace {OPERATOR_NAMESPACE['kubernetes.io/metadata.name']}" in docs


# ---- the evaluator reads rules the way Kubernetes does ---------------------------------------


def policy_of(ingress_yaml: str) -> list[dict]:
    return [{"kind": "NetworkPolicy", "spec": {"podSelector": {"matchLabels": {"a": "b"}},
                                               "policyTypes": ["Ingress"], "ingress": yaml.safe_load(ingress_yaml)}}]


def test_evaluator_semantics():
    pod = {"a": "b"}
    # No policy selects the pod: everything is allowed.
    assert ingress_allowed(policy_of("[]"), {"x": "y"}, {}, 1, OUTSIDER)
    # Selected with no rules: nothing is allowed.
    assert not ingress_allowed(policy_of("[]"), pod, {}, 1, NEIGHBOUR)
    # A rule without `from` allows every source on its ports; named ports resolve.
    rule = policy_of("[{ports: [{port: web}]}]")
    assert ingress_allowed(rule, pod, {"web": 80}, 80, OUTSIDER)
    assert not ingress_allowed(rule, pod, {"web": 80}, 81, OUTSIDER)
    # A port range includes both ends and nothing beyond.
    ranged = policy_of("[{ports: [{port: 1, endPort: 8264}, {port: 8266, endPort: 65535}]}]")
    assert ingress_allowed(ranged, pod, {}, 8264, OUTSIDER) and ingress_allowed(ranged, pod, {}, 8266, OUTSIDER)
    assert not ingress_allowed(ranged, pod, {}, 8265, OUTSIDER)
    # podSelector alone = same namespace only; with namespaceSelector {} = any namespace.
    same_ns = policy_of("[{from: [{podSelector: {matchLabels: {app: web}}}]}]")
    assert ingress_allowed(same_ns, pod, {}, 5, NEIGHBOUR)
    assert not ingress_allowed(same_ns, pod, {}, 5, Peer(labels={"app": "web"}))
    any_ns = policy_of("[{from: [{namespaceSelector: {}, podSelector: {matchLabels: {app: web}}}]}]")
    assert ingress_allowed(any_ns, pod, {}, 5, Peer(labels={"app": "web"}))
    # Two list entries are OR; one entry with both selectors is AND.
    either = policy_of("[{from: [{namespaceSelector: {}}, {podSelector: {matchLabels: {app: web}}}]}]")
    assert ingress_allowed(either, pod, {}, 5, OUTSIDER)
    both = policy_of("[{from: [{namespaceSelector: {matchLabels: {n: m}}, podSelector: {matchLabels: {app: web}}}]}]")
    assert ingress_allowed(both, pod, {}, 5, Peer(labels={"app": "web"}, namespace_labels={"n": "m"}))
    assert not ingress_allowed(both, pod, {}, 5, Peer(labels={"app": "db"}, namespace_labels={"n": "m"}))


def test_kuberay_labels_keep_the_templates_own():
    labels = kuberay_pod_labels({"app.kubernetes.io/name": "tpserve"}, "worker", "gpu", "c")
    assert labels["app.kubernetes.io/name"] == "tpserve"
    assert labels["ray.io/is-ray-node"] == "yes" and labels["ray.io/node-type"] == "worker"

"""Issue 12 item 10: the Ray dashboard / job API, GCS and client ports are reachable only from the
Ray cluster's own pods (the dashboard also from the KubeRay operator); the OpenAI API stays open.

The policy's semantics are evaluated offline (tests/k8s_validation.py: `ingress_allowed`) for
every Ray pod of k8s/rayservice.yaml and every port its Ray container declares; the evaluator
itself is checked on hand-made policies so that a wrong reading of the rules cannot pass.
"""

from __future__ import annotations

import pytest
import yaml

from k8s_validation import K8S_DIR, Peer, core_errors, ingress_allowed, load_manifests

POLICY_FILE = K8S_DIR / "networkpolicy.yaml"
# Ports no pod outside the Ray cluster may open: GCS, dashboard / job API, Ray client.
RAY_INTERNAL_PORTS = {"gcs-server": 6379, "dashboard": 8265, "client": 10001}
SERVE_PORT = 8000
METRICS_PORT = 8080

OUTSIDER = Peer(labels={"app": "curious"}, namespace_labels={"kubernetes.io/metadata.name": "other"})
NEIGHBOUR = Peer(labels={"app": "web"}, same_namespace=True)
OPERATOR = Peer(labels={"app.kubernetes.io/name": "kuberay-operator"},
                namespace_labels={"kubernetes.io/metadata.name": "kuberay-system"})
PROMETHEUS = Peer(labels={"app.kubernetes.io/name": "prometheus"},
                  namespace_labels={"kubernetes.io/metadata.name": "monitoring"})


def policies() -> list[dict]:
    return [doc for doc in load_manifests(POLICY_FILE) if doc["kind"] == "NetworkPolicy"]


def ray_pods() -> list[tuple[str, dict[str, str], dict[str, int]]]:
    """(name, labels, named ports of the Ray container) of the head and every worker group."""
    (service,) = load_manifests(K8S_DIR / "rayservice.yaml")
    spec = service["spec"]["rayClusterConfig"]
    templates = [("head", spec["headGroupSpec"]["template"])]
    templates += [(g["groupName"], g["template"]) for g in spec.get("workerGroupSpecs", [])]
    pods = []
    for name, template in templates:
        container = template["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
        pods.append((name, template["metadata"]["labels"], ports))
    return pods


def ray_peer() -> Peer:
    _, labels, _ = ray_pods()[0]
    return Peer(labels=labels, same_namespace=True)


def test_the_policy_validates_and_selects_every_ray_pod():
    (policy,) = policies()
    assert core_errors(policy) == []
    assert "namespace" not in policy["metadata"], "applied in the RayService's namespace"
    for name, labels, _ in ray_pods():
        assert ingress_allowed(policies(), labels, {}, 6379, OUTSIDER) is False, f"{name} is isolated"


@pytest.mark.parametrize("port_name", sorted(RAY_INTERNAL_PORTS))
def test_ray_internal_ports_are_closed_to_other_pods(port_name):
    port = RAY_INTERNAL_PORTS[port_name]
    for name, labels, named in ray_pods():
        for peer in (OUTSIDER, NEIGHBOUR, PROMETHEUS):
            assert not ingress_allowed(policies(), labels, named, port, peer), f"{name}:{port} open to {peer}"
        assert ingress_allowed(policies(), labels, named, port, ray_peer()), f"{name}:{port} closed to Ray"
    head_labels, head_ports = ray_pods()[0][1], ray_pods()[0][2]
    # The operator reaches the dashboard / Serve REST API (it deploys serveConfigV2 through it), nothing else.
    assert ingress_allowed(policies(), head_labels, head_ports, port, OPERATOR) == (port == 8265)


def test_serve_is_open_and_metrics_only_to_monitoring():
    for name, labels, named in ray_pods():
        assert named.get("serve") == SERVE_PORT
        for peer in (OUTSIDER, NEIGHBOUR, OPERATOR, PROMETHEUS):
            assert ingress_allowed(policies(), labels, named, SERVE_PORT, peer), f"{name} serve port"
        assert ingress_allowed(policies(), labels, named, METRICS_PORT, PROMETHEUS)
        assert not ingress_allowed(policies(), labels, named, METRICS_PORT, OUTSIDER)


def test_the_dashboard_binds_the_pod_network_only_with_the_policy_guarding_it():
    (service,) = load_manifests(K8S_DIR / "rayservice.yaml")
    params = service["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    if params.get("dashboard-host", "0.0.0.0") != "127.0.0.1":
        # KubeRay's default is 0.0.0.0 too: whichever way, the policy must close 8265.
        _, labels, named = ray_pods()[0]
        assert not ingress_allowed(policies(), labels, named, named["dashboard"], OUTSIDER)
    readme = (K8S_DIR / "README.md").read_text()
    assert "kubectl apply -f k8s/networkpolicy.yaml" in readme


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
    # podSelector alone = same namespace only; with namespaceSelector {} = any namespace.
    same_ns = policy_of("[{from: [{podSelector: {matchLabels: {app: web}}}]}]")
    assert ingress_allowed(same_ns, pod, {}, 5, NEIGHBOUR)
    assert not ingress_allowed(same_ns, pod, {}, 5, Peer(labels={"app": "web"}))
    any_ns = policy_of("[{from: [{namespaceSelector: {}, podSelector: {matchLabels: {app: web}}}]}]")
    assert ingress_allowed(any_ns, pod, {}, 5, Peer(labels={"app": "web"}))
    # Two list entries are OR; one entry with both selectors is AND.
    either = policy_of("[{from: [{namespaceSelector: {}}, {podSelector: {matchLabels: {app: web}}}]}]")
    assert ingress_allowed(either, pod, {}, 5, OUTSIDER)

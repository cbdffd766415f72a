"""Issue 43 goal 5: k8s/inference-pool.yaml wires an endpoint picker (EPP) to tpserve's pods.

The schema checks (InferencePool CRD, core kinds) are in test_k8s_manifests.py with every other
document; here, that the pieces fit together: the pool selects exactly the GPU worker pods of
k8s/rayservice.yaml on their Serve port, it names the EPP's Service and port, the EPP is started
on that pool with the ConfigMap it mounts, may watch what it must, and the network policy lets it
scrape the pods without letting it into Ray's ports.
"""

from __future__ import annotations

from typing import Any

import yaml

from k8s_validation import K8S_DIR, Peer, ingress_allowed, kuberay_pod_labels, load_manifests, selector_matches

INFERENCE_POOL = K8S_DIR / "inference-pool.yaml"


def documents() -> dict[str, dict[str, Any]]:
    """The file's documents by kind (one of each)."""
    docs = load_manifests(INFERENCE_POOL)
    kinds = [d["kind"] for d in docs]
    assert len(kinds) == len(set(kinds)), kinds
    return {d["kind"]: d for d in docs}


def ray_pods() -> dict[str, tuple[dict[str, str], dict[str, Any]]]:
    """Group name -> (pod labels as KubeRay sets them, Ray container)."""
    (service,) = load_manifests(K8S_DIR / "rayservice.yaml")
    spec = service["spec"]["rayClusterConfig"]
    groups = [("head", "head", spec["headGroupSpec"]["template"])]
    groups += [(g["groupName"], "worker", g["template"]) for g in spec["workerGroupSpecs"]]
    return {
        name: (kuberay_pod_labels(t["metadata"]["labels"], kind, name, "tpserve-x"), t["spec"]["containers"][0])
        for name, kind, t in groups
    }


def epp_container() -> dict[str, Any]:
    (container,) = documents()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def flag(args: list[str], name: str) -> str:
    """The value of `--name value` or `--name=value`."""
    for index, arg in enumerate(args):
        if arg == f"--{name}":
            return args[index + 1]
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"--{name} not set")


def test_pool_selects_the_gpu_workers_on_their_serve_port():
    pool = documents()["InferencePool"]["spec"]
    selected = {name for name, (labels, _) in ray_pods().items() if selector_matches(pool["selector"], labels)}
    assert selected == {name for name in ray_pods() if name != "head"}, "engine pods only, not the head"
    epp_labels = documents()["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert not selector_matches(pool["selector"], epp_labels)
    for name in selected:
        _, container = ray_pods()[name]
        serve = {p["name"]: p["containerPort"] for p in container["ports"]}["serve"]
        assert [p["number"] for p in pool["targetPorts"]] == [serve]
        labels, _ = ray_pods()[name]
        assert labels["inference.networking.k8s.io/engine-type"] == "tpserve"


def test_pool_names_the_epp_service_and_its_grpc_port():
    docs = documents()
    ref = docs["InferencePool"]["spec"]["endpointPickerRef"]
    service = docs["Service"]
    assert ref.get("kind", "Service") == "Service" and ref["name"] == service["metadata"]["name"]
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    container_ports = {p["containerPort"] for p in epp_container()["ports"]}
    assert port["targetPort"] in container_ports
    assert selector_matches({"matchLabels": service["spec"]["selector"]},
                            docs["Deployment"]["spec"]["template"]["metadata"]["labels"])


def test_epp_runs_for_this_pool_with_the_mounted_config():
    docs = documents()
    args = epp_container()["args"]
    assert flag(args, "pool-name") == docs["InferencePool"]["metadata"]["name"]
    assert flag(args, "pool-group") == docs["InferencePool"]["apiVersion"].split("/")[0]
    config_path = flag(args, "config-file")
    (mount,) = [m for m in epp_container()["volumeMounts"] if config_path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in docs["Deployment"]["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    key = config_path[len(mount["mountPath"]) + 1:]
    config = yaml.safe_load(docs["ConfigMap"]["data"][key])
    assert config["kind"] == "EndpointPickerConfig"
    # Every plugin a profile or data source refers to is declared (by type, its default name).
    declared = {p.get("name", p["type"]) for p in config["plugins"]}
    refs = {p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]}
    for source in config["data"]["sources"]:
        refs |= {source["pluginRef"], *(e["pluginRef"] for e in source["extractors"])}
    assert refs <= declared, refs - declared
    # From EPP v1.4 the metric flags are refused: names come from the config only.
    assert not [a for a in args if a.lstrip("-").split("=")[0].endswith("-metric")]


def test_epp_may_watch_the_pool_and_pods_and_nothing_cluster_wide():
    docs = documents()
    account = docs["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"]
    assert docs["ServiceAccount"]["metadata"]["name"] == account
    binding = docs["RoleBinding"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": docs["Role"]["metadata"]["name"]}
    assert {"kind": "ServiceAccount", "name": account} in [{k: s[k] for k in ("kind", "name")} for s in binding["subjects"]]
    granted = {(group, resource) for rule in docs["Role"]["rules"] for group in rule["apiGroups"] for resource in rule["resources"]
               if set(rule["verbs"]) >= {"get", "list", "watch"}}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= granted
    verbs = {verb for rule in docs["Role"]["rules"] for verb in rule["verbs"]}
    assert verbs <= {"get", "list", "watch"}, "read-only"
    assert "ClusterRole" not in docs and "ClusterRoleBinding" not in docs


def test_network_policy_lets_the_epp_scrape_but_not_into_ray():
    policies = [d for d in load_manifests(K8S_DIR / "networkpolicy.yaml") if d["kind"] == "NetworkPolicy"]
    epp = Peer(labels=documents()["Deployment"]["spec"]["template"]["metadata"]["labels"], same_namespace=True)
    target = documents()["InferencePool"]["spec"]["targetPorts"][0]["number"]
    for name, (labels, _) in ray_pods().items():
        assert ingress_allowed(policies, labels, {}, target, epp), f"EPP scrapes {name}"
        for port in (6379, 8265, 10001, 52365):
            assert not ingress_allowed(policies, labels, {}, port, epp), f"EPP reaches {name}:{port}"

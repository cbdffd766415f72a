"""Issue 42 goal 8: the pods of k8s/ run restricted, with the volumes that needs, and a pod-local
readiness probe.

`hardening_problems` reads the manifests the way the kubelet applies them (a container's
securityContext over its pod's) and lists every property that is missing; the shipped manifests
have none, and each test removes one property from a copy and expects its own complaint, so no
property can go unnoticed.

- every container (Ray head and workers, the autoscaler sidecar KubeRay adds from
  autoscalerOptions, the endpoint picker): runAsNonRoot with a numeric non-zero uid where the image
  names its user, allowPrivilegeEscalation false, capabilities drop ALL (none added),
  seccompProfile RuntimeDefault, readOnlyRootFilesystem;
- Ray containers: writable emptyDir volumes where Ray and the caches write (/tmp, ~/.cache, the
  kernels cache), env caches pointing into them, and /dev/shm a memory-backed emptyDir larger than
  Ray's object store;
- GPU workers' readiness: this pod's own raylet and Serve proxy on localhost, nothing routed.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Callable

import pytest

from k8s_validation import K8S_DIR, load_manifests, quantity

RAYSERVICE = K8S_DIR / "rayservice.yaml"
INFERENCE_POOL = K8S_DIR / "inference-pool.yaml"
# Paths a Ray container writes at run time (the root filesystem being read-only): Ray's session
# directory and spilled objects (/tmp/ray), Triton's and torch's caches (~/.cache; TRITON_CACHE_DIR
# points there), the CPU kernels tpserve builds at first start ($TPSERVE_CACHE/kernels).
RAY_WRITABLE_PATHS = ("/tmp", "/home/ray/.cache", "/opt/tpserve-cache/kernels")
SERVE_PORT = 8000
RAYLET_AGENT_PORT = 52365


def rayservice() -> dict[str, Any]:
    (doc,) = load_manifests(RAYSERVICE)
    return doc


def epp_deployment() -> dict[str, Any]:
    (doc,) = [d for d in load_manifests(INFERENCE_POOL) if d["kind"] == "Deployment"]
    return doc


def ray_pod_specs(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    spec = doc["spec"]["rayClusterConfig"]
    specs = [("head", spec["headGroupSpec"]["template"]["spec"])]
    specs += [(g["groupName"], g["template"]["spec"]) for g in spec.get("workerGroupSpecs", [])]
    return specs


def effective(pod: dict[str, Any], container: dict[str, Any], key: str) -> Any:
    """A securityContext field as the kubelet applies it: the container's, else the pod's."""
    own = container.get("securityContext", {})
    return own[key] if key in own else pod.get("securityContext", {}).get(key)


def container_problems(where: str, pod: dict[str, Any], container: dict[str, Any], numeric_uid: bool) -> list[str]:
    problems = []
    context = container.get("securityContext", {})
    if effective(pod, container, "runAsNonRoot") is not True:
        problems.append(f"{where}: runAsNonRoot")
    uid = effective(pod, container, "runAsUser")
    if numeric_uid and (not isinstance(uid, int) or uid == 0):
        # The image's USER is a name (`ray`): the kubelet can't verify runAsNonRoot without a uid.
        problems.append(f"{where}: runAsUser (numeric, non-zero)")
    if context.get("allowPrivilegeEscalation") is not False:
        problems.append(f"{where}: allowPrivilegeEscalation false")
    capabilities = context.get("capabilities", {})
    if capabilities.get("drop") != ["ALL"] or capabilities.get("add"):
        problems.append(f"{where}: capabilities drop ALL")
    if (effective(pod, container, "seccompProfile") or {}).get("type") != "RuntimeDefault":
        problems.append(f"{where}: seccompProfile RuntimeDefault")
    if context.get("readOnlyRootFilesystem") is not True:
        problems.append(f"{where}: readOnlyRootFilesystem")
    if context.get("privileged"):
        problems.append(f"{where}: privileged")
    return problems


def mounts(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """mountPath -> the volume mounted there."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    return {m["mountPath"]: volumes.get(m["name"], {}) for m in container.get("volumeMounts", [])}


def writable(path: str, mounted: dict[str, dict[str, Any]]) -> bool:
    """Whether `path` lies on an emptyDir mount (the deepest mount that holds it)."""
    holders = [m for m in mounted if path == m or path.startswith(m.rstrip("/") + "/")]
    return bool(holders) and "emptyDir" in mounted[max(holders, key=len)]


def ray_volume_problems(name: str, group: dict[str, Any], pod: dict[str, Any]) -> list[str]:
    problems = []
    container = pod["containers"][0]
    mounted = mounts(pod, container)
    for path in RAY_WRITABLE_PATHS:
        if not writable(path, mounted):
            problems.append(f"{name}: {path} on a writable emptyDir")
    env = {e["name"]: e.get("value", "") for e in container.get("env", [])}
    if not writable(env.get("TRITON_CACHE_DIR", "/home/ray/.triton/cache"), mounted):
        problems.append(f"{name}: TRITON_CACHE_DIR on a writable volume")
    shm = mounted.get("/dev/shm", {}).get("emptyDir")
    if shm is None or shm.get("medium") != "Memory":
        problems.append(f"{name}: /dev/shm a memory-backed emptyDir")
    else:
        size = quantity(shm.get("sizeLimit", "0"))
        store = group.get("rayStartParams", {}).get("object-store-memory")
        # Ray puts its object store in /dev/shm only when it fits there (else a slow disk store).
        if not size or store is None or float(store) >= size:
            problems.append(f"{name}: object-store-memory below the /dev/shm sizeLimit")
    return problems


URL = re.compile(r"https?://([^/:\s]+)(?::([0-9]+))?(/[^\s|&;]*)?")


def probe_problems(name: str, container: dict[str, Any]) -> list[str]:
    """A readiness probe that asks only this pod's own processes: localhost URLs, this pod's Serve
    proxy health (`/-/healthz`, answered by the proxy, never routed) and its raylet; no path on
    the Serve port that the proxy would route to some replica of the cluster."""
    probe = container.get("readinessProbe")
    if probe is None:
        return [f"{name}: a readiness probe"]
    if "exec" not in probe:
        return [f"{name}: an exec probe on localhost"]
    urls = URL.findall(" ".join(probe["exec"]["command"]))
    problems = []
    for host, port, path in urls:
        if host not in ("localhost", "127.0.0.1"):
            problems.append(f"{name}: probe asks {host}, not this pod")
        if int(port or 80) == SERVE_PORT and not (path or "/").startswith("/-/"):
            problems.append(f"{name}: probe path {path} is routed by Serve to any replica")
    checked = {(int(port or 80), path) for _, port, path in urls}
    if (SERVE_PORT, "/-/healthz") not in checked:
        problems.append(f"{name}: probe checks this pod's Serve proxy (/-/healthz)")
    if (RAYLET_AGENT_PORT, "/api/local_raylet_healthz") not in checked:
        problems.append(f"{name}: probe checks this pod's raylet")
    return problems


def hardening_problems(service: dict[str, Any], epp: dict[str, Any]) -> list[str]:
    problems = []
    spec = service["spec"]["rayClusterConfig"]
    groups = {"head": spec["headGroupSpec"], **{g["groupName"]: g for g in spec.get("workerGroupSpecs", [])}}
    for name, pod in ray_pod_specs(service):
        context = pod.get("securityContext", {})
        if context.get("runAsNonRoot") is not True or (context.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
            problems.append(f"{name} pod: runAsNonRoot and seccompProfile at pod level")
        for container in pod["containers"] + pod.get("initContainers", []):
            problems += container_problems(f"{name}/{container['name']}", pod, container, numeric_uid=True)
        problems += ray_volume_problems(name, groups[name], pod)
        if name != "head":
            problems += probe_problems(name, pod["containers"][0])
    # The autoscaler sidecar KubeRay adds to the head pod, from autoscalerOptions.
    head_pod = spec["headGroupSpec"]["template"]["spec"]
    autoscaler = {"name": "autoscaler", **spec.get("autoscalerOptions", {})}
    problems += container_problems("head/autoscaler", head_pod, autoscaler, numeric_uid=True)
    if not writable("/tmp", mounts(head_pod, autoscaler)):
        problems.append("head/autoscaler: /tmp on a writable emptyDir")
    epp_pod = epp["spec"]["template"]["spec"]
    for container in epp_pod["containers"]:
        # The EPP image is distroless `nonroot` (uid 65532).
        problems += container_problems(f"epp/{container['name']}", epp_pod, container, numeric_uid=True)
    return problems


def test_shipped_manifests_are_hardened():
    assert hardening_problems(rayservice(), epp_deployment()) == []


def _head(doc):
    return doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]


def _worker(doc):
    return doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]


def _drop_mount(pod, path):
    container = pod["containers"][0]
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["mountPath"] != path]


def _pop_everywhere(pod, key):
    # From the pod's securityContext and every container's: the property is gone, not overridden.
    pod.get("securityContext", {}).pop(key, None)
    for container in pod["containers"]:
        container.get("securityContext", {}).pop(key, None)


def _set_probe(pod, command):
    pod["containers"][0]["readinessProbe"]["exec"]["command"] = ["bash", "-c", command]


# property -> (remove it from a copy of the RayService (or the EPP Deployment), expected complaint)
REMOVALS: dict[str, tuple[Callable[[dict, dict], None], str]] = {
    "run as non-root": (lambda s, e: _pop_everywhere(_worker(s), "runAsNonRoot"), "gpu/ray-worker: runAsNonRoot"),
    "numeric uid": (lambda s, e: _pop_everywhere(_head(s), "runAsUser"), "head/ray-head: runAsUser"),
    "root uid": (lambda s, e: _worker(s)["containers"][0]["securityContext"].update(runAsUser=0), "gpu/ray-worker: runAsUser"),
    "privilege escalation": (lambda s, e: _head(s)["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
                             "head/ray-head: allowPrivilegeEscalation false"),
    "capabilities": (lambda s, e: _worker(s)["containers"][0]["securityContext"].pop("capabilities"),
                     "gpu/ray-worker: capabilities drop ALL"),
    "added capability": (lambda s, e: _worker(s)["containers"][0]["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
                         "gpu/ray-worker: capabilities drop ALL"),
    "seccomp": (lambda s, e: _pop_everywhere(_worker(s), "seccompProfile"), "gpu/ray-worker: seccompProfile"),
    "pod-level context": (lambda s, e: _head(s)["securityContext"].pop("runAsNonRoot"), "head pod: runAsNonRoot and seccompProfile"),
    "read-only root": (lambda s, e: _head(s)["containers"][0]["securityContext"].pop("readOnlyRootFilesystem"),
                       "head/ray-head: readOnlyRootFilesystem"),
    "writable tmp": (lambda s, e: _drop_mount(_worker(s), "/tmp"), "gpu: /tmp on a writable emptyDir"),
    "writable cache": (lambda s, e: _drop_mount(_head(s), "/home/ray/.cache"), "head: /home/ray/.cache on a writable emptyDir"),
    "writable kernels": (lambda s, e: _drop_mount(_worker(s), "/opt/tpserve-cache/kernels"),
                         "gpu: /opt/tpserve-cache/kernels on a writable emptyDir"),
    "triton cache": (lambda s, e: _worker(s)["containers"][0].update(
        env=[v for v in _worker(s)["containers"][0]["env"] if v["name"] != "TRITON_CACHE_DIR"]), "gpu: TRITON_CACHE_DIR"),
    "dev shm": (lambda s, e: _drop_mount(_worker(s), "/dev/shm"), "gpu: /dev/shm a memory-backed emptyDir"),
    "dev shm on disk": (lambda s, e: [v["emptyDir"].pop("medium") for v in _head(s)["volumes"] if v["name"] == "dshm"],
                        "head: /dev/shm a memory-backed emptyDir"),
    "object store beyond shm": (lambda s, e: s["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"].update(
        {"object-store-memory": "9000000000"}), "gpu: object-store-memory below the /dev/shm sizeLimit"),
    "autoscaler context": (lambda s, e: s["spec"]["rayClusterConfig"]["autoscalerOptions"].pop("securityContext"),
                           "head/autoscaler: allowPrivilegeEscalation false"),
    "epp context": (lambda s, e: e["spec"]["template"]["spec"]["containers"][0].pop("securityContext"),
                    "epp/epp: allowPrivilegeEscalation false"),
    "probe through a service": (lambda s, e: _set_probe(_worker(s), "wget -q -O- http://tpserve-serve-svc:8000/-/healthz"),
                                "gpu: probe asks tpserve-serve-svc"),
    "probe routed to any replica": (lambda s, e: _set_probe(_worker(s),
        "wget -q -O- http://localhost:52365/api/local_raylet_healthz && wget -q -O- http://localhost:8000/-/healthz"
        " && wget -q -O /dev/null http://localhost:8000/health"), "gpu: probe path /health is routed"),
    "probe without the proxy": (lambda s, e: _set_probe(_worker(s), "wget -q -O- http://localhost:52365/api/local_raylet_healthz"),
                                "gpu: probe checks this pod's Serve proxy"),
}


@pytest.mark.parametrize("case", sorted(REMOVALS))
def test_removing_a_property_is_noticed(case):
    remove, expected = REMOVALS[case]
    service, epp = copy.deepcopy(rayservice()), copy.deepcopy(epp_deployment())
    remove(service, epp)
    problems = hardening_problems(service, epp)
    assert any(p.startswith(expected) for p in problems), (case, problems)


def test_memory_limits_leave_room_for_dev_shm():
    # tmpfs pages count against the container's memory limit: /dev/shm must leave the processes
    # most of it.
    for name, pod in ray_pod_specs(rayservice()):
        shm = mounts(pod, pod["containers"][0])["/dev/shm"]["emptyDir"]
        limit = quantity(pod["containers"][0]["resources"]["limits"]["memory"])
        assert quantity(shm["sizeLimit"]) <= limit / 3, name

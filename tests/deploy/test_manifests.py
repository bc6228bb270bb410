"""The Kubernetes manifests in deploy/: rendered with kustomize, validated, and checked for invariants.

Every overlay (and the overlays with each component added) is rendered with
``kubectl kustomize`` and validated offline against the Kubernetes OpenAPI
schemas with ``kubernetes-validate --strict``, for Kubernetes 1.30.0 (the
oldest version supported: the preStop ``sleep`` action is on by default from
1.30) and the newest version kubernetes-validate ships. Then the invariants:
each tier scaled by its own HPA on its own signal, gRPC probes on the served
port, GPUs only where they belong, non-root read-only pods, NetworkPolicies
that allow exactly the documented flows, and environment variables that the
settings classes actually read. Each invariant check is also run on a broken
copy to show that it can fail.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from deploy_helpers import (
    COMPONENT,
    CUSTOM_KINDS,
    DEPLOY,
    KEDA_VARIANTS,
    REPO,
    TIER_METRICS,
    TIERS,
    VARIANTS,
    Peer,
    allowed_flows,
    containers,
    egress_flows,
    find,
    is_specserve_server,
    max_replicas,
    named_port,
    one,
    peer,
    pod_template,
    resolve_env,
    role_of,
    selector_matches,
    tier_workload,
    workloads,
)

from specserve.runtime.config import CoordinatorSettings, DraftSettings, TargetSettings

SETTINGS = {"coordinator": CoordinatorSettings, "draft": DraftSettings, "target": TargetSettings}
CPU_HPA_VARIANTS = {"cpu-demo", "gpu+cpu-hpa"}
GPU_VARIANTS = {"gpu", "gpu+cpu-hpa", "gpu+external-redis", "gpu+keda"}
GPU = "nvidia.com/gpu"
GPU_POOL = "specserve.io/gpu-pool"
#: Environment variables other than SPECSERVE_* that specserve containers may set (none).
OTHER_ENV_ALLOWED: set[str] = set()
MIN_K8S = "1.30.0"

ALL = pytest.mark.parametrize("variant", list(VARIANTS))


def newest_schema_version() -> str:
    import kubernetes_validate

    schema_dir = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    versions = [
        tuple(int(x) for x in m.group(1).split("."))
        for d in schema_dir.iterdir()
        if (m := re.fullmatch(r"v(\d+\.\d+\.\d+)-local-strict", d.name))
    ]
    return ".".join(map(str, max(versions)))


# --------------------------------------------------------------------------- schema validation


def _validate(files: list[Path], version: str) -> tuple[int, str]:
    exe = shutil.which("kubernetes-validate")
    if exe is None:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")
    out = subprocess.run(
        [exe, "--strict", "--kubernetes-version", version, *map(str, files)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.returncode, out.stdout + out.stderr


@pytest.mark.parametrize("version", [MIN_K8S, "newest"])
def test_every_rendered_object_validates_against_the_kubernetes_schemas(rendered, tmp_path, version):
    """kubernetes-validate --strict passes every object of every variant, and none is skipped for want of a schema.

    Objects that several variants render identically are validated once. Custom resources (KEDA's
    ScaledObject) have no schema there; tests/deploy/test_keda.py validates them against KEDA's.
    """
    version = newest_schema_version() if version == "newest" else version
    unique = {
        json.dumps(d, sort_keys=True): d
        for docs in rendered.values()
        for d in docs
        if d["kind"] not in CUSTOM_KINDS
    }
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(list(unique.values())))
    loader = DEPLOY / "tools" / "model-loader.yaml"
    rc, output = _validate([path, loader], version)
    assert rc == 0, output
    assert "ERROR" not in output and "WARN" not in output, output
    assert output.count(" passed for resource ") == len(unique) + 1, output


def test_schema_validation_rejects_an_unknown_field(rendered, tmp_path):
    """Control: the strict validation above would catch a misspelt field."""
    docs = copy.deepcopy(rendered["gpu"])
    target = tier_workload(docs, "target")
    pod_template(target)["spec"]["containers"][0]["readinessProbe"]["grcp"] = {"port": 50052}
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump_all([target]))
    rc, output = _validate([path], MIN_K8S)
    assert rc != 0 and "grcp" in output, output


# --------------------------------------------------------------------------- HPAs


def metric_name(metric: dict) -> str | None:
    """The custom (Pods) or external metric an HPA metric entry names; None for Resource metrics."""
    kind = {"Pods": "pods", "External": "external", "Object": "object"}.get(metric["type"])
    return metric[kind]["metric"]["name"] if kind else None


def hpa_problems(docs: list[dict], cpu_fallback: bool) -> list[str]:
    problems = []
    hpas = find(docs, "HorizontalPodAutoscaler")
    for tier in TIERS:
        workload = tier_workload(docs, tier)
        mine = [
            h
            for h in hpas
            if h["spec"]["scaleTargetRef"]["kind"] == workload["kind"]
            and h["spec"]["scaleTargetRef"]["name"] == workload["metadata"]["name"]
            and h["spec"]["scaleTargetRef"]["apiVersion"] == workload["apiVersion"]
        ]
        if len(mine) != 1:
            problems.append(
                f"{tier}: {len(mine)} HPAs target {workload['kind']}/{workload['metadata']['name']}"
            )
            continue
        hpa = mine[0]
        if hpa["apiVersion"] != "autoscaling/v2":
            problems.append(f"{tier}: HPA apiVersion {hpa['apiVersion']}")
        if not 1 <= hpa["spec"].get("minReplicas", 1) <= hpa["spec"]["maxReplicas"]:
            problems.append(f"{tier}: bad replica bounds")
        metrics = hpa["spec"]["metrics"]
        if cpu_fallback:
            ok = [m for m in metrics if m["type"] == "Resource" and m["resource"]["name"] == "cpu"]
            if len(ok) != len(metrics) or not ok:
                problems.append(f"{tier}: CPU fallback HPA has metrics {metrics}")
            for c in pod_template(workload)["spec"]["containers"]:
                if "cpu" not in c.get("resources", {}).get("requests", {}):
                    problems.append(
                        f"{tier}: container {c['name']} has no CPU request (utilisation undefined)"
                    )
        else:
            names = {metric_name(m) for m in metrics}
            if names != TIER_METRICS[tier] or len(metrics) != len(names):
                problems.append(f"{tier}: HPA metrics {metrics}, want {sorted(TIER_METRICS[tier])}")
            for m in metrics:
                if m["type"] == "External" and m["external"]["target"]["type"] != "AverageValue":
                    problems.append(f"{tier}: external metric {metric_name(m)} not divided by replicas")
    return problems


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v not in KEDA_VARIANTS])
def test_every_tier_has_its_own_hpa_on_its_own_signal(rendered, variant):
    """(KEDA variants scale through ScaledObjects instead: tests/deploy/test_keda.py.)"""
    assert hpa_problems(rendered[variant], variant in CPU_HPA_VARIANTS) == []


def test_hpa_check_can_fail(rendered):
    docs = copy.deepcopy(rendered["gpu"])
    draft_hpa = one(docs, "HorizontalPodAutoscaler", "draft")
    draft_hpa["spec"]["metrics"] = copy.deepcopy(
        one(docs, "HorizontalPodAutoscaler", "target")["spec"]["metrics"]
    )
    one(docs, "HorizontalPodAutoscaler", "coordinator")["spec"]["scaleTargetRef"]["name"] = "target"
    problems = hpa_problems(docs, cpu_fallback=False)
    assert any(p.startswith("draft:") for p in problems)
    assert any(p.startswith("coordinator:") for p in problems)


def test_every_custom_metric_in_an_hpa_is_served_by_the_adapter(rendered):
    """Each Pods metric an HPA asks for has a Prometheus-adapter custom rule exposing it per pod,
    each External metric an external rule exposing it per namespace."""
    values = yaml.safe_load((DEPLOY / "prometheus-adapter" / "values.yaml").read_text())
    exposed: dict[str, set[str]] = {"Pods": set(), "External": set()}
    for kind, rules in (("Pods", values["rules"]["custom"]), ("External", values["rules"]["external"])):
        for rule in rules:
            overrides = rule["resources"]["overrides"]
            assert overrides["namespace"]["resource"] == "namespace"
            if kind == "Pods":
                assert overrides["pod"]["resource"] == "pod"
            series = rule["seriesQuery"].split("{")[0]
            assert re.fullmatch(rule["name"]["matches"], series), rule
            assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
            exposed[kind].add(re.sub(rule["name"]["matches"], rule["name"]["as"], series))
    wanted: dict[str, set[str]] = {"Pods": set(), "External": set()}
    for docs in rendered.values():
        for h in find(docs, "HorizontalPodAutoscaler"):
            for m in h["spec"]["metrics"]:
                if m["type"] != "Resource":
                    wanted[m["type"]].add(metric_name(m))
    assert wanted["Pods"] | wanted["External"] == set().union(*TIER_METRICS.values())
    assert wanted["Pods"] <= exposed["Pods"] and wanted["External"] <= exposed["External"]


# --------------------------------------------------------------------------- probes, ports, shutdown


def probe_problems(docs: list[dict]) -> list[str]:
    problems = []
    servers = [c for c in containers(docs) if is_specserve_server(c)]
    if {role_of(c) for c in servers} != set(TIERS):
        problems.append(f"server roles {sorted(role_of(c) for c in servers)}")
    for c in servers:
        where = f"{c.workload}/{c.name}"
        env = resolve_env(docs, c)
        port = int(env.get("SPECSERVE_PORT", SETTINGS[role_of(c)].model_fields["port"].default))
        if named_port(c.spec, "grpc") != port:
            problems.append(
                f"{where}: containerPort 'grpc' {named_port(c.spec, 'grpc')} != served port {port}"
            )
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            probe = c.spec.get(kind)
            if probe is None or set(probe) & {"exec", "httpGet", "tcpSocket"} or "grpc" not in probe:
                problems.append(f"{where}: {kind} is not a gRPC probe: {probe}")
            elif probe["grpc"]["port"] != port:
                problems.append(
                    f"{where}: {kind} probes port {probe['grpc']['port']}, server listens on {port}"
                )
        startup = c.spec.get("startupProbe") or {}
        budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
        if role_of(c) != "coordinator" and budget < 300:
            problems.append(f"{where}: startup probe allows {budget}s for model loading (< 300 s)")
    return problems


@ALL
def test_every_server_container_has_grpc_probes_on_its_served_port(rendered, variant):
    assert probe_problems(rendered[variant]) == []


def test_probe_check_can_fail(rendered):
    docs = copy.deepcopy(rendered["gpu"])
    containers_ = pod_template(tier_workload(docs, "draft"))["spec"]["containers"]
    containers_[0]["livenessProbe"] = {"tcpSocket": {"port": 50053}}
    pod_template(tier_workload(docs, "target"))["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = (
        50051
    )
    problems = probe_problems(docs)
    assert any("draft" in p and "livenessProbe" in p for p in problems)
    assert any("target" in p and "readinessProbe" in p for p in problems)


@ALL
def test_services_route_to_the_served_grpc_port(rendered, variant):
    """Every Service port reaches the container's gRPC port, or on the coordinator its HTTP API port,
    and the HTTP API listens where the container port says (SPECSERVE_HTTP_PORT)."""
    docs = rendered[variant]
    for tier in TIERS:
        template = pod_template(tier_workload(docs, tier))
        container = template["spec"]["containers"][0]
        env = resolve_env(docs, next(c for c in containers(docs) if c.spec is container))
        served = {"grpc": named_port(container, "grpc")}
        if tier == "coordinator":
            served["http"] = int(env["SPECSERVE_HTTP_PORT"])
            assert named_port(container, "http") == served["http"]
        services = [
            s
            for s in find(docs, "Service")
            if selector_matches({"matchLabels": s["spec"]["selector"]}, template["metadata"]["labels"])
        ]
        assert services, f"no Service selects the {tier} pods"
        for s in services:
            for p in s["spec"]["ports"]:
                target = p["targetPort"]
                number = named_port(container, target) if isinstance(target, str) else target
                assert number in served.values(), (tier, s["metadata"]["name"], p)


@ALL
def test_redis_has_probes_and_the_tiers_have_pdbs(rendered, variant):
    docs = rendered[variant]
    for c in containers(docs, include_init=False):
        if c.workload == "redis":
            assert c.spec.get("readinessProbe") and c.spec.get("livenessProbe")
    pdbs = find(docs, "PodDisruptionBudget")
    for tier in TIERS:
        labels = pod_template(tier_workload(docs, tier))["metadata"]["labels"]
        mine = [p for p in pdbs if selector_matches(p["spec"]["selector"], labels)]
        assert len(mine) == 1, f"{tier}: {len(mine)} PDBs"
        other_tiers = [pod_template(tier_workload(docs, t))["metadata"]["labels"] for t in TIERS if t != tier]
        assert not any(selector_matches(mine[0]["spec"]["selector"], o) for o in other_tiers)


def grace_problems(docs: list[dict]) -> list[str]:
    """terminationGracePeriodSeconds covers preStop + drain + stop (specserve.runtime.server: 2 x shutdown grace)."""
    problems = []
    for c in (c for c in containers(docs) if is_specserve_server(c)):
        sleep = c.spec.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds")
        if sleep is None:
            problems.append(f"{c.workload}: no preStop sleep")
            continue
        env = resolve_env(docs, c)
        grace = float(
            env.get(
                "SPECSERVE_SHUTDOWN_GRACE_S", SETTINGS[role_of(c)].model_fields["shutdown_grace_s"].default
            )
        )
        period = c.pod_spec.get("terminationGracePeriodSeconds", 30)
        if period < sleep + 2 * grace:
            problems.append(f"{c.workload}: terminationGracePeriodSeconds {period} < {sleep} + 2 x {grace}")
    return problems


@ALL
def test_termination_grace_covers_prestop_and_drain(rendered, variant):
    assert grace_problems(rendered[variant]) == []


def test_grace_check_can_fail(rendered):
    docs = copy.deepcopy(rendered["cpu-demo"])
    pod_template(tier_workload(docs, "coordinator"))["spec"]["terminationGracePeriodSeconds"] = 30
    assert any(p.startswith("coordinator:") for p in grace_problems(docs))


# --------------------------------------------------------------------------- GPUs and pools


def gpu_problems(docs: list[dict], gpu: bool) -> list[str]:
    problems = []
    pools = {"draft": "small", "target": "large"}
    for c in containers(docs):
        role = role_of(c) if is_specserve_server(c) else None
        requests = c.spec.get("resources", {}).get("requests", {})
        limits = c.spec.get("resources", {}).get("limits", {})
        wants_gpu = gpu and role in pools
        if wants_gpu:
            if int(limits.get(GPU, 0)) < 1 or requests.get(GPU, limits.get(GPU)) != limits.get(GPU):
                problems.append(f"{c.workload}/{c.name}: no {GPU} request/limit")
            if c.pod_spec.get("nodeSelector", {}).get(GPU_POOL) != pools[role]:
                problems.append(f"{c.workload}: not on the {pools[role]} GPU pool")
            tolerated = {
                (t.get("key"), t.get("value"), t.get("effect")) for t in c.pod_spec.get("tolerations", [])
            }
            if (GPU_POOL, pools[role], "NoSchedule") not in tolerated:
                problems.append(f"{c.workload}: does not tolerate the {pools[role]} pool's taint")
        else:
            if GPU in requests or GPU in limits:
                problems.append(f"{c.workload}/{c.name}: requests {GPU}")
            if GPU_POOL in c.pod_spec.get("nodeSelector", {}):
                problems.append(f"{c.workload}: pinned to a GPU pool")
    return problems


@ALL
def test_gpus_requested_by_draft_and_target_in_gpu_and_by_nothing_in_cpu_demo(rendered, variant):
    assert gpu_problems(rendered[variant], gpu=variant in GPU_VARIANTS) == []


def test_gpu_check_can_fail(rendered):
    assert gpu_problems(rendered["cpu-demo"], gpu=True)  # cpu-demo has no GPUs at all
    assert gpu_problems(rendered["gpu"], gpu=False)  # gpu has some
    docs = copy.deepcopy(rendered["gpu"])
    pod_template(tier_workload(docs, "draft"))["spec"]["nodeSelector"][GPU_POOL] = "large"
    assert any("draft" in p and "small GPU pool" in p for p in gpu_problems(docs, gpu=True))


# --------------------------------------------------------------------------- security


def security_problems(docs: list[dict]) -> list[str]:
    problems = []
    for w in workloads(docs):
        name = w["metadata"]["name"]
        spec = pod_template(w)["spec"]
        pod_sc = spec.get("securityContext", {})
        if spec.get("automountServiceAccountToken") is not False:
            problems.append(f"{name}: service account token mounted")
        if any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")):
            problems.append(f"{name}: shares a host namespace")
        if any("hostPath" in v for v in spec.get("volumes", [])):
            problems.append(f"{name}: hostPath volume")
        if pod_sc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
            problems.append(f"{name}: no RuntimeDefault seccomp profile")
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            sc = c.get("securityContext", {})
            where = f"{name}/{c['name']}"
            if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
                problems.append(f"{where}: runAsNonRoot not set")
            if sc.get("runAsUser", pod_sc.get("runAsUser")) in (None, 0):
                problems.append(f"{where}: no non-zero runAsUser")
            if sc.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{where}: root filesystem writable")
            if sc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}: privilege escalation allowed")
            if sc.get("privileged"):
                problems.append(f"{where}: privileged")
            if "ALL" not in sc.get("capabilities", {}).get("drop", []) or sc.get("capabilities", {}).get(
                "add"
            ):
                problems.append(f"{where}: capabilities not all dropped")
    return problems


@ALL
def test_every_pod_runs_as_non_root_with_a_read_only_root_filesystem(rendered, variant):
    assert security_problems(rendered[variant]) == []


def test_security_check_can_fail(rendered):
    docs = copy.deepcopy(rendered["cpu-demo"])
    spec = pod_template(one(docs, "StatefulSet", "redis"))["spec"]
    spec["securityContext"]["runAsUser"] = 0
    spec["containers"][0]["securityContext"]["readOnlyRootFilesystem"] = False
    init = pod_template(tier_workload(docs, "target"))["spec"]["initContainers"][0]
    del init["securityContext"]["capabilities"]
    problems = security_problems(docs)
    assert "redis/redis: no non-zero runAsUser" in problems
    assert "redis/redis: root filesystem writable" in problems
    assert "target/models: capabilities not all dropped" in problems


# --------------------------------------------------------------------------- NetworkPolicies


def sources(docs: list[dict]) -> list[Peer]:
    """Every kind of pod that may try to connect: the tiers, Redis, clients, Prometheus, a stray pod."""
    out = [
        peer("client", "clients", {"app": "some-client"}),
        peer("monitoring", "monitoring", {"app.kubernetes.io/name": "prometheus"}),
        peer("stray-pod-in-namespace", "specserve", {"app": "debug"}),
    ]
    for w in workloads(docs):
        out.append(peer(w["metadata"]["name"], "specserve", pod_template(w)["metadata"]["labels"]))
    return out


def expected_flows(docs: list[dict]) -> set[tuple[str, str, str]]:
    """Clients reach only the coordinator; only the coordinator reaches draft and target;
    only the coordinator and the target reach Redis (the draft never uses it); Prometheus
    scrapes the services' metrics port."""
    names = {w["metadata"]["name"] for w in workloads(docs)}
    flows = {(s.name, "coordinator", port) for s in sources(docs) for port in ("grpc", "http")}
    flows |= {("coordinator", "draft", "grpc"), ("coordinator", "target", "grpc")}
    flows |= {("monitoring", tier, "metrics") for tier in TIERS}
    if "redis" in names:
        flows |= {("coordinator", "redis", "redis"), ("target", "redis", "redis")}
    return flows


DNS = peer("kube-dns", "kube-system", {"k8s-app": "kube-dns"})
EXTERNAL_REDIS = peer("external-redis", "elsewhere", {})
OUTSIDE = [
    (DNS, [("", 53, "UDP"), ("", 53, "TCP")]),
    (EXTERNAL_REDIS, [("", 6379, "TCP"), ("", 6380, "TCP")]),
    (peer("internet", "elsewhere", {}), [("", 443, "TCP"), ("", 80, "TCP")]),
]


def expected_egress(docs: list[dict]) -> set[tuple[str, str, str]]:
    """Each tier calls only what it needs: the coordinator the workers, Redis and DNS; the target Redis
    and DNS; the draft and Redis no one. With an external Redis its ports are open to anywhere, for the
    coordinator and the target only."""
    dns = {(tier, "kube-dns", port) for tier in ("coordinator", "target") for port in ("53/udp", "53/tcp")}
    flows = {("coordinator", "draft", "grpc"), ("coordinator", "target", "grpc"), *dns}
    if "redis" in {w["metadata"]["name"] for w in workloads(docs)}:
        return flows | {("coordinator", "redis", "redis"), ("target", "redis", "redis")}
    return flows | {(tier, "external-redis", p) for tier in ("coordinator", "target") for p in ("6379/tcp", "6380/tcp")}


@ALL
def test_egress_policies_let_each_tier_call_only_what_it_needs(rendered, variant):
    docs = rendered[variant]
    assert egress_flows(docs, OUTSIDE) == expected_egress(docs)


def test_egress_check_can_fail(rendered):
    docs = copy.deepcopy(rendered["gpu"])
    docs = [d for d in docs if not (d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "default-deny-egress")]
    flows = egress_flows(docs, OUTSIDE)
    assert ("draft", "internet", "443/tcp") in flows and ("draft", "redis", "redis") in flows
    assert flows != expected_egress(docs)


@ALL
def test_draft_pods_get_no_redis_secret(rendered, variant):
    """The draft never touches Redis: no Redis URL, no reference to the Redis Secret in its pods."""
    docs = rendered[variant]
    draft = pod_template(tier_workload(docs, "draft"))
    assert "specserve-redis" not in json.dumps(draft)
    for c in (c for c in containers(docs) if is_specserve_server(c) and role_of(c) == "draft"):
        assert "SPECSERVE_REDIS_URL" not in resolve_env(docs, c)


def _secret_ref(c, name: str) -> tuple[str, str] | None:
    for item in c.spec.get("env", []):
        if item["name"] == name and "secretKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["secretKeyRef"]
            return ref["name"], ref["key"]
    return None


@ALL
def test_worker_auth_is_wired_the_same_on_the_coordinator_and_both_workers(rendered, variant, monkeypatch):
    """Every server reads SPECSERVE_WORKER_TOKEN from the same Secret key (the coordinator sends it, the
    workers require it), so workers listening on 0.0.0.0 authenticate their callers."""
    docs = rendered[variant]
    refs = {
        role_of(c): _secret_ref(c, "SPECSERVE_WORKER_TOKEN")
        for c in containers(docs)
        if is_specserve_server(c)
    }
    assert set(refs) == set(TIERS) and len(set(refs.values())) == 1 and None not in refs.values(), refs
    for role in ("draft", "target"):
        settings = _settings(docs, role, monkeypatch)
        assert settings.authenticates_callers and settings.worker_token is not None
    assert _settings(docs, "coordinator", monkeypatch).worker_token is not None


@ALL
def test_network_policies_allow_exactly_the_documented_flows(rendered, variant):
    docs = rendered[variant]
    assert {w["metadata"]["name"] for w in workloads(docs)} >= set(TIERS)
    assert allowed_flows(docs, sources(docs)) == expected_flows(docs)


def test_network_policy_check_can_fail(rendered):
    def without(docs, *names):
        return [
            d
            for d in copy.deepcopy(docs)
            if not (d["kind"] == "NetworkPolicy" and d["metadata"]["name"] in names)
        ]

    gpu = rendered["gpu"]
    # Without its own policy Redis stays isolated by default-deny: the services lose it.
    docs = without(gpu, "redis-ingress")
    assert ("coordinator", "redis", "redis") not in allowed_flows(docs, sources(docs))
    # Without default-deny as well, Redis is open to everyone.
    docs = without(gpu, "redis-ingress", "default-deny-ingress")
    assert ("client", "redis", "redis") in allowed_flows(docs, sources(docs))
    # A policy naming the wrong peer lets the wrong tier in and the right one out.
    docs = copy.deepcopy(gpu)
    draft_policy = one(docs, "NetworkPolicy", "draft-ingress")
    draft_policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"][COMPONENT] = "target"
    allowed = allowed_flows(docs, sources(docs))
    assert ("target", "draft", "grpc") in allowed and ("coordinator", "draft", "grpc") not in allowed
    assert allowed != expected_flows(docs)


# --------------------------------------------------------------------------- environment


def env_problems(docs: list[dict]) -> list[str]:
    problems = []
    for c in (c for c in containers(docs) if is_specserve_server(c)):
        role = role_of(c)
        if role != c.name:
            problems.append(f"{c.workload}/{c.name}: serves role {role}")
        fields = {f"SPECSERVE_{f.upper()}" for f in SETTINGS[role].model_fields}
        for name in resolve_env(docs, c):
            if name.startswith("SPECSERVE_") and name not in fields:
                problems.append(f"{c.workload}/{c.name}: {name} is not a {SETTINGS[role].__name__} field")
            elif not name.startswith("SPECSERVE_") and name not in OTHER_ENV_ALLOWED:
                problems.append(f"{c.workload}/{c.name}: {name} is not read by specserve")
    return problems


@ALL
def test_environment_variables_are_settings_fields_of_the_role(rendered, variant):
    """Every variable set on a server is a field of that role's settings class (specserve/runtime/config.py)."""
    assert env_problems(rendered[variant]) == []


def test_env_check_can_fail(rendered):
    docs = copy.deepcopy(rendered["gpu"])
    target = tier_workload(docs, "target")
    cm_name = pod_template(target)["spec"]["containers"][0]["envFrom"][1]["configMapRef"]["name"]
    one(docs, "ConfigMap", cm_name)["data"]["SPECSERVE_TARGET_ENDPOINTS"] = "x:1"  # a coordinator field
    pod_template(target)["spec"]["containers"][0]["env"].append({"name": "SPECSERVE_MODLE", "value": "/m"})
    problems = env_problems(docs)
    assert "target/target: SPECSERVE_TARGET_ENDPOINTS is not a TargetSettings field" in problems
    assert "target/target: SPECSERVE_MODLE is not a TargetSettings field" in problems


def thread_problems(docs: list[dict]) -> list[str]:
    """Each worker's torch threads come from its own CPU limit (SPECSERVE_THREADS from
    ``limits.cpu``), and it has one: without, torch starts a thread per core of the node."""
    problems = []
    for c in (c for c in containers(docs) if is_specserve_server(c) and role_of(c) in ("draft", "target")):
        env = {e["name"]: e for e in c.spec.get("env", [])}
        ref = env.get("SPECSERVE_THREADS", {}).get("valueFrom", {}).get("resourceFieldRef") or {}
        if ref.get("resource") != "limits.cpu" or str(ref.get("divisor", "1")) != "1":
            problems.append(f"{c.workload}/{c.name}: SPECSERVE_THREADS is not its limits.cpu")
        if ref.get("containerName", c.name) != c.name:
            problems.append(f"{c.workload}/{c.name}: SPECSERVE_THREADS reads another container's limit")
        if "cpu" not in c.spec.get("resources", {}).get("limits", {}):
            problems.append(f"{c.workload}/{c.name}: no CPU limit")
    return problems


@ALL
def test_workers_run_as_many_torch_threads_as_their_cpu_limit(rendered, variant):
    assert thread_problems(rendered[variant]) == []


def test_thread_check_can_fail(rendered):
    docs = copy.deepcopy(rendered["gpu"])
    target = pod_template(tier_workload(docs, "target"))["spec"]["containers"][0]
    target["env"] = [e for e in target["env"] if e["name"] != "SPECSERVE_THREADS"]
    draft = pod_template(tier_workload(docs, "draft"))["spec"]["containers"][0]
    del draft["resources"]["limits"]["cpu"]
    assert sorted(thread_problems(docs)) == [
        "draft/draft: no CPU limit",
        "target/target: SPECSERVE_THREADS is not its limits.cpu",
    ]


def test_container_arguments_parse_with_the_cli(rendered):
    """The image's entry point is `specserve`; each server's args are a valid `specserve serve ROLE`."""
    from specserve.launch.cli import ROLES, build_parser, cmd_serve

    for docs in rendered.values():
        for c in (c for c in containers(docs) if is_specserve_server(c)):
            assert "command" not in c.spec, f"{c.workload}: overrides the image's entry point"
            args = build_parser().parse_args(c.spec["args"])
            assert args.func is cmd_serve and args.role in ROLES and args.options == []


@ALL
def test_settings_classes_accept_the_rendered_environment(rendered, variant, monkeypatch):
    """Each server's environment builds its settings object: types, ranges and cross-field checks pass."""
    docs = rendered[variant]
    for c in (c for c in containers(docs) if is_specserve_server(c)):
        env = resolve_env(docs, c, secret_placeholder="redis://:placeholder@redis:6379/0")
        with monkeypatch.context() as m:
            for name in [k for k in os.environ if k.startswith("SPECSERVE_")]:
                m.delenv(name)
            for name, value in env.items():
                m.setenv(name, value)
            settings = SETTINGS[role_of(c)]()
        assert settings.metrics_port is not None, (
            f"{c.workload}: no metrics port, the HPAs would have no signal"
        )
        annotations = pod_template(one(docs, *_kind_name(docs, c.workload)))["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(settings.metrics_port)
        assert named_port(c.spec, "metrics") == settings.metrics_port


def _settings(docs: list[dict], role: str, monkeypatch) -> object:
    c = next(c for c in containers(docs) if is_specserve_server(c) and role_of(c) == role)
    env = resolve_env(docs, c, secret_placeholder="redis://:placeholder@redis:6379/0")
    with monkeypatch.context() as m:
        for name in [k for k in os.environ if k.startswith("SPECSERVE_")]:
            m.delenv(name)
        for name, value in env.items():
            m.setenv(name, value)
        return SETTINGS[role]()


@ALL
def test_coordinator_limits_fit_the_workers(rendered, variant, monkeypatch):
    """A full Verify batch is one the targets accept (and fills their batch occupancy to 1);
    the largest gamma the coordinator picks is one both workers accept."""
    docs = rendered[variant]
    coordinator, draft, target = (_settings(docs, role, monkeypatch) for role in TIERS)
    assert coordinator.max_batch_size == target.max_batch_size
    assert coordinator.max_gamma <= min(draft.max_gamma, target.max_gamma)


def _kind_name(docs: list[dict], workload: str) -> tuple[str, str]:
    return next(
        (w["kind"], w["metadata"]["name"]) for w in workloads(docs) if w["metadata"]["name"] == workload
    )


# --------------------------------------------------------------------------- routing and scaling


@ALL
def test_coordinator_lists_one_endpoint_per_possible_worker_replica(rendered, variant):
    """The endpoint lists name ordinals 0 .. maxReplicas-1 of each worker StatefulSet under its headless Service."""
    docs = rendered[variant]
    coordinator = next(c for c in containers(docs) if is_specserve_server(c) and role_of(c) == "coordinator")
    env = resolve_env(docs, coordinator)
    for tier in ("draft", "target"):
        sts = tier_workload(docs, tier)
        assert sts["kind"] == "StatefulSet"
        service = one(docs, "Service", sts["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None" and not service["spec"].get("publishNotReadyAddresses")
        assert selector_matches(
            {"matchLabels": service["spec"]["selector"]}, pod_template(sts)["metadata"]["labels"]
        )
        container = pod_template(sts)["spec"]["containers"][0]
        port = named_port(container, "grpc")
        want = [
            f"{sts['metadata']['name']}-{i}.{service['metadata']['name']}:{port}"
            for i in range(max_replicas(docs, sts["metadata"]["name"]))
        ]
        got = env[f"SPECSERVE_{tier.upper()}_ENDPOINTS"].split(",")
        assert got == want


@ALL
def test_hpa_managed_workloads_leave_the_replica_count_to_the_hpa(rendered, variant):
    """A `replicas` field on an autoscaled workload would reset the count on every `kubectl apply`
    (and, for the target tier, move sessions)."""
    docs = rendered[variant]
    for tier in TIERS:
        assert "replicas" not in tier_workload(docs, tier)["spec"], tier


def test_cpu_demo_runs_one_replica_of_each_tier(rendered):
    docs = rendered["cpu-demo"]
    for tier in TIERS:
        hpa = one(docs, "HorizontalPodAutoscaler", tier)
        assert hpa["spec"]["minReplicas"] == 1
        assert tier_workload(docs, tier)["spec"].get("replicas", 1) == 1  # the API's default
    assert one(docs, "HorizontalPodAutoscaler", "draft")["spec"]["maxReplicas"] == 1
    assert one(docs, "HorizontalPodAutoscaler", "target")["spec"]["maxReplicas"] == 1
    assert one(docs, "StatefulSet", "redis")["spec"]["replicas"] == 1


# --------------------------------------------------------------------------- models and secrets


@ALL
def test_models_come_from_a_volume_never_the_code_image(rendered, variant):
    """SPECSERVE_MODEL / SPECSERVE_TOKENIZER point into a read-only mount of a PVC or of an
    emptyDir that an init container fills from the models image."""
    docs = rendered[variant]
    for c in (c for c in containers(docs) if is_specserve_server(c)):
        env = resolve_env(docs, c)
        path = env.get("SPECSERVE_MODEL") or env.get("SPECSERVE_TOKENIZER")
        assert path, f"{c.workload}: no model/tokenizer path (the code image carries no model)"
        mounts = [m for m in c.spec["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
        assert len(mounts) == 1 and mounts[0].get("readOnly"), (c.workload, path, c.spec["volumeMounts"])
        volume = next(v for v in c.pod_spec["volumes"] if v["name"] == mounts[0]["name"])
        if "persistentVolumeClaim" in volume:
            one(docs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        else:
            assert "emptyDir" in volume
            fillers = [
                i
                for i in c.pod_spec.get("initContainers", [])
                if any(
                    m["name"] == volume["name"] and not m.get("readOnly") for m in i.get("volumeMounts", [])
                )
            ]
            assert len(fillers) == 1 and fillers[0]["image"].split(":")[0] == "specserve-models"


def test_gpu_overlay_commits_no_credentials(rendered):
    """Production Secrets are created out of band; only cpu-demo generates a (demo) Secret."""
    for variant in GPU_VARIANTS:
        assert find(rendered[variant], "Secret") == []
    secrets = {s["metadata"]["name"].rsplit("-", 1)[0]: s for s in find(rendered["cpu-demo"], "Secret")}
    assert set(secrets) == {"specserve-redis", "specserve-worker"}
    import base64

    data = {k: base64.b64decode(v).decode() for k, v in secrets["specserve-redis"]["data"].items()}
    url = urlparse(data["url"])
    assert url.password == data["password"] and url.hostname == "redis"
    token = base64.b64decode(secrets["specserve-worker"]["data"]["token"]).decode()
    assert "demo" in token


@pytest.mark.unit
def test_docs_list_every_metric_and_overlay():
    text = (REPO / "docs" / "deploy.md").read_text()
    for name in set().union(*TIER_METRICS.values()):
        assert name in text
    for path in (
        "overlays/cpu-demo",
        "overlays/gpu",
        "components/cpu-hpa",
        "components/external-redis",
        "components/keda",
    ):
        assert path in text

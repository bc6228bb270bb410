"""Reading rendered Kubernetes manifests: rendering, selectors, env, NetworkPolicy flows.

Plain functions over the dictionaries that ``kubectl kustomize`` prints, used by
the deploy tests. Each check returns a list of problems (empty = fine) so that
a test can show the check failing on a deliberately broken copy.
"""

from __future__ import annotations

import base64
import json
import math
import os
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
NAMESPACE = "specserve"
TIERS = ("coordinator", "draft", "target")
COMPONENT = "app.kubernetes.io/component"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob", "Pod")

#: Each tier's own load signal (docs/deploy.md, "Metrics").
TIER_METRICS = {
    "coordinator": {"specserve_coordinator_active_sessions"},
    "draft": {"specserve_draft_queue_depth", "specserve_draft_batch_occupancy"},
    "target": {"specserve_target_verify_queue_depth", "specserve_target_batch_occupancy"},
}

#: Rendered variants: name -> (kustomization dir relative to deploy/, components added on top).
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "cpu-demo": ("overlays/cpu-demo", ()),
    "gpu": ("overlays/gpu", ()),
    "gpu+cpu-hpa": ("overlays/gpu", ("components/cpu-hpa",)),
    "gpu+external-redis": ("overlays/gpu", ("components/external-redis",)),
    "gpu+keda": ("overlays/gpu", ("components/keda",)),
}
#: Variants scaled by KEDA ScaledObjects instead of HPAs (tests/deploy/test_keda.py).
KEDA_VARIANTS = {"gpu+keda"}
#: Kinds of custom resources (their CRDs are not in the Kubernetes schemas; checked on their own).
CUSTOM_KINDS = {"ScaledObject"}

Doc = dict[str, Any]


def kubectl_path() -> str | None:
    return shutil.which("kubectl")


def kustomize_major(kubectl: str) -> int | None:
    """Major version of the kustomize built into ``kubectl`` (None when it does not say)."""
    out = subprocess.run(
        [kubectl, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=30
    )
    try:
        version = json.loads(out.stdout).get("kustomizeVersion", "")
        return int(version.lstrip("v").split(".")[0])
    except (ValueError, AttributeError):
        return None


def render(variant: str, workdir: Path) -> str:
    """``kubectl kustomize`` of one variant; composed variants go through a scratch kustomization."""
    kubectl = kubectl_path()
    assert kubectl is not None
    base, components = VARIANTS[variant]
    if not components:
        cmd = [kubectl, "kustomize", str(DEPLOY / base)]
    else:
        workdir.mkdir(parents=True, exist_ok=True)
        rel = lambda p: os.path.relpath(DEPLOY / p, workdir)  # noqa: E731
        kustomization = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [rel(base)],
            "components": [rel(c) for c in components],
        }
        (workdir / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        cmd = [kubectl, "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(workdir)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{out.stderr}")
    return out.stdout


def load_docs(text: str) -> list[Doc]:
    return [d for d in yaml.safe_load_all(text) if d]


# --------------------------------------------------------------------------- lookups


def find(docs: Iterable[Doc], kind: str, name: str | None = None) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: Iterable[Doc], kind: str, name: str) -> Doc:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def max_replicas(docs: list[Doc], name: str) -> int:
    """The autoscaler's upper bound for workload ``name``: its HPA's, or its KEDA ScaledObject's."""
    hpas = find(docs, "HorizontalPodAutoscaler", name)
    if hpas:
        return int(one(docs, "HorizontalPodAutoscaler", name)["spec"]["maxReplicas"])
    return int(one(docs, "ScaledObject", name)["spec"]["maxReplicaCount"])


def pod_template(doc: Doc) -> Doc:
    """The pod template (metadata + spec) of a workload, or the Pod itself."""
    if doc["kind"] == "Pod":
        return doc
    if doc["kind"] == "CronJob":
        return doc["spec"]["jobTemplate"]["spec"]["template"]
    return doc["spec"]["template"]


def workloads(docs: Iterable[Doc]) -> list[Doc]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def tier_workload(docs: Iterable[Doc], tier: str) -> Doc:
    found = [w for w in workloads(docs) if pod_template(w)["metadata"]["labels"].get(COMPONENT) == tier]
    assert len(found) == 1, (
        f"expected one workload of tier {tier}, found {[w['metadata']['name'] for w in found]}"
    )
    return found[0]


@dataclass(frozen=True)
class Container:
    workload: str
    name: str
    spec: Doc
    pod_spec: Doc
    init: bool


def containers(docs: Iterable[Doc], *, include_init: bool = True) -> Iterator[Container]:
    for w in workloads(docs):
        spec = pod_template(w)["spec"]
        for c in spec.get("containers", []):
            yield Container(w["metadata"]["name"], c["name"], c, spec, init=False)
        if include_init:
            for c in spec.get("initContainers", []):
                yield Container(w["metadata"]["name"], c["name"], c, spec, init=True)


def is_specserve_server(c: Container) -> bool:
    """A container running the specserve image as a server (``specserve serve <role>``)."""
    image = c.spec["image"].rsplit("/", 1)[-1]
    return image.split(":")[0].split("@")[0] == "specserve" and not c.init


def role_of(c: Container) -> str:
    args = c.spec.get("args") or []
    assert len(args) == 2 and args[0] == "serve", f"{c.workload}/{c.name}: args {args} are not [serve, ROLE]"
    return args[1]


def named_port(container: Doc, name: str) -> int | None:
    for p in container.get("ports", []):
        if p.get("name") == name:
            return int(p["containerPort"])
    return None


# --------------------------------------------------------------------------- labels


def selector_matches(selector: Doc | None, labels: dict[str, str]) -> bool:
    """Kubernetes LabelSelector semantics; an empty selector matches everything."""
    selector = selector or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise ValueError(f"unknown selector operator {op}")
    return True


# --------------------------------------------------------------------------- env


def resolve_env(docs: list[Doc], c: Container, secret_placeholder: str = "placeholder") -> dict[str, str]:
    """The environment a container starts with, as far as the manifests decide it.

    envFrom ConfigMaps/Secrets first, then ``env`` (which wins). Secrets that
    are not part of the render (created out of band) give ``secret_placeholder``.
    """

    def configmap(name: str) -> dict[str, str]:
        return dict(one(docs, "ConfigMap", name).get("data") or {})

    def secret(name: str) -> dict[str, str] | None:
        found = find(docs, "Secret", name)
        if not found:
            return None
        s = found[0]
        data = {k: base64.b64decode(v).decode() for k, v in (s.get("data") or {}).items()}
        data.update(s.get("stringData") or {})
        return data

    env: dict[str, str] = {}
    for src in c.spec.get("envFrom", []):
        prefix = src.get("prefix", "")
        if "configMapRef" in src:
            values = configmap(src["configMapRef"]["name"])
        else:
            values = secret(src["secretRef"]["name"]) or {}
        env.update({prefix + k: v for k, v in values.items()})
    for item in c.spec.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
            continue
        ref = item["valueFrom"]
        if "configMapKeyRef" in ref:
            env[item["name"]] = configmap(ref["configMapKeyRef"]["name"])[ref["configMapKeyRef"]["key"]]
        elif "secretKeyRef" in ref:
            data = secret(ref["secretKeyRef"]["name"])
            env[item["name"]] = data[ref["secretKeyRef"]["key"]] if data is not None else secret_placeholder
        elif "resourceFieldRef" in ref:  # the kubelet's value: the container's own quantity, rounded up
            env[item["name"]] = resource_field(c.spec, ref["resourceFieldRef"])
        else:
            env[item["name"]] = secret_placeholder  # fieldRef: set by the kubelet
    return env


def _cpu(quantity: str | int | float) -> float:
    """A CPU quantity in cores: ``2``, ``"1.5"``, ``"500m"``."""
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def resource_field(container: Doc, ref: Doc) -> str:
    """What the kubelet gives ``valueFrom.resourceFieldRef`` for CPU limits and requests (the
    quantity over ``divisor``, rounded up); other resources give a placeholder."""
    kind, _, name = ref["resource"].partition(".")
    if name != "cpu" or kind not in ("limits", "requests"):
        return "placeholder"
    quantity = container.get("resources", {}).get(kind, {}).get("cpu")
    assert quantity is not None, f"{container['name']}: {ref['resource']} is not set"
    return str(math.ceil(_cpu(quantity) / _cpu(ref.get("divisor", "1"))))


# --------------------------------------------------------------------------- NetworkPolicy


@dataclass(frozen=True)
class Peer:
    """A pod that may open connections: its name in reports, namespace, namespace labels, pod labels."""

    name: str
    namespace: str
    namespace_labels: tuple[tuple[str, str], ...]
    labels: tuple[tuple[str, str], ...]


def peer(name: str, namespace: str, labels: dict[str, str] | None = None) -> Peer:
    ns_labels = {"kubernetes.io/metadata.name": namespace}
    return Peer(name, namespace, tuple(sorted(ns_labels.items())), tuple(sorted((labels or {}).items())))


def _peer_matches(rule_peer: Doc, src: Peer, policy_namespace: str) -> bool:
    if "ipBlock" in rule_peer:
        # Only "everyone" is meaningful without real addresses.
        return rule_peer["ipBlock"].get("cidr") in ("0.0.0.0/0", "::/0") and not rule_peer["ipBlock"].get(
            "except"
        )
    pod_sel = rule_peer.get("podSelector")
    ns_sel = rule_peer.get("namespaceSelector")
    if ns_sel is None:
        ns_ok = src.namespace == policy_namespace
    else:
        ns_ok = selector_matches(ns_sel, dict(src.namespace_labels))
    pod_ok = pod_sel is None or selector_matches(pod_sel, dict(src.labels))
    return ns_ok and pod_ok


def _port_matches(rule_ports: list[Doc] | None, port_name: str, port_number: int, protocol: str = "TCP") -> bool:
    if not rule_ports:
        return True
    for p in rule_ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        if "port" not in p:
            return True
        want = p["port"]
        if (isinstance(want, str) and want == port_name) or (
            isinstance(want, int)
            and (want == port_number or (p.get("endPort") or want) >= port_number >= want)
        ):
            return True
    return False


def ingress_allowed(
    policies: list[Doc], dst_labels: dict[str, str], port_name: str, port_number: int, src: Peer
) -> bool:
    """Whether ``src`` may connect to a pod in NAMESPACE with ``dst_labels`` on that TCP port."""
    selecting = [
        p
        for p in policies
        if p["metadata"].get("namespace", NAMESPACE) == NAMESPACE
        and "Ingress" in (p["spec"].get("policyTypes") or ["Ingress"])
        and selector_matches(p["spec"].get("podSelector"), dst_labels)
    ]
    if not selecting:
        return True  # not isolated
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            if not _port_matches(rule.get("ports"), port_name, port_number):
                continue
            sources = rule.get("from")
            if not sources or any(_peer_matches(s, src, NAMESPACE) for s in sources):
                return True
    return False


def allowed_flows(docs: list[Doc], sources: list[Peer]) -> set[tuple[str, str, str]]:
    """Every (source name, destination workload, destination port name) the NetworkPolicies let through."""
    policies = find(docs, "NetworkPolicy")
    flows = set()
    for w in workloads(docs):
        template = pod_template(w)
        labels = template["metadata"].get("labels") or {}
        for c in template["spec"]["containers"]:
            for port in c.get("ports", []):
                for src in sources:
                    if ingress_allowed(
                        policies, labels, port.get("name", ""), int(port["containerPort"]), src
                    ):
                        flows.add(
                            (src.name, w["metadata"]["name"], port.get("name", str(port["containerPort"])))
                        )
    return flows


def egress_allowed(
    policies: list[Doc], src: Peer, dst: Peer, port_name: str, port_number: int, protocol: str = "TCP"
) -> bool:
    """Whether the pod ``src`` (in NAMESPACE) may open a connection to ``dst`` on that port, as far as
    the egress policies selecting ``src`` decide (the receiver's ingress is :func:`ingress_allowed`'s)."""
    selecting = [
        p
        for p in policies
        if src.namespace == NAMESPACE
        and p["metadata"].get("namespace", NAMESPACE) == NAMESPACE
        and "Egress" in (p["spec"].get("policyTypes") or [])
        and selector_matches(p["spec"].get("podSelector"), dict(src.labels))
    ]
    if not selecting:
        return True  # not isolated for egress
    for policy in selecting:
        for rule in policy["spec"].get("egress") or []:
            if not _port_matches(rule.get("ports"), port_name, port_number, protocol):
                continue
            destinations = rule.get("to")
            if not destinations or any(_peer_matches(d, dst, NAMESPACE) for d in destinations):
                return True
    return False


Port = tuple[str, int, str]  # (name, number, protocol)


def egress_flows(docs: list[Doc], destinations: list[tuple[Peer, list[Port]]]) -> set[tuple[str, str, str]]:
    """Every (source workload, destination, port) the egress policies let out, for every workload's pods
    as sources and as destinations (their container ports), plus ``destinations`` (peers outside)."""
    policies = find(docs, "NetworkPolicy")
    targets = list(destinations)
    for w in workloads(docs):
        template = pod_template(w)
        ports = [
            (port.get("name", ""), int(port["containerPort"]), port.get("protocol", "TCP"))
            for c in template["spec"]["containers"]
            for port in c.get("ports", [])
        ]
        targets.append((peer(w["metadata"]["name"], NAMESPACE, template["metadata"].get("labels") or {}), ports))
    flows = set()
    for w in workloads(docs):
        src = peer(w["metadata"]["name"], NAMESPACE, pod_template(w)["metadata"].get("labels") or {})
        for dst, ports in targets:
            for name, number, protocol in ports:
                if egress_allowed(policies, src, dst, name, number, protocol):
                    flows.add((src.name, dst.name, name or f"{number}/{protocol.lower()}"))
    return flows

"""deploy/components/keda: KEDA ScaledObjects instead of HPAs, each tier on its own Prometheus metrics.

The ScaledObjects are validated against a strict subset of KEDA's ``ScaledObject`` CRD schema
(keda.sh/v1alpha1, KEDA 2.12+: only the fields these manifests use, unknown fields refused), then
checked for what makes them right: one per tier on that tier's workload and only its metrics,
no HPA left beside them (KEDA refuses a workload another HPA scales), the thresholds of the HPAs
they replace, the bounds and behaviour of the overlay's HPAs, and queries that name metrics
specserve exports. Each check is also run on a broken copy to show that it can fail.
"""

from __future__ import annotations

import copy
import re

import jsonschema
import pytest
import yaml
from deploy_helpers import (
    DEPLOY,
    KEDA_VARIANTS,
    TIER_METRICS,
    TIERS,
    find,
    one,
    tier_workload,
)

#: Without KEDA: the overlay the KEDA variant is built on.
BASE_OF = {"gpu+keda": "gpu"}

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
#: KEDA's ScaledObject CRD schema, restricted to the fields used here (types as in the CRD).
SCALED_OBJECT_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "additionalProperties": False,
            "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": _STRING_MAP},
        },
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string"},
                    },
                },
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer"},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"name": {"type": "string"}, "behavior": {"type": "object"}},
                        },
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["metadata", "type"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string"},
                            "metadata": _STRING_MAP,
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                        },
                    },
                },
            },
        },
    },
}


def quantity(text: str) -> float:
    """A Kubernetes quantity such as ``800m`` or ``16`` as a number."""
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def adapter_prometheus() -> str:
    values = yaml.safe_load((DEPLOY / "prometheus-adapter" / "values.yaml").read_text())
    return f"{values['prometheus']['url']}:{values['prometheus']['port']}"


def keda_problems(docs: list[dict], without_keda: list[dict]) -> list[str]:
    problems = []
    if find(docs, "HorizontalPodAutoscaler"):
        problems.append("HPAs remain beside the ScaledObjects")
    objects = find(docs, "ScaledObject")
    for tier in TIERS:
        workload = tier_workload(docs, tier)
        mine = [
            so
            for so in objects
            if so["spec"]["scaleTargetRef"].get("kind") == workload["kind"]
            and so["spec"]["scaleTargetRef"]["name"] == workload["metadata"]["name"]
            and so["spec"]["scaleTargetRef"].get("apiVersion") == workload["apiVersion"]
        ]
        if len(mine) != 1:
            problems.append(f"{tier}: {len(mine)} ScaledObjects scale {workload['metadata']['name']}")
            continue
        so = mine[0]
        if so["metadata"]["namespace"] != workload["metadata"]["namespace"]:
            problems.append(f"{tier}: ScaledObject in namespace {so['metadata']['namespace']}")
        hpa = one(without_keda, "HorizontalPodAutoscaler", workload["metadata"]["name"])
        spec = so["spec"]
        if (spec["minReplicaCount"], spec["maxReplicaCount"]) != (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]):
            problems.append(f"{tier}: bounds {spec['minReplicaCount']}..{spec['maxReplicaCount']} differ from the HPA's")
        if spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior") != hpa["spec"].get("behavior"):
            problems.append(f"{tier}: scaling behaviour differs from the HPA's")
        hpa_targets = {
            m[m["type"].lower()]["metric"]["name"]: quantity(m[m["type"].lower()]["target"]["averageValue"])
            for m in hpa["spec"]["metrics"]
        }
        seen = set()
        for trigger in spec["triggers"]:
            meta = trigger["metadata"]
            names = set(re.findall(r"\bspecserve_[a-z_]+", meta.get("query", "")))
            if trigger["type"] != "prometheus" or len(names) != 1:
                problems.append(f"{tier}: trigger {trigger.get('name')} is not one Prometheus metric: {meta}")
                continue
            name = names.pop()
            seen.add(name)
            if f'namespace="{workload["metadata"]["namespace"]}"' not in meta["query"]:
                problems.append(f"{tier}: query {meta['query']} is not scoped to the namespace")
            if not meta["query"].startswith("sum(") or trigger.get("metricType") != "AverageValue":
                problems.append(f"{tier}: {name} is not summed and divided by the replicas")
            if meta.get("serverAddress") != adapter_prometheus():
                problems.append(f"{tier}: serverAddress {meta.get('serverAddress')} is not the documented Prometheus")
            if name in hpa_targets and float(meta["threshold"]) != hpa_targets[name]:
                problems.append(f"{tier}: {name} threshold {meta['threshold']} != HPA target {hpa_targets[name]}")
        if seen != TIER_METRICS[tier]:
            problems.append(f"{tier}: scales on {sorted(seen)}, want {sorted(TIER_METRICS[tier])}")
    return problems


@pytest.mark.parametrize("variant", sorted(KEDA_VARIANTS))
def test_scaledobjects_validate_against_kedas_schema(rendered, variant):
    objects = find(rendered[variant], "ScaledObject")
    assert len(objects) == len(TIERS)
    for so in objects:
        jsonschema.validate(so, SCALED_OBJECT_SCHEMA)
    broken = copy.deepcopy(objects[0])
    broken["spec"]["triggers"][0]["metdata"] = broken["spec"]["triggers"][0].pop("metadata")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCALED_OBJECT_SCHEMA)
    broken = copy.deepcopy(objects[0])
    broken["spec"]["triggers"][0]["metadata"]["threshold"] = 300  # KEDA wants strings
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCALED_OBJECT_SCHEMA)


@pytest.mark.parametrize("variant", sorted(KEDA_VARIANTS))
def test_every_tier_is_scaled_by_keda_on_its_own_metrics_like_the_hpa_it_replaces(rendered, variant):
    assert keda_problems(rendered[variant], rendered[BASE_OF[variant]]) == []


def test_keda_check_can_fail(rendered):
    docs = copy.deepcopy(rendered["gpu+keda"])
    draft = one(docs, "ScaledObject", "draft")
    draft["spec"]["triggers"] = copy.deepcopy(one(docs, "ScaledObject", "target")["spec"]["triggers"])
    draft["spec"]["maxReplicaCount"] = 3
    coordinator = one(docs, "ScaledObject", "coordinator")
    coordinator["spec"]["triggers"][0]["metadata"]["threshold"] = "100"
    docs.append(copy.deepcopy(one(rendered["gpu"], "HorizontalPodAutoscaler", "target")))
    problems = keda_problems(docs, rendered["gpu"])
    assert "HPAs remain beside the ScaledObjects" in problems
    assert any(p.startswith("draft: scales on") for p in problems)
    assert any(p.startswith("draft: bounds") for p in problems)
    assert any(p.startswith("coordinator:") and "threshold" in p for p in problems)


@pytest.mark.unit
def test_queries_name_gauges_that_specserve_exports():
    from prometheus_client import REGISTRY

    import specserve.runtime.metrics  # noqa: F401  (registers every metric)

    gauges = {m.name for m in REGISTRY.collect() if m.type == "gauge"}
    text = (DEPLOY / "components" / "keda" / "scaledobjects" / "scaledobjects.yaml").read_text()
    names = set(re.findall(r"\bspecserve_[a-z_]+", text))
    assert names == set().union(*TIER_METRICS.values())
    assert names <= gauges

"""Reading a role's Prometheus ``/metrics`` from a benchmark (the roles run in processes of their own)."""

from __future__ import annotations

from dataclasses import dataclass


def scrape(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """A sample of the Prometheus metrics at ``url`` (a role running in its own process): the one named
    ``name`` with exactly ``labels`` (none by default); 0 when there is none yet."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == (labels or {}):
                return float(sample.value)
    return 0.0


@dataclass(frozen=True)
class FeatureBytes:
    """The coordinator's feature-byte counters (``specserve_coordinator_feature_bytes_total``, by hop) at one
    moment; the difference of two readings is what was relayed in between."""

    to_draft: int = 0
    from_target: int = 0

    @classmethod
    def read(cls, coordinator_metrics: str | None) -> FeatureBytes:
        """The counters now (zeros where there is no coordinator ``/metrics`` to read)."""
        if coordinator_metrics is None:
            return cls()
        name = "specserve_coordinator_feature_bytes_total"
        return cls(
            int(scrape(coordinator_metrics, name, {"hop": "to_draft"})),
            int(scrape(coordinator_metrics, name, {"hop": "from_target"})),
        )

    def __sub__(self, other: FeatureBytes) -> FeatureBytes:
        return FeatureBytes(self.to_draft - other.to_draft, self.from_target - other.from_target)

"""Reading a role's Prometheus ``/metrics`` from a benchmark (the roles run in processes of their own)."""

from __future__ import annotations


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

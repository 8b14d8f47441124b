"""Prometheus metrics for a tier, read from the coordinator's counters at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from orchard.server.coordinator import Coordinator


class TierCollector(Collector):
    def __init__(self, coord: Coordinator, role: str) -> None:
        self.coord = coord
        self.role = role

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        c = self.coord
        labels = ["tier", "role"]
        lv = [c.name, self.role]
        for key, help_ in [("uploads_accepted", "updates accepted"), ("uploads_rejected", "updates refused"),
                           ("bytes_up", "update bytes received"), ("bytes_down", "model bytes sent"),
                           ("rounds_closed", "rounds closed at this tier")]:
            m = CounterMetricFamily(f"orchard_{key}", help_, labels=labels)
            m.add_metric(lv, c.counters[key])
            yield m
        size, elig = c.capacity()
        g = GaugeMetricFamily("orchard_clients", "live clients below this tier", labels=labels)
        g.add_metric(lv, size)
        yield g
        g = GaugeMetricFamily("orchard_clients_eligible", "eligible clients below this tier", labels=labels)
        g.add_metric(lv, elig)
        yield g
        cr = c.current
        g = GaugeMetricFamily("orchard_round", "current round number", labels=labels)
        g.add_metric(lv, cr.task.round if cr else 0)
        yield g
        g = GaugeMetricFamily("orchard_round_received", "updates received in the current round", labels=labels)
        g.add_metric(lv, cr.received if cr else 0)
        yield g
        # Asynchronous mode: every update this tier folded, by its staleness (empty in sync mode).
        m = CounterMetricFamily("orchard_updates_by_staleness", "updates folded, by staleness (async mode)",
                                labels=[*labels, "staleness"])
        for s, n in sorted(dict(c.staleness).items()):
            m.add_metric([*lv, str(s)], n)
        yield m


def serve_metrics(coord: Coordinator, role: str, host: str, port: int) -> int:
    """Start the /metrics HTTP endpoint; returns the bound port."""
    reg = CollectorRegistry()
    reg.register(TierCollector(coord, role))
    server, _thread = start_http_server(port, addr=host, registry=reg)
    return int(server.server_port)

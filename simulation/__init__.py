"""Simulation: thousands of clients on one machine, through the real client and server code.

```python
from orchard.simulation import SimulationConfig, run_simulation
report = run_simulation(SimulationConfig(clients=10_000, clients_per_round=1_000, rounds=5, aggregators=4))
print(report.rounds[-1]["accuracy"], report.clients_per_second)
```

The simulator is a backend of the one round engine: every tier is a real
:class:`orchard.server.coordinator.Coordinator` (built ``inline``); clients train with
the task's trainer, encode with ``client.update.build_upload`` and upload through
``Coordinator.upload_now`` (or post masked inputs with ``secagg_now``); the root closes
each round with ``orchard.aggregation.server_step``, as ``server.root`` does. Devices (speed, availability, battery, heat) come from
``orchard.edge_runtime``'s simulated device, policy and governor, on a virtual clock.
See :mod:`orchard.simulation.engine` for one round step by step.
"""

from orchard.simulation.config import (
    DEFAULT_PROFILES,
    DeviceProfile,
    SimulationConfig,
    build_simulation_config,
    load_simulation_config,
    simulation_problems,
)


def __getattr__(name: str):  # PEP 562: `orchard --help` and servers need not load torch
    if name == "SimulationReport":
        from orchard.simulation.report import SimulationReport

        return SimulationReport
    if name == "run_simulation":
        from orchard.simulation.runner import run_simulation

        return run_simulation
    raise AttributeError(f"module 'orchard.simulation' has no attribute {name!r}")


__all__ = [
    "DEFAULT_PROFILES",
    "DeviceProfile",
    "SimulationConfig",
    "SimulationReport",
    "build_simulation_config",
    "load_simulation_config",
    "run_simulation",
    "simulation_problems",
]

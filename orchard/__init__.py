"""Orchard: hierarchical federated learning.

Core types, errors, typed configuration, the wire format and the CLI live here; the
subpackages (`orchard.server`, `orchard.client`, `orchard.aggregation`, ...) are mapped
from the repository's top-level folders by pyproject.
"""

from orchard import tlsversion as _tlsversion

# Before anything imports grpc, which reads its TLS settings once: TLS 1.3 only.
_tlsversion.pin()

__version__ = "0.1.0"

"""Orchard: hierarchical federated learning.

Core types, errors, typed configuration, the wire format and the CLI live here; the
subpackages (`orchard.server`, `orchard.client`, `orchard.aggregation`, ...) are mapped
from the repository's top-level folders by pyproject.
"""

__version__ = "0.1.0"

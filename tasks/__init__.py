"""Orchard subpackage."""

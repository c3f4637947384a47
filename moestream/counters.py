"""The base of the engine's counter dataclasses (the store's reads, the tiers, read-ahead, decode graphs)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Counters:
    """A dataclass of counters, readable as one dict."""

    def as_dict(self) -> dict:
        """The fields by name (a shallow copy: a subclass copies what it holds in containers)."""
        return dict(self.__dict__)

"""End-of-stream markers. They travel through channels like items and are checked by identity."""

from __future__ import annotations

from typing import Final

__all__ = ["END", "EPOCH_END", "Marker"]


class Marker:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"

    def __reduce__(self) -> str:  # pickling keeps identity
        return self.name


END: Final = Marker("END")
"""No more items will come: the sender closed its end."""

EPOCH_END: Final = Marker("EPOCH_END")
"""The items before this one complete an epoch."""

"""The end-of-stream marker. It travels through channels like an item and is checked by identity."""

from __future__ import annotations

from typing import Final

__all__ = ["END", "Marker"]


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

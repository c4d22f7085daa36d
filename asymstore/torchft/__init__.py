"""torchft healing through the store: :class:`StoreTransport` (guide: docs/guides/torchft.md).

Importing it imports ``torchft`` (the ``[torchft]`` extra).
"""

from asymstore.torchft.transport import Healed, ManagerLike, Position, StoreTransport

__all__ = ["Healed", "ManagerLike", "Position", "StoreTransport"]

"""The DCP storage's loop thread: :class:`asymstore.runtime.loop.LoopThread` (its former home).

``torch.distributed.checkpoint`` calls the storage synchronously, from the training thread
(``dcp.save``, ``dcp.load``) or from its own executor thread (``dcp.async_save``); the store is
asynchronous and binds its locks and tasks to one loop. So the writer (and a reader that opens a
store of its own) opens the store on a private loop thread and sends every call there.
"""

from __future__ import annotations

from asymstore.runtime.loop import LoopThread

__all__ = ["LoopThread"]

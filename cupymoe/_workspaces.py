"""The workspaces an ``MoE`` layer keeps between calls: one per (T, k), in bounded memory."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

# Besides the latest call's and the captured ones, workspaces are kept up to this many bytes.
SPARE_BYTES = 512 << 20


@dataclass
class _Entry:
    workspace: Any
    owned: Any  # the output array returned when the call has no out=
    captured: bool = False

    @property
    def nbytes(self) -> int:
        return self.workspace.nbytes + self.owned.nbytes


class WorkspaceCache:
    """(T, k) -> (workspace, owned output), so that a call with a T kept from before allocates nothing.

    A workspace used during CUDA graph capture is kept for the layer's lifetime, since the graph's
    kernels hold its addresses. When a new one is made, the others, apart from it, are dropped
    least recently used first while they hold more than ``spare_bytes`` together, so calls with
    many different T take bounded memory. A dropped owned output stays valid for whoever holds it.
    """

    def __init__(self, spare_bytes: int = SPARE_BYTES):
        self.spare_bytes = spare_bytes
        self._entries: OrderedDict[Any, _Entry] = OrderedDict()  # least recently used first

    def __getitem__(self, key) -> tuple:
        entry = self._entries[key]
        return entry.workspace, entry.owned

    def __contains__(self, key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def use(self, key, create: Callable[[], tuple], captured: bool) -> tuple:
        """The (workspace, owned output) for ``key``, from ``create()`` if not kept; ``captured``:
        the call is being captured into a CUDA graph."""
        entry = self._entries.pop(key, None)
        made = entry is None
        if made:
            entry = _Entry(*create())
        entry.captured = entry.captured or captured
        self._entries[key] = entry
        if made:  # only a new workspace adds memory: a call with a kept T does no bookkeeping
            self._drop_spares()
        return entry.workspace, entry.owned

    def clear(self) -> None:
        """Drop every workspace, captured ones too."""
        self._entries.clear()

    def _drop_spares(self) -> None:
        spares = [(key, e) for key, e in list(self._entries.items())[:-1] if not e.captured]
        spare_bytes = sum(e.nbytes for _, e in spares)
        for key, entry in spares:
            if spare_bytes <= self.spare_bytes:
                break
            del self._entries[key]
            spare_bytes -= entry.nbytes

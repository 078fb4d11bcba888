"""The layer's workspace cache (host side, no GPU): reuse, the memory bound, captured workspaces kept."""
from dataclasses import dataclass

import numpy as np

from cupymoe import _workspaces


@dataclass
class FakeWorkspace:
    nbytes: int


def use(cache, key, nbytes=100, captured=False, made=None):
    """cache.use with a workspace of ``nbytes`` (and an owned output of none), logging creations."""
    def create():
        if made is not None:
            made.append(key)
        return FakeWorkspace(nbytes), np.empty(0, np.uint8)

    return cache.use(key, create, captured)


def keys(cache):
    return [key for key in range(10) if key in cache]


def test_a_kept_key_reuses_its_workspace_and_output():
    cache, made = _workspaces.WorkspaceCache(spare_bytes=1000), []
    first = use(cache, 1, made=made)
    assert use(cache, 1, made=made) == first
    assert first[0] is cache[1][0] and first[1] is cache[1][1]
    assert made == [1]


def test_spares_are_dropped_least_recently_used_first_beyond_the_budget():
    cache, made = _workspaces.WorkspaceCache(spare_bytes=250), []
    for key in (1, 2, 3):
        use(cache, key, made=made)
    use(cache, 1, made=made)  # 1 is now the most recent
    use(cache, 4, made=made)  # spares 3, 2 and 1 hold 300 bytes: 2, the least recent, goes
    assert keys(cache) == [1, 3, 4]
    use(cache, 2, made=made)
    assert keys(cache) == [1, 2, 4] and made == [1, 2, 3, 4, 2]


def test_the_latest_call_keeps_its_workspace_whatever_its_size():
    cache = _workspaces.WorkspaceCache(spare_bytes=0)
    use(cache, 1)
    use(cache, 2, nbytes=10**12)
    assert keys(cache) == [2] and len(cache) == 1


def test_a_workspace_used_in_capture_is_never_dropped():
    cache, made = _workspaces.WorkspaceCache(spare_bytes=0), []
    use(cache, 1, made=made)  # warm-up, outside capture
    use(cache, 1, captured=True, made=made)  # the capture: kept for good from here on
    for key in (2, 3, 4, 1, 5):
        use(cache, key, made=made)
    assert keys(cache) == [1, 5] and made == [1, 2, 3, 4, 5]


def test_the_budget_counts_the_owned_output_too():
    cache = _workspaces.WorkspaceCache(spare_bytes=150)
    cache.use(1, lambda: (FakeWorkspace(100), np.empty(100, np.uint8)), False)
    use(cache, 2)  # the spare (1) holds 200 bytes
    assert keys(cache) == [2]


def test_clear_drops_captured_workspaces_too():
    cache, made = _workspaces.WorkspaceCache(), []
    use(cache, 1, captured=True, made=made)
    use(cache, 2, made=made)
    cache.clear()
    assert len(cache) == 0
    use(cache, 1, made=made)
    assert made == [1, 2, 1]

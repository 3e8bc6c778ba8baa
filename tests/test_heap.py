"""deepco.heap.freeze_long_lived: garbage collected first (not frozen with the rest), the living frozen."""

from __future__ import annotations

import gc
import weakref

from deepco.heap import freeze_long_lived


class _Node:
    pass


def test_garbage_is_collected_before_the_rest_is_frozen_out_of_full_passes():
    cycle = _Node()
    cycle.me = cycle  # only the cyclic collector frees it
    gone = weakref.ref(cycle)
    kept = [_Node() for _ in range(100)]
    del cycle
    try:
        frozen = freeze_long_lived()
        assert gone() is None  # collected, not frozen for good
        # a frozen object can still be freed (by another test's thread still winding down): the count only falls
        assert frozen >= len(kept) and 0 < gc.get_freeze_count() <= frozen
        assert not any(gc.is_tracked(k) and any(k is o for o in gc.get_objects()) for k in kept[:3])
    finally:
        gc.unfreeze()  # the other tests' collector as it was

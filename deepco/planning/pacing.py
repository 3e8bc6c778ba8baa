"""A hook through which a long planning computation yields the CPU to whatever else the process runs.

A camera searches for a better plan on a thread beside its live frames. On a weak camera under a CPU quota
(the testbed's: a tenth of a core) a search of about 0.1-0.25 s of full-speed CPU spends the quota of one
period after another, and the frames' own few milliseconds wait for the next period: on the testbed the
frames around a search took 190-360 ms instead of 80. Where the frames are not worse off than before (a
server came back, a link got faster, a server the running plan leaves idle got slower) the search need not
hurry, so its caller sets a *pace* for its thread
(`paced`), and `search` calls `pace()` between candidates. Where the running plan got slower, no pace is set:
then finding the way out quickly is what counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_PACE: ContextVar[Callable[[], None] | None] = ContextVar("deepco_pace", default=None)


@contextmanager
def paced(hook: Callable[[], None] | None) -> Iterator[None]:
    """Planning on this thread calls ``hook`` between units of work while this runs (None: no pace)."""
    token = _PACE.set(hook)
    try:
        yield
    finally:
        _PACE.reset(token)


def pace() -> None:
    """Yield to the hook `paced` set for this thread, if any."""
    hook = _PACE.get()
    if hook is not None:
        hook()

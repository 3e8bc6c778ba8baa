"""Refusals of the server's budgets, counted by reason (Prometheus ``deepco_refusals_total{reason}``) and
logged at most once per reason every ``LOG_EVERY`` seconds, so an attack cannot flood the log.

Reasons: ``slots`` (a lane's calls at once), ``queue`` (control calls at once), ``held_bytes`` (a request or
reply over ``--max-held-bytes``), ``body_deadline`` (a request whose body did not come in time),
``write_stall`` (a reply the client did not read in time), ``mailbox`` (split-job exchanges for jobs not
admitted here, over their pool).
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("deepco.serve")

LOG_EVERY = 10.0


class Refusals:
    """Counts refusals by reason and logs them, rate-limited (module doc)."""

    def __init__(self, log_every: float = LOG_EVERY):
        self.log_every = log_every
        self._counts: dict[str, int] = {}
        self._logged: dict[str, tuple[float, int]] = {}  # reason -> (when last logged, count then)
        self._lock = threading.Lock()

    def count(self, reason: str, message: str) -> None:
        """Count one refusal for ``reason``; log ``message`` unless this reason was logged lately."""
        now = time.monotonic()
        with self._lock:
            total = self._counts[reason] = self._counts.get(reason, 0) + 1
            last = self._logged.get(reason)
            if last is not None and now - last[0] < self.log_every:
                return
            self._logged[reason] = (now, total)
        since = total - 1 - (last[1] if last is not None else 0)
        log.warning("refused (%s): %s%s", reason, message[:300],
                    f" ({since} more since the last such line)" if since > 0 else "")

    def counts(self) -> dict[str, int]:
        """Refusals so far, by reason."""
        with self._lock:
            return dict(self._counts)

"""Log output of `deepco serve`: human text (default) or one JSON object per line (``--log-format json``).

JSON lines always carry ``ts`` (UTC, ISO 8601 with milliseconds), ``level`` and ``event``; the per-RPC
lines of server.metrics add ``service``, ``method``, ``code``, ``ms``, ``model`` and ``peer``. Other log
messages have ``event: "log"`` and their text in ``msg``.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys

FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as a JSON line."""
        ts = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC).isoformat(timespec="milliseconds")
        line: dict[str, object] = {"ts": ts.replace("+00:00", "Z"), "level": record.levelname.lower()}
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        else:
            line["event"] = "log"
            line["msg"] = record.getMessage()
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info).splitlines()[-1]
        return json.dumps(line, default=str)


def configure(log_format: str = "text") -> None:
    """Log the server to stderr: text lines, or JSON lines that include one line per RPC (text mode leaves
    the per-RPC lines out, to keep a busy or attacked server's stderr readable; /metrics counts them)."""
    if log_format not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
        logging.getLogger("deepco.serve.rpc").setLevel(logging.INFO)
    else:
        handler.setFormatter(logging.Formatter("deepco serve: %(message)s"))
        logging.getLogger("deepco.serve.rpc").setLevel(logging.ERROR)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)

"""The JSON log formatter of the gateway and the node: one object a line."""
from __future__ import annotations

import json
import logging
from typing import Callable

_STANDARD_LOG_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object a line; `extra` fields become keys (request_id, org, model, event, ...).
    `context` adds the fields of the request being served (the gateway's request id and org)."""

    def __init__(self, *args, context: Callable[[], dict] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.context = context

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 6), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        if self.context is not None:
            out.update(self.context())
        for key, value in vars(record).items():
            if key not in _STANDARD_LOG_ATTRS and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)

"""Logging of one instance: `setup(level, fmt, role)`.

Text (the default) is one line per record: `TIME ROLE LEVEL LOGGER: MESSAGE`. `fmt="json"`
writes one JSON object per line instead (`time`, `level`, `role`, `logger`, `message`, and
`exc` with the traceback when there is one), for log collectors.

At INFO and above, the libraries that log every request or step at INFO (httpx and httpcore:
every status report and proposal; hpack, h2, aioquic, hypercorn; transformers) are raised
to WARNING: an instance's log says what the instance did, not what its HTTP client did.
At DEBUG they speak as well.
"""

from __future__ import annotations

import json
import logging
import sys
import time

CHATTY = ("httpx", "httpcore", "hpack", "h2", "aioquic", "quic", "hypercorn.access", "hypercorn.error",
          "transformers", "urllib3", "asyncio", "filelock")
FORMATS = ("text", "json")


class JSONFormatter(logging.Formatter):
    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        obj = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                    + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "role": self.role, "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, ensure_ascii=False)


def setup(level: str = "info", fmt: str = "text", role: str = "sdcp-fast", stream=None) -> None:
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log_level: one of debug, info, warning, error, not {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"log_format: 'text' or 'json', not {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    if fmt == "json":
        handler.setFormatter(JSONFormatter(role))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.WARNING if numeric >= logging.INFO else logging.NOTSET)

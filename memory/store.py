"""A JSON key-value store: what the pack learns once per machine (meta-sized peaks, self-check verdicts).

Values live in memory and, when ``path`` is given (the nodes pass a file under ComfyUI's user folder), in
``{"schema": 1, "<section>": {key: value}}``. An unreadable file is ignored (logged), never fatal; a file
that cannot be written keeps the values in memory for the session.
"""

from __future__ import annotations

import json
import logging
import pathlib
import threading
from typing import Any

log = logging.getLogger("vramfit.memory.json_store")

SCHEMA = 1


class JsonStore:
    """Values by string key. :meth:`put` marks the store dirty; :meth:`flush` writes the file."""

    section = "values"
    """Name of the JSON object holding the values (subclasses: ``"peaks"``, ``"checks"``)."""

    def __init__(self, path: str | pathlib.Path | None = None) -> None:
        self.path = pathlib.Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._values: dict[str, Any] = {}
        self._dirty = False
        if self.path is not None and self.path.is_file():
            try:
                data = json.loads(self.path.read_text())
                if data.get("schema") == SCHEMA:
                    self._values.update((str(k), self.coerce(v)) for k, v in data.get(self.section, {}).items())
            except (ValueError, TypeError, AttributeError, KeyError, OSError) as e:
                log.warning("ignoring unreadable %s cache %s: %s", self.section, self.path, e)

    @staticmethod
    def coerce(value: Any) -> Any:
        """A value as read from the file (subclasses check its type)."""
        return value

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: str) -> Any:
        with self._lock:
            return self._values.get(key)

    def put(self, key: str, value: Any) -> None:
        with self._lock:
            self._values[key] = self.coerce(value)
            self._dirty = True

    def flush(self) -> None:
        with self._lock:
            if not self._dirty or self.path is None:
                return
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_suffix(self.path.suffix + ".tmp")
                tmp.write_text(json.dumps({"schema": SCHEMA, self.section: dict(sorted(self._values.items()))},
                                          indent=0))
                tmp.replace(self.path)
                self._dirty = False
            except OSError as e:
                log.warning("could not write the %s cache %s: %s", self.section, self.path, e)

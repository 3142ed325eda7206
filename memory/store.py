"""The one store of what the pack learns once per machine: cost models, meta-sized peaks, self-check verdicts.

Values are looked up by string key: first what this machine learned (in memory, and in a JSON file when
``path`` is given: the nodes pass one under ComfyUI's user folder), then the shipped defaults (read-only
files of the same format under ``memory/cost/data``). The key carries everything that decides the value
(structure digest, executor version constant, dtype, device type), so a stale value is never looked up.

File format: ``{"schema": <Store.schema>, "<Store.section>": {key: value}}``. A file of another schema or
that cannot be read is ignored (logged); a file that cannot be written keeps the values in memory for the
session: a cache problem never fails a decode.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

log = logging.getLogger("vramfit.memory.store")

__all__ = ["Store", "read_entries", "write_entries"]

V = TypeVar("V")


def read_entries(path: pathlib.Path, section: str, schema: int) -> dict[str, Any]:
    """The raw ``{key: value}`` of one store file; ValueError when it is not this section's schema."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("schema") != schema or not isinstance(data.get(section), dict):
        raise ValueError(f"not a {section!r} store file of schema {schema}")
    return {str(k): v for k, v in data[section].items()}


def write_entries(path: str | pathlib.Path, section: str, schema: int, entries: Mapping[str, Any]) -> None:
    """Write ``entries`` (JSON values) atomically (a temp file replaced into place)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(json.dumps({"schema": schema, section: dict(sorted(entries.items()))}, indent=1))
        tmp.replace(path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


class Store(Generic[V]):
    """Values by string key. Subclasses set ``section``, ``schema`` and the JSON codec
    (:meth:`encode` / :meth:`decode`); ``defaults_dir``: shipped files (``*.json``) of the same format."""

    section = "values"
    schema = 1
    what = ""
    """How log messages name the store (default: ``section``)."""

    def __init__(self, path: str | pathlib.Path | None = None, defaults_dir: pathlib.Path | None = None) -> None:
        self.path = pathlib.Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._defaults: dict[str, V] = {}
        self._values: dict[str, V] = {}
        self._dirty = False
        if defaults_dir is not None and defaults_dir.is_dir():
            for f in sorted(defaults_dir.glob("*.json")):
                self._defaults.update(self._read(f, "shipped file"))
        if self.path is not None and self.path.is_file():
            self._values.update(self._read(self.path, "cache"))

    def _read(self, path: pathlib.Path, kind: str) -> dict[str, V]:
        try:
            return {k: self.decode(v) for k, v in read_entries(path, self.section, self.schema).items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:  # ignored, never fatal
            log.warning("ignoring unreadable %s %s %s: %s", self.what or self.section, kind, path, e)
            return {}

    def decode(self, value: Any) -> V:
        """A value as read from JSON (raise ValueError/TypeError/KeyError when malformed)."""
        return value

    def encode(self, value: V) -> Any:
        """A value as written to JSON."""
        return value

    def __len__(self) -> int:
        return len(set(self._values) | set(self._defaults))

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(set(self._values) | set(self._defaults))

    def get(self, key: str) -> V | None:
        with self._lock:
            found = self._values.get(key)
            return found if found is not None else self._defaults.get(key)

    def is_default(self, key: str) -> bool:
        with self._lock:
            return key in self._defaults and key not in self._values

    def put(self, key: str, value: V, *, write: bool = True) -> None:
        """Keep ``value`` (in memory always); ``write``: also write the file now, else at :meth:`flush`."""
        self._keep(key, value, write)

    def drop(self, key: str) -> None:
        """Forget the value learned for ``key`` (a shipped default stays)."""
        with self._lock:
            if self._values.pop(key, None) is None:
                return
            self._dirty = True
        self.flush()

    def _keep(self, key: str, value: V, write: bool = True) -> None:
        with self._lock:
            self._values[key] = self.decode(self.encode(value))
            self._dirty = True
        if write:
            self.flush()

    def flush(self) -> None:
        """Write the values learned on this machine, when there is a file and something new."""
        with self._lock:
            if not self._dirty or self.path is None:
                return
            try:
                write_entries(self.path, self.section, self.schema,
                              {k: self.encode(v) for k, v in self._values.items()})
                self._dirty = False
            except (OSError, TypeError, ValueError) as e:
                log.warning("could not write the %s cache %s (kept in memory): %s", self.what or self.section, self.path,
                            e)

    def get_or_make(self, key: str, make: Callable[[], V], *, write: bool = True) -> V:
        """The stored value for ``key``, or ``make()`` it once and keep it (``write``: to the file at once)."""
        found = self.get(key)
        if found is not None:
            return found
        value = make()
        self._keep(key, value, write)
        return value

    def write_defaults(self, path: str | pathlib.Path, keys: Iterable[str] | None = None) -> None:
        """Write this store's values (``keys``, or all learned here) as a shipped-defaults file."""
        with self._lock:
            chosen = self._values if keys is None else {k: self._values[k] for k in keys}
            entries = {k: self.encode(v) for k, v in chosen.items()}
        write_entries(path, self.section, self.schema, entries)

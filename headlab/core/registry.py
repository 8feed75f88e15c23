"""Registries, one per extension point (score sources, KV compression methods): a name -> entry map whose entries
are frozen records carrying their metadata, so every command, table and report derives its choices from one place.

Entries name their functions as "module:function" (`Lazy`), imported on first call: the CLI lists choices and help
from a registry without importing torch (start-up time). tests/test_registries.py checks every reference resolves
and points to its own wing or one below it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from headlab.core.errors import HeadlabError

Entry = TypeVar("Entry")


@dataclass(frozen=True)
class Lazy:
    """A function named by "package.module:function", imported when first called."""

    target: str

    def resolve(self):
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)

    def __call__(self, *args, **kwargs):
        return self.resolve()(*args, **kwargs)


class Registry(Mapping[str, Entry], Generic[Entry]):
    """Entries by name, in registration order; `registry[name]` of an unknown name is a one-line error listing the
    names, spoken as the parameter that carries the name (`unknown method='x'; use one of grad, taylor`)."""

    def __init__(self, parameter: str, entries: Iterable[Entry] = ()):
        self.parameter = parameter
        self._entries: dict[str, Entry] = {}
        for entry in entries:
            self.register(entry)

    def register(self, entry: Entry) -> Entry:
        name = entry.name
        if name in self._entries:
            raise ValueError(f"{self.parameter} {name!r} is registered twice")
        self._entries[name] = entry
        return entry

    def __getitem__(self, name: str) -> Entry:
        if name not in self._entries:
            raise HeadlabError(f"unknown {self.parameter}={name!r}; use one of {', '.join(self._entries)}")
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def names(self, **where) -> tuple[str, ...]:
        """The names of the entries whose attributes equal `where` (`names(order=True)`), in registration order."""
        return tuple(n for n, e in self._entries.items() if all(getattr(e, k) == v for k, v in where.items()))

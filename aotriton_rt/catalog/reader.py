"""Typed access to parsed JSON whose errors name the file, the JSON path and the bad value."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ..errors import CatalogError


class _Reader:
    """Typed access to one JSON object, with errors that name file and JSON path."""

    def __init__(self, obj: Any, path: str, source: str) -> None:
        if type(obj) is not dict and not isinstance(obj, Mapping):
            raise CatalogError(f"{source}: {path} must be an object, found {_show(obj)}")
        self.obj, self.path, self.source = obj, path, source

    def _fail(self, key: str, what: str, value: Any) -> CatalogError:
        return CatalogError(f"{self.source}: {self.path}.{key} must be {what}, found {_show(value)}")

    def get(self, key: str, kind: type | tuple[type, ...], what: str, default: Any = ...) -> Any:
        value = self.obj.get(key, _ABSENT)
        if value is _ABSENT:
            if default is not ...:
                return default
            raise CatalogError(f"{self.source}: {self.path}.{key} is missing")
        # What json.loads makes passes on its exact type (a catalog is read thousands of values
        # at a time, and an ABC's isinstance is slow); anything else takes the full check.
        if type(value) is kind or (kind is Mapping and type(value) is dict):
            return value
        # bool is an int in Python; a catalog int field must not accept true/false.
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
            raise self._fail(key, what, value)
        return value

    def int(self, key: str, minimum: int = 0, default: Any = ..., maximum: int = 2**63 - 1) -> int:
        what = f"an integer >= {minimum}" if maximum == 2**63 - 1 else f"an integer in [{minimum}, {maximum}]"
        value = self.get(key, int, what, default)
        if not minimum <= value <= maximum:
            raise self._fail(key, what, value)
        return value

    def name(self, key: str, pattern: re.Pattern, what: str) -> str:
        value = self.str(key)
        if not pattern.match(value):
            raise self._fail(key, what, value)
        return value

    def str(self, key: str, default: Any = ...) -> str:
        return self.get(key, str, "a string", default)

    def sub(self, key: str, default: Any = ...) -> _Reader:
        value = self.get(key, Mapping, "an object", default)
        return _Reader(value, f"{self.path}.{key}", self.source)

    def list(self, key: str, default: Any = ...) -> list:
        return self.get(key, list, "a list", default)

    def scalars(self, key: str, names: re.Pattern, max_string: int) -> dict[str, Any]:
        """The object at ``key`` (default empty) as a dict of scalars: keys matching ``names``,
        values strings of at most ``max_string`` characters, booleans, floats, or integers that
        fit in 64 bits."""
        obj = self.sub(key, {})
        for k, v in obj.obj.items():
            if type(k) is not str or not names.match(k):
                raise CatalogError(f"{obj.source}: {obj.path} has key {_show(k)}, which is not a plain name")
            t = type(v)
            if t is int or t is bool:
                if not -2**63 <= v < 2**64:
                    raise obj._fail(k, "an integer that fits in 64 bits", v)
            elif t is str:
                if len(v) > max_string:
                    raise obj._fail(k, f"a string of at most {max_string} characters", v)
            elif t is not float:
                raise obj._fail(k, "a string, number or boolean", v)
        return dict(obj.obj)


_ABSENT = object()


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _show(value: Any) -> str:
    try:
        text = json.dumps(value) if not isinstance(value, Mapping) else "an object"
    except (RecursionError, ValueError):
        text = f"a deeply nested {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."

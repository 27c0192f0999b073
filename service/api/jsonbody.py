"""What a JSON request body must be before any route reads it, pure: :func:`refusal`.

Python's ``json`` (which FastAPI uses) and pydantic's parser both accept ``NaN``, ``Infinity``
and literals that overflow to infinity (``1e999``); a non-finite number stored in a record is
written back as ``null`` and breaks every later read of it. They also let the last of two equal
keys win, and Python's ``int`` refuses more than 4,300 digits with a message meant for Python
programmers. So every body is first read by :func:`worker.jobspec.jsonlimits.loads` (the project's one
JSON reader with limits): at most ``MAX_DEPTH`` levels deep, finite numbers only, each key once
per object, integers of at most ``sys.get_int_max_str_digits()`` digits. A refused body is a
4xx naming the field (found by :func:`_locate`, which runs only on the refusal path); a body
that is not JSON at all is left to its route, which answers 400 ``malformed_json``.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from typing import Any

from worker.jobspec.jsonlimits import JSONRefused, json_depth, loads

MAX_DEPTH = 64
"""The deepest nesting of arrays and objects a request body may have (no document of this API
needs more; the parsers recurse once per level)."""


@dataclass(frozen=True, slots=True)
class BodyRefusal:
    """Why a body is refused: the HTTP answer's status, code, message and field."""

    status: int
    code: str
    message: str
    field: str | None = None


def refusal(data: bytes) -> BodyRefusal | None:
    """Why ``data`` (a whole request body) is refused, or None when it may go on to its route
    (valid, or empty, or not JSON at all: the route says so)."""
    if not data.strip():
        return None
    try:
        loads(
            data,
            max_bytes=len(data),  # the size limit is the middleware's (413)
            max_depth=MAX_DEPTH,
            what="the request body",
            reject_duplicate_keys=True,
            reject_non_finite=True,
        )
    except JSONRefused as exc:
        return _explain(data, exc)
    return None


def _explain(data: bytes, exc: JSONRefused) -> BodyRefusal | None:
    if json_depth(data) > MAX_DEPTH:
        reason = f"the JSON body is nested deeper than {MAX_DEPTH} levels; no elastrain document needs that"
        return BodyRefusal(422, "too_deep", reason)
    try:
        found = _locate(json.loads(data, object_pairs_hook=_Object))
    except RecursionError:  # pragma: no cover - the depth check above comes first
        return BodyRefusal(422, "too_deep", exc.problem)
    except ValueError as err:
        if "integer string conversion" in str(err):
            digits = sys.get_int_max_str_digits()
            message = f"a number in the request body has more than {digits} digits; give a smaller number"
            return BodyRefusal(422, "out_of_range", message)
        return None  # not JSON: the route answers 400 malformed_json
    if found is None:  # pragma: no cover - loads refused something the locator does not see
        return BodyRefusal(422, "invalid_request", str(exc))
    path, problem = found
    return BodyRefusal(422, "invalid_request", f"field '{path}': {problem}", field=path)


class _Object(dict[str, Any]):
    """A decoded JSON object that remembers a key it saw twice."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.duplicate: str | None = None
        if len(self) != len(pairs):
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    self.duplicate = key
                    break
                seen.add(key)


def _locate(value: Any, path: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """The dotted path of the first refused value in document order, and what is wrong."""
    if isinstance(value, float) and not math.isfinite(value):
        return _dotted(path), (
            "not a finite number (NaN, Infinity, or a number too large for a 64-bit float; "
            "JSON has no such numbers); give a finite number"
        )
    if isinstance(value, _Object):
        if value.duplicate is not None:
            where = _dotted((*path, value.duplicate))
            return where, "the key appears more than once in its object; give each key once"
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _locate(item, (*path, str(key)))
        if found is not None:
            return found
    return None


def _dotted(path: tuple[str, ...]) -> str:
    return ".".join(path) or "body"

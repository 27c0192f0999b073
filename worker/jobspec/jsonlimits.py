"""JSON from outside the process, read with limits (torch-free, pure; the service may import it).

Python's ``json`` recurses once per nesting level, so a few hundred thousand brackets end in a
``RecursionError`` that nobody expects; it reads any size it is given; it accepts ``NaN`` and
``Infinity`` (which no other JSON reader does) and lets the last of two equal keys win. The
rules here, in the order they run, each refusal one line (:class:`JSONRefused`, a ValueError):

1. size: at most ``max_bytes`` bytes (UTF-8), refused before anything is scanned;
2. depth: at most ``max_depth`` nested arrays/objects, measured by :func:`json_depth` before
   the parser runs (a C-speed scan; brackets inside strings do not count);
3. the parse, with optional refusal of duplicate object keys and of non-finite numbers
   (``NaN``, ``Infinity``, ``-Infinity``, and literals such as ``1e999`` that overflow to
   infinity); an integer of more digits than Python converts is refused by name.

:func:`finite` is the writer's side: what the worker sends the service carries ``null`` where a
number is not finite (a diverged loss), since the service refuses ``NaN`` and ``Infinity``.

Used for checkpoint manifests (:mod:`worker.checkpoint.layout`); the REST API reuses it for
request bodies (duplicate keys and non-finite numbers refused there).
"""

from __future__ import annotations

import json
import math
import re
import sys
from array import array
from itertools import accumulate
from typing import Any

__all__ = ["JSONRefused", "finite", "json_depth", "loads"]

# A JSON string as the byte scanner sees it: a quote, then anything with backslash escapes,
# then a quote (unrolled loop: no backtracking).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_OTHER = bytes(c for c in range(256) if c not in b"[]{}")
_SIGNS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as signed bytes


class JSONRefused(ValueError):
    """A JSON text refused by :func:`loads`; ``str()`` is one line: ``"<what>: <problem>"``."""

    def __init__(self, what: str, problem: str) -> None:
        super().__init__(f"{what}: {problem}")
        self.what = what
        self.problem = problem


def json_depth(data: bytes | str) -> int:
    """The deepest bracket nesting of a JSON text; brackets inside strings do not count.

    The semantics are those of a byte-by-byte scanner (a quote opens a string, a backslash in a
    string escapes the next byte, an unterminated string runs to the end, a close bracket
    outside a string lowers the depth even below zero), so malformed text gets an answer too
    and is left to the parser. The work runs in C: strings are cut out (split at quotes when
    the text has no backslash, else one regular expression), the brackets left become +1/-1,
    and the deepest prefix sum is the depth (37 MiB of manifest: about 0.1 s).
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if raw.count(b"[") + raw.count(b"{") == 0:
        return 0
    if b"\\" not in raw:
        outside = b"".join(raw.split(b'"')[0::2])  # an odd part count ends inside a string
    else:
        outside = _STRING.sub(b"", raw)
        quote = outside.find(b'"')
        if quote >= 0:  # an unterminated string: everything after its quote is inside it
            outside = outside[:quote]
    brackets = outside.translate(_SIGNS, _OTHER)
    return max(0, max(accumulate(array("b", brackets)), default=0))


def loads(
    data: bytes | str,
    *,
    max_bytes: int,
    max_depth: int,
    what: str,
    reject_duplicate_keys: bool = False,
    reject_non_finite: bool = False,
) -> Any:
    """Parse ``data`` (UTF-8 bytes or text) after checking its size and depth; raises
    :class:`JSONRefused` naming ``what`` (e.g. a file name or "request body") and the problem."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if len(raw) > max_bytes:
        raise JSONRefused(what, f"{len(raw)} bytes is over the limit of {max_bytes} bytes")
    if raw.count(b"[") + raw.count(b"{") > max_depth:  # deeper is impossible otherwise
        depth = json_depth(raw)
        if depth > max_depth:
            raise JSONRefused(what, f"nested {depth} levels deep; at most {max_depth} allowed")
    text = data if isinstance(data, str) else _utf8(data, what)
    hooks: dict[str, Any] = {}
    if reject_duplicate_keys:
        hooks["object_pairs_hook"] = lambda pairs: _unique(pairs, what)
    if reject_non_finite:
        hooks["parse_constant"] = lambda token: _non_finite(token, what)
        hooks["parse_float"] = lambda token: _finite(token, what)
    try:
        return json.loads(text, **hooks)
    except JSONRefused:
        raise
    except RecursionError:  # unreachable within the depth cap; kept so that none escapes
        raise JSONRefused(what, "nested too deeply to parse") from None
    except ValueError as exc:
        if "integer string conversion" in str(exc):
            digits = sys.get_int_max_str_digits()
            raise JSONRefused(what, f"a number has more than {digits} digits") from None
        raise JSONRefused(what, f"not valid JSON: {exc}") from None


def _utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JSONRefused(what, f"not UTF-8 (byte {exc.start})") from None


def _unique(pairs: list[tuple[str, Any]], what: str) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise JSONRefused(what, f"duplicate key {key!r} in an object (each key may appear once)")
            seen.add(key)
    return out


def _non_finite(token: str, what: str) -> float:
    raise JSONRefused(what, f"non-finite number {token} (NaN and Infinity are not JSON numbers)")


def _finite(token: str, what: str) -> float:
    value = float(token)
    if not math.isfinite(value):
        raise JSONRefused(what, f"non-finite number {token} (too large for a 64-bit float)")
    return value


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, +-Infinity) replaced by ``None``, at any depth
    of dicts, lists and tuples (tuples become lists, as JSON has them): JSON that any reader,
    the service's included, accepts."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value

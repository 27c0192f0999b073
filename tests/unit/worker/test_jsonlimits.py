"""worker.jobspec.jsonlimits: JSON from outside the process is read with a size cap and a depth cap,
and (opt-in) without duplicate keys or non-finite numbers; every refusal is one clear line."""

from __future__ import annotations

import json
import random
import tracemalloc

import pytest

from worker.jobspec.jsonlimits import JSONRefused, json_depth, loads


def _reference_depth(data: bytes) -> int:
    """The byte-by-byte scanner the service's body limit used (service/api/limits.py)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == ord("\\"):
                escaped = True
            elif byte == ord('"'):
                in_string = False
        elif byte == ord('"'):
            in_string = True
        elif byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif byte in b"]}":
            depth -= 1
    return deepest


def test_depth_counts_brackets_outside_strings() -> None:
    assert json_depth(b"{}") == 1
    assert json_depth(json.dumps({"a": [{"b": [1, 2]}]}).encode()) == 4
    assert json_depth(b"42") == 0 and json_depth(b"") == 0
    assert json_depth(json.dumps({"name": "[[[[{{{{", "q": 'x\\"[['}).encode()) == 1
    assert json_depth(b"[" * 200_000 + b"]" * 200_000) == 200_000
    assert json_depth('{"ключ": ["значение", {"ü": "[["}]}') == 3  # str in, same answer


@pytest.mark.parametrize("seed", range(5))
def test_depth_matches_the_byte_scanner_on_any_text(seed: int) -> None:
    """Malformed text too (unterminated strings, stray escapes, closes before opens): the
    answer is the reference scanner's, so the service can switch to this one unchanged."""
    rng = random.Random(seed)
    alphabet = b'[]{}"\\ a,:1'
    for _ in range(400):
        data = bytes(rng.choice(alphabet) for _ in range(rng.randrange(0, 60)))
        assert json_depth(data) == _reference_depth(data), data


def test_loads_reads_what_is_within_the_limits() -> None:
    text = json.dumps({"a": [1, 2.5, {"b": None}], "s": "x" * 100})
    assert loads(text, max_bytes=1000, max_depth=3, what="doc") == json.loads(text)
    assert loads(text.encode(), max_bytes=1000, max_depth=3, what="doc") == json.loads(text)
    # permissive by default: what Python's json accepts
    assert loads(b'{"a": 1, "a": 2}', max_bytes=100, max_depth=2, what="doc") == {"a": 2}
    assert str(loads(b"[NaN]", max_bytes=100, max_depth=2, what="doc")[0]) == "nan"


def _refusal(data: str | bytes, **kw: object) -> str:
    opts: dict[str, object] = {"max_bytes": 1 << 20, "max_depth": 64, "what": "spec.json"} | kw
    with pytest.raises(JSONRefused) as info:
        loads(data, **opts)  # type: ignore[arg-type]
    message = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in message and message.startswith("spec.json: ")
    return message


def test_too_deep_is_refused_before_parsing_without_recursion() -> None:
    tracemalloc.start()
    try:
        message = _refusal(b"[" * 200_000 + b"]" * 200_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "nested 200000 levels deep" in message and "at most 64" in message
    assert peak < 8 << 20  # the scan does not build the nested lists
    assert "nested" in _refusal(b'{"a":' * 65 + b"1" + b"}" * 65)
    assert _refusal(b"[" * 100_000).startswith("spec.json: nested")  # unterminated, still refused


def test_too_large_is_refused_before_anything_is_scanned() -> None:
    message = _refusal(b"[" + b"1," * 600 + b"1]", max_bytes=1000)
    assert "1203 bytes" in message and "limit of 1000 bytes" in message
    assert "limit of 10 bytes" in _refusal("ü" * 6, max_bytes=10)  # bytes, not characters


@pytest.mark.parametrize(
    ("data", "expect"),
    [
        (b'{"a": 1,', "not valid JSON"),
        (b"\xff\xfe[]", "not UTF-8"),
        (b"1" * 5000, "more than 4300 digits"),
    ],
)
def test_malformed_input_gets_one_line(data: bytes, expect: str) -> None:
    assert expect in _refusal(data)


def test_duplicate_keys_refused_when_asked() -> None:
    message = _refusal(b'{"spec": {"lr": 1, "lr": 2}}', reject_duplicate_keys=True)
    assert "duplicate key 'lr'" in message
    assert loads(b'{"a": {"x": 1}, "b": {"x": 2}}', max_bytes=100, max_depth=2, what="d",
                 reject_duplicate_keys=True) == {"a": {"x": 1}, "b": {"x": 2}}  # fmt: skip


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e999", "-1e400"])
def test_non_finite_numbers_refused_when_asked(token: str) -> None:
    message = _refusal(f'{{"optimizer": {{"lr": {token}}}}}', reject_non_finite=True)
    assert "non-finite number" in message and token in message
    assert loads("[1e308, -0.0, 5]", max_bytes=100, max_depth=1, what="d", reject_non_finite=True) == [
        1e308,
        -0.0,
        5,
    ]

"""Nesting depth of request bodies, counted before any parser recurses."""

from __future__ import annotations

import json

from service.api.limits import MAX_DEPTH, json_depth


def test_depth_of_ordinary_documents() -> None:
    assert json_depth(b"{}") == 1
    assert json_depth(json.dumps({"a": [{"b": [1, 2]}]}).encode()) == 4
    assert json_depth(b"42") == 0


def test_brackets_inside_strings_do_not_count() -> None:
    assert json_depth(json.dumps({"name": "[[[[{{{{", "q": 'x\\"[['}).encode()) == 1


def test_deep_documents_are_caught_early() -> None:
    assert json_depth(b"[" * 100_000 + b"]" * 100_000) > MAX_DEPTH
    assert json_depth(b'{"a":' * (MAX_DEPTH + 1) + b"1" + b"}" * (MAX_DEPTH + 1)) > MAX_DEPTH

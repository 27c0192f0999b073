from __future__ import annotations

import dataclasses
import json

import pytest

from tests.unit.checkpoint.synth import TENSORS, synth
from worker.checkpoint.manifest import FileEntry, Piece, manifest_from_json, manifest_to_json, validate
from worker.errors import CorruptCheckpointError


def test_round_trip_is_exact() -> None:
    m = synth(TENSORS, 2).manifest
    text = manifest_to_json(m)
    again = manifest_from_json(text)
    assert again == m
    assert manifest_to_json(again) == text


def test_json_is_plain_data() -> None:
    raw = json.loads(manifest_to_json(synth(TENSORS, 2).manifest))
    assert raw["format_version"] == 1
    assert set(raw["tensors"]["model.big"]) == {"dtype", "shape", "kind", "pieces"}
    assert raw["tensors"]["rank1/extra"]["owner"] == 1
    piece = raw["tensors"]["model.big"]["pieces"][0]
    assert set(piece) == {"file", "offset", "nbytes", "rows", "digests"}


def _edit(mutate) -> str:  # type: ignore[no-untyped-def]
    raw = json.loads(manifest_to_json(synth(TENSORS, 2).manifest))
    mutate(raw)
    return json.dumps(raw)


@pytest.mark.parametrize(
    ("mutate", "expect"),
    [
        (lambda r: r.update(format_version=99), "format_version 99"),
        (lambda r: r["tensors"]["model.big"]["pieces"].pop(), "rows"),
        (lambda r: r["tensors"]["model.a.bias"].update(dtype="float8"), "unknown dtype"),
        (lambda r: r["tensors"]["model.a.bias"].update(kind="mirrored"), "unknown kind"),
        (lambda r: r["tensors"]["model.a.bias"]["pieces"][0].update(nbytes=3), "bytes"),
        (lambda r: r["tensors"]["model.a.bias"]["pieces"][0]["digests"].append("0" * 32), "block digests"),
        (lambda r: r["tensors"]["model.a.bias"]["pieces"][0].update(file="../../etc/passwd"), "unknown file"),
        (lambda r: r["files"].update({"../x": {"size": 0, "digest": "0" * 32}}), "not allowed"),
        (lambda r: r["files"]["rank-00000.bin"].update(size=10**6), "pieces cover"),
        (lambda r: r.update(step="10"), "schema"),
        (lambda r: r.pop("tensors"), "schema"),
        (lambda r: r["tensors"]["rank1/extra"].pop("owner"), "owner"),
    ],
)
def test_invalid_manifests_are_refused(mutate, expect: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(CorruptCheckpointError, match=expect):
        manifest_from_json(_edit(mutate))


def test_not_json_is_corrupt() -> None:
    with pytest.raises(CorruptCheckpointError, match="not UTF-8"):
        manifest_from_json(b"\x80\x03}q\x00.")
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        manifest_from_json(b"cos\nsystem\n.")  # a pickle is refused as data, never executed


def test_overlapping_pieces_in_a_file_are_refused() -> None:
    m = synth(TENSORS, 2).manifest
    entry = m.tensors["model.a.bias"]
    moved = dataclasses.replace(entry.pieces[0], offset=entry.pieces[0].offset + 4)
    tensors = dict(m.tensors)
    tensors["model.a.bias"] = dataclasses.replace(entry, pieces=(moved,))
    with pytest.raises(CorruptCheckpointError):
        validate(dataclasses.replace(m, tensors=tensors))


def test_empty_checkpoint_is_valid() -> None:
    m = dataclasses.replace(synth({}, 1).manifest, files={"rank-00000.bin": FileEntry(0, "0" * 32)})
    validate(m)
    assert Piece("f", 0, 0, (0, 0), ()).rows == (0, 0)

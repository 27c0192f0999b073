"""What a save that never committed left in a bucket: which steps' shards and open multipart
uploads are collected, at a start and after a publish; a store without ListMultipartUploads
leaves the uploads (a warning) and still collects the shards. An in-memory store stands in for
S3 (the integration tests run the same code against SeaweedFS)."""

from __future__ import annotations

import logging

import pytest

from worker.checkpoint import remote
from worker.checkpoint.storage import ObjectInfo, StorageError, Upload
from worker.jobspec.location import S3Location

JOB = S3Location("ckpt", "runs/a")


class MemoryStore:
    """The part of :class:`~worker.checkpoint.storage.Storage` collecting uses, in memory."""

    def __init__(self, keys: list[str], uploads: list[str], *, lists_uploads: bool = True) -> None:
        self.objects = {k: b"x" for k in keys}
        self.open = [Upload(k, f"id-{i}") for i, k in enumerate(uploads)]
        self.lists_uploads = lists_uploads

    def listing(self, prefix: str = "", *, recursive: bool = False) -> tuple[list[str], list[ObjectInfo]]:
        under = [k for k in self.objects if k.startswith(f"{prefix}/")]
        if recursive:
            return [], [ObjectInfo(k, 1, "") for k in under]
        dirs = sorted(
            {f"{prefix}/{k[len(prefix) + 1 :].split('/')[0]}" for k in under if "/" in k[len(prefix) + 1 :]}
        )
        return dirs, [ObjectInfo(k, 1, "") for k in under if "/" not in k[len(prefix) + 1 :]]

    def delete(self, keys: list[str]) -> None:
        for k in keys:
            self.objects.pop(k, None)

    def uploads(self, prefix: str) -> list[Upload]:
        if not self.lists_uploads:
            raise StorageError("s3://ckpt: NotImplemented")
        return [u for u in self.open if u.key.startswith(prefix)]

    def abort_uploads(self, uploads: list[Upload]) -> None:
        self.open = [u for u in self.open if u not in uploads]


def _store(monkeypatch: pytest.MonkeyPatch, **kwargs: object) -> MemoryStore:
    store = MemoryStore(
        ["runs/a/step-00000002/rank-00000.bin", "runs/a/step-00000004/rank-00000.bin",
         "runs/a/step-00000004/manifest.json", "runs/a/step-00000006/rank-00000.bin"],
        ["runs/a/step-00000002/rank-00001.bin", "runs/a/step-00000006/rank-00001.bin"],
        **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip
    monkeypatch.setattr(remote, "storage_for", lambda loc: store)
    return store


def test_at_a_start_every_unpublished_step_and_open_upload_goes(monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store(monkeypatch)
    assert remote.collect_unpublished(JOB) == ["step-00000002", "step-00000006"]
    assert sorted(store.objects) == [
        "runs/a/step-00000004/manifest.json",
        "runs/a/step-00000004/rank-00000.bin",
    ]
    assert store.open == []


def test_after_a_publish_only_earlier_steps_go(monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store(monkeypatch)
    assert remote.collect_unpublished(JOB, below=4) == ["step-00000002"]
    assert "runs/a/step-00000006/rank-00000.bin" in store.objects
    assert [u.key for u in store.open] == ["runs/a/step-00000006/rank-00001.bin"]


def test_a_store_that_cannot_list_uploads_still_loses_the_shards(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = _store(monkeypatch, lists_uploads=False)
    with caplog.at_level(logging.WARNING, logger="elastrain.checkpoint"):
        assert remote.collect_unpublished(JOB) == ["step-00000002", "step-00000006"]
    assert "runs/a/step-00000002/rank-00000.bin" not in store.objects and len(store.open) == 2
    assert "open multipart uploads under s3://ckpt/runs/a not collected" in caplog.text

"""Where a checkpoint lives: s3:// parsed into bucket and prefix, other schemes refused naming
the field, and the JobSpec applying the rule to checkpoint.dir and checkpoint.resume."""

from __future__ import annotations

import pytest

from worker.errors import SpecError
from worker.jobspec.location import S3Location, parse_location
from worker.jobspec.spec import CheckpointSpec


def test_s3_url_is_bucket_and_prefix() -> None:
    loc = parse_location("s3://ckpt/runs/a/")
    assert loc == S3Location("ckpt", "runs/a")
    assert str(loc) == "s3://ckpt/runs/a" and loc.key("latest") == "runs/a/latest"
    assert loc / "step-00000002" == S3Location("ckpt", "runs/a/step-00000002")
    assert (loc / "step-00000002").parent == loc and (loc / "step-00000002").name == "step-00000002"
    assert parse_location("s3://ckpt") == S3Location("ckpt", "")


def test_local_paths_are_not_locations() -> None:
    assert parse_location("/data/ckpt") is None
    assert parse_location("runs/s3:/x") is None


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("gs://bucket/x", "gs:// is not supported"),
        ("file:///tmp/x", "file:// is not supported"),
        ("S3://Bad_Bucket/x", "not a valid S3 bucket name"),
        ("s3://ckpt/a//b", "empty, '.' or '..' part"),
        ("s3://ckpt/a/../b", "empty, '.' or '..' part"),
    ],
)
def test_bad_urls_are_one_line_naming_the_field(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=r"checkpoint\.resume") as info:
        parse_location(text, field="checkpoint.resume")
    assert words in str(info.value) and "\n" not in str(info.value)


def test_jobspec_checks_dir_and_resume() -> None:
    assert CheckpointSpec(dir="s3://ckpt/runs/a", resume="s3://ckpt/runs/b").dir == "s3://ckpt/runs/a"
    for field, value in (("dir", "gs://x/y"), ("resume", "hdfs://nn/x")):
        with pytest.raises((ValueError, SpecError), match=rf"checkpoint\.{field}"):
            CheckpointSpec(**{field: value})

"""The built-in token-file dataset: windows of a flat binary file of token ids (nanoGPT's format),
its held-out data, its vocabulary, and refusals that name the field and the fix."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from worker.datapath.datasets import build_data, has_eval
from worker.datapath.tokenfile import written_as
from worker.errors import SpecError
from worker.jobspec.spec import DataSpec, JobSpec, parse_spec


def write(path: Path, ids: Any, dtype: str = "uint16") -> Path:
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


@pytest.fixture
def train(tmp_path: Path) -> Path:
    return write(tmp_path / "train.bin", np.arange(101))  # 10 windows of 10 (+1)


def spec(path: Path, **over: Any) -> DataSpec:
    return DataSpec.model_validate(
        {"name": "token-file", "path": str(path), "dtype": "uint16", "seq_len": 10} | over
    )


def test_sample_i_is_the_window_at_i_seq_len_and_the_targets_are_the_next_tokens(train: Path) -> None:
    data = build_data(spec(train), seed=0)
    assert len(data) == 10 and data.task == "lm"
    x, y = data.batch(np.array([3, 0]))
    assert x.tolist() == [list(range(30, 40)), list(range(0, 10))]
    assert y.tolist() == [list(range(31, 41)), list(range(1, 11))]
    assert str(x.dtype) == "torch.int64" and x.is_contiguous() and y.is_contiguous()
    assert data.meta == {"vocab_size": 101, "seq_len": 10, "task": "lm"}  # the largest id + 1


def test_a_tail_shorter_than_a_window_is_not_trained_on(tmp_path: Path) -> None:
    data = build_data(spec(write(tmp_path / "t.bin", np.arange(100))), seed=0)  # 99 // 10
    assert len(data) == 9


def test_uint32_ids_are_read_as_written(tmp_path: Path) -> None:
    path = write(tmp_path / "big.bin", np.arange(70_000, 70_021), dtype="uint32")
    data = build_data(spec(path, dtype="uint32"), seed=0)
    x, _ = data.batch(np.array([1]))
    assert x.tolist() == [list(range(70_010, 70_020))] and data.meta["vocab_size"] == 70_021


def test_samples_takes_the_first_windows_and_more_than_the_file_holds_is_refused(train: Path) -> None:
    assert len(build_data(spec(train, samples=4), seed=0)) == 4
    with pytest.raises(SpecError, match=r"^field 'data.samples': .* holds 10 windows of seq_len 10, not 11"):
        build_data(spec(train, samples=11), seed=0)


def test_eval_samples_without_eval_path_holds_out_the_last_windows(train: Path) -> None:
    s = spec(train, eval_samples=3)
    data, held = build_data(s, seed=0, split="train"), build_data(s, seed=0, split="eval")
    assert has_eval(s) and len(data) == 7 and len(held) == 3
    assert held.batch(np.array([0]))[0].tolist() == [list(range(70, 80))]
    with pytest.raises(SpecError, match=r"^field 'data.eval_samples': holding out 10 of the 10 windows"):
        build_data(spec(train, eval_samples=10), seed=0)


def test_eval_path_is_evaluated_whole_or_its_first_eval_samples(train: Path, tmp_path: Path) -> None:
    val = write(tmp_path / "val.bin", np.arange(200, 241))  # 4 windows
    assert not has_eval(spec(train))
    whole = spec(train, eval_path=str(val))
    assert has_eval(whole) and len(build_data(whole, seed=0, split="eval")) == 4
    assert len(build_data(whole, seed=0, split="train")) == 10  # nothing held out of path
    first = build_data(spec(train, eval_path=str(val), eval_samples=2), seed=0, split="eval")
    assert len(first) == 2 and first.batch(np.array([1]))[1].tolist() == [list(range(211, 221))]
    assert first.meta["vocab_size"] == 241  # the largest id of either file + 1
    with pytest.raises(SpecError, match=r"^field 'data.eval_samples': .*val.bin' holds 4 windows"):
        build_data(spec(train, eval_path=str(val), eval_samples=5), seed=0, split="eval")


@pytest.mark.parametrize(
    ("make", "over", "message"),
    [
        (None, {}, r"^field 'data.path': no file at '.*missing.bin'; give the path of a flat binary file"),
        (lambda p: p.mkdir(), {}, r"^field 'data.path': .* is not a file"),
        (lambda p: p.write_bytes(b""), {}, r"^field 'data.path': .* is empty"),
        (
            lambda p: p.write_bytes(b"\0" * 11),
            {},
            r"^field 'data.dtype': .* is 11 bytes, not a whole number of uint16",
        ),
        (
            lambda p: p.write_bytes(b"\0" * 22),
            {"dtype": "uint32"},
            r"^field .data.dtype.: .* is 22 bytes, not a whole number of uint32 ids \(4 bytes each\); give "
            "data.dtype 'uint16' the file was written with",
        ),
        (
            lambda p: write(p, np.arange(10)),
            {},
            r"^field 'data.seq_len': 10 needs at least 11 tokens, and .* holds 10",
        ),
    ],
)
def test_a_file_that_cannot_be_read_as_asked_is_refused_naming_the_field(
    tmp_path: Path, make: Any, over: dict[str, Any], message: str
) -> None:
    path = tmp_path / "missing.bin"
    if make is not None:
        make(path)
    with pytest.raises(SpecError, match=message):
        build_data(spec(path, **over), seed=0)


def test_a_missing_eval_path_names_eval_path(train: Path, tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"^field 'data.eval_path': no file at"):
        build_data(spec(train, eval_path=str(tmp_path / "nope.bin")), seed=0)


def test_a_given_vocab_size_is_the_models_and_an_id_beyond_it_stops_with_the_window(train: Path) -> None:
    data = build_data(spec(train, vocab_size=95), seed=0)
    assert data.meta["vocab_size"] == 95
    data.batch(np.array([0, 8]))  # ids up to 90
    with pytest.raises(
        SpecError, match=r"^field 'data.vocab_size': window 9 of .* holds token id 100, not below 95"
    ):
        data.batch(np.array([0, 9]))


BASE = {"name": "j", "model": {"name": "tiny-gpt"}, "micro_batch_size": 2, "max_steps": 1}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"name": "token-file", "dtype": "uint16", "seq_len": 8},
            "field 'data.path': required with name 'token-file'",
        ),
        (
            {"name": "token-file", "path": "a", "seq_len": 8},
            "field 'data.dtype': required with name 'token-file'",
        ),
        (
            {"name": "token-file", "path": "a", "dtype": "uint16"},
            "field 'data.seq_len': required with name 'token-file'",
        ),
        (
            {"name": "token-file", "path": "a", "dtype": "int8", "seq_len": 8},
            "field 'data.dtype': Input should be 'uint16' or 'uint32'",
        ),
        (
            {"name": "synthetic", "path": "a"},
            "field 'data.path': belongs to name 'token-file', not to name 'synthetic'",
        ),
        (
            {"factory": "m.d:f", "seq_len": 8},
            "field 'data.seq_len': belongs to name 'token-file', not to a factory",
        ),
        ({"name": "tokens", "eval_path": "v"}, "field 'data.eval_path': belongs to name 'token-file'"),
        (
            {"name": "token-file", "path": "a", "dtype": "uint16", "seq_len": 8, "kwargs": {"x": 1}},
            "field 'data.kwargs': token-file takes no kwargs; its options are fields of data",
        ),
        ({"name": "token-file", "path": "a", "dtype": "uint16", "seq_len": 0}, "field 'data.seq_len'"),
        ({"name": "synthetic", "prefetch": 65}, "field 'data.prefetch'"),
    ],
)
def test_the_schema_refuses_bad_combinations_naming_the_field(data: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(BASE | {"data": data})
    assert message in str(info.value)


def test_the_documented_token_file_spec_is_accepted() -> None:
    raw = BASE | {"data": {"name": "token-file", "path": "/data/train.bin", "eval_path": "/data/val.bin",
                           "dtype": "uint16", "seq_len": 1024, "vocab_size": 50304}}  # fmt: skip
    assert isinstance(parse_spec(raw), JobSpec)


def text_like(count: int, vocab: int = 50_304, seed: int = 0) -> np.ndarray:
    """Ids as a tokenizer gives them: spread over the vocabulary, a few of them 0."""
    return np.random.default_rng(seed).integers(0, vocab, count)


@pytest.mark.parametrize(
    ("written", "vocab", "declared", "looks", "give"),
    [
        ("int64", 50_304, "uint16", "int64", "uint16"),  # np.array(ids).tofile, as nanoGPT reads it
        ("int64", 100_277, "uint16", "int64", "uint32"),
        ("int64", 50_304, "uint32", "int64", "uint16"),
        ("int32", 50_304, "uint16", "uint32", "uint32"),
        ("uint32", 100_277, "uint16", "uint32", "uint32"),
        ("uint16", 50_304, "uint32", "uint16", "uint16"),
    ],
)
@pytest.mark.parametrize("given_vocab", [False, True])
def test_a_file_read_with_another_width_than_written_is_refused_naming_data_dtype(
    tmp_path: Path, written: str, vocab: int, declared: str, looks: str, give: str, given_vocab: bool
) -> None:
    """int64 read as uint16 would train on 0 at three of every four places; uint16 read as
    uint32 on ids no vocabulary holds: the line says so with the dtype that fits (and how to
    write the file again when no dtype reads it), whether or not data.vocab_size is given."""
    path = write(tmp_path / "train.bin", text_like(2000, vocab), dtype=written)
    vocab_size = vocab if given_vocab else None
    with pytest.raises(SpecError) as info:
        build_data(spec(path, dtype=declared, vocab_size=vocab_size), seed=0)
    line = str(info.value)
    assert re.match(rf"^field 'data.dtype': '.*train.bin' looks written as {looks}, not {declared} \(", line)
    assert line.endswith(f"give data.dtype '{give}'") and "vocab_size" not in line, line
    if looks == "int64":
        assert f"write it again with np.array(ids, dtype=np.{give}).tofile(path)" in line, line


def test_a_held_out_file_of_another_width_is_refused_with_its_path(train: Path, tmp_path: Path) -> None:
    val = write(tmp_path / "val.bin", text_like(400), dtype="int64")
    with pytest.raises(
        SpecError, match=r"^field 'data.dtype': '.*val.bin' looks written as int64, not uint16"
    ):
        build_data(spec(train, eval_path=str(val)), seed=0, split="eval")


def test_the_width_is_read_from_the_middle_of_a_large_file_too(tmp_path: Path) -> None:
    """A file whose head is not token ids (here: zeros, as padding would be) still shows its
    width in its middle."""
    ids = np.concatenate([np.zeros(40_000, dtype=np.int64), text_like(40_000)])
    path = write(tmp_path / "train.bin", ids, dtype="int64")
    with pytest.raises(SpecError, match=r"looks written as int64, not uint16"):
        build_data(spec(path), seed=0)


@pytest.mark.parametrize(
    ("ids", "dtype"),
    [
        (text_like(2000), "uint16"),
        (text_like(2000, vocab=32), "uint16"),  # a small vocabulary: small ids at every position
        (text_like(16, vocab=4), "uint16"),  # too short to tell
        (np.arange(101), "uint16"),
        (np.arange(1000) % 50, "uint16"),
        (np.zeros(1000), "uint16"),  # all 0: no pattern to read
        (text_like(2000, vocab=100_277), "uint32"),
        (np.arange(70_000, 72_000), "uint32"),
        (text_like(2000, vocab=32), "uint32"),
    ],
)
def test_a_file_read_as_written_is_not_taken_for_another_width(ids: np.ndarray, dtype: str) -> None:
    raw = np.asarray(ids, dtype=dtype).view(np.uint8)
    assert written_as(raw, dtype) is None
    assert written_as(raw, dtype, vocab_size=int(np.max(ids)) + 1) is None

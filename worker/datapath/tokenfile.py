"""The built-in ``token-file`` dataset: a flat binary file of token ids, read through a memory map.

The format nanoGPT's ``prepare.py`` (and many other tokenizing scripts) writes: token ids one after
another, ``uint16`` or ``uint32``, little-endian, no header (``np.array(ids, np.uint16).tofile``).
Nothing is read into memory up front: ``np.memmap`` maps the file and ``batch()`` copies the few
windows a micro-batch needs, so a file larger than memory trains as well as a small one, and the
ranks of a machine share its pages.

Sample ``i`` is the window ``tokens[i*L : i*L + L + 1]`` (``L`` = ``seq_len``): its first ``L``
ids are the inputs, the ``L`` after the first one the targets (the next token at every position).
Windows do not overlap (the last token of one is the first of the next), so a file of ``n``
tokens holds ``(n - 1) // L`` samples, and a tail shorter than a window is not trained on. The
sampler indexes windows, so every window is trained exactly once per epoch, at any world size and
across restarts, as with any dataset. (nanoGPT draws random offsets instead: a sample there is
not a unit that can be counted once.)

Held-out data: ``eval_path`` (a second file in the same format: its windows, the first
``eval_samples`` of them if that is given), or else the last ``eval_samples`` windows of ``path``,
which training then does not use. ``samples`` trains on the first ``samples`` windows.
``vocab_size`` (the model's vocabulary, ``meta["vocab_size"]``): the field, or else the largest id
in the file(s) plus one, found by one pass over them when the run starts (give the field for a
large file). A window holding an id at or above a given ``vocab_size`` stops the run with a line
naming the window.

A file read with another width than it was written with is refused before anything trains,
naming ``data.dtype`` and the width its bytes show (:func:`written_as`): ``np.array(ids)``
writes int64 by default, and read as uint16 three of every four of its ids are 0, which would
otherwise train without a word.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.errors import SpecError
from worker.jobspec.spec import DataSpec

DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_SCAN_CHUNK = 1 << 24  # ids per chunk when looking for the largest one
_PROBE_BYTES = 1 << 16  # bytes read at the head and at the middle of a file to tell its width
_SMALL = 16  # an id's upper part below this: the id is below 2**20 (wider than any vocabulary's)


@dataclass
class TokenFile:
    """Windows ``first .. first + count - 1`` of a token file (see the module)."""

    tokens: np.ndarray
    seq_len: int
    first: int
    count: int
    path: str
    vocab_size: int | None = None
    """Checked against every window loaded when given by the spec (None: derived, so no id is
    out of range)."""
    task: str = "lm"
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.count

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self.count):
            raise IndexError(f"window index out of range 0..{self.count - 1}: {idx.min()}..{idx.max()}")
        span = self.seq_len + 1
        rows = np.empty((idx.size, span), dtype=np.int64)
        for row, i in enumerate(idx):
            start = (int(i) + self.first) * self.seq_len
            rows[row] = self.tokens[start : start + span]
        if self.vocab_size is not None and rows.size and int(rows.max()) >= self.vocab_size:
            bad = int(np.argmax(rows.max(axis=1) >= self.vocab_size))
            raise SpecError(
                f"field 'data.vocab_size': window {int(idx[bad]) + self.first} of {self.path!r} holds "
                f"token id {int(rows[bad].max())}, not below {self.vocab_size}; give the tokenizer's "
                "vocabulary size, or leave data.vocab_size unset to take the largest id + 1"
            )
        seq = torch.from_numpy(rows)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def open_tokens(path: str, dtype: str, *, field: str, vocab_size: int | None = None) -> np.ndarray:
    """Map a token file read-only. Raises SpecError naming ``field`` (or data.dtype) and the fix:
    data.dtype also when the file's bytes show it was written with another width
    (:func:`written_as`; ``vocab_size``, when given, is what its ids must fit)."""
    item = DTYPES[dtype].itemsize
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise SpecError(
            f"field '{field}': no file at {path!r}; give the path of a flat binary file of token "
            "ids, as the rank sees it (nanoGPT's prepare.py writes train.bin and val.bin)"
        ) from None
    except OSError as exc:
        raise SpecError(f"field '{field}': cannot read {path!r}: {exc.strerror}") from None
    if not Path(path).is_file():
        raise SpecError(f"field '{field}': {path!r} is not a file; give a flat binary file of token ids")
    if size == 0:
        raise SpecError(f"field '{field}': {path!r} is empty; it holds no token ids")
    if size % item:
        fix = "give data.dtype 'uint16'" if dtype == "uint32" and size % 2 == 0 else "give the dtype"
        raise SpecError(
            f"field 'data.dtype': {path!r} is {size} bytes, not a whole number of {dtype} ids "
            f"({item} bytes each); {fix} the file was written with"
        )
    try:
        tokens = np.memmap(path, dtype=DTYPES[dtype], mode="r")
    except (OSError, ValueError) as exc:
        raise SpecError(f"field '{field}': cannot map {path!r}: {exc}") from None
    raw = tokens.view(np.uint8)
    for at in _probe_offsets(size):  # each on its own: a head of padding says nothing
        probe = np.array(raw[at : at + _PROBE_BYTES])
        written = written_as(probe, dtype, vocab_size=vocab_size)
        if written is not None:
            raise SpecError(dtype_refusal(path, dtype, written, probe))
    return tokens


def _probe_offsets(size: int) -> tuple[int, ...]:
    """Where the probes read: the head, and the middle (on an 8-byte boundary, so that ids of any
    width start where the probe starts) when the file is larger than two probes."""
    middle = (size // 2) // 8 * 8
    return (0, middle) if size > 2 * _PROBE_BYTES else (0,)


def written_as(raw: np.ndarray, declared: str, *, vocab_size: int | None = None) -> str | None:
    """The dtype the bytes ``raw`` (a file's bytes from an 8-byte boundary) were written with when
    their pattern says it is not ``declared``: ``"int64"`` or ``"uint32"`` for a file of wider ids
    read narrow, ``"uint16"`` for uint16 ids read as uint32; None when they agree or the sample
    cannot tell. Pure.

    Wider ids read narrow leave their upper parts as ids of their own: every second (uint32
    read as uint16) or second to fourth (int64) id is 0, or below 16 for ids up to 2**20, while
    the ids between them are not. A stream of real token ids is the same at every position, so
    such a pattern over 8 groups (all 0) or 64 groups (all small) is not a coincidence. uint16
    ids read as uint32 pair up into ids of 2**20 and more (an upper id of 16 or more), which no
    vocabulary holds, while read as uint16 they fit ``vocab_size`` (when given)."""
    width = DTYPES[declared].itemsize
    whole = raw[: len(raw) // 8 * 8]
    ids = whole.view(DTYPES[declared])
    for wider, name in ((8, "int64"), (4, "uint32")):
        if wider > width and _upper_parts_alone(ids.reshape(-1, wider // width)):
            return name
    if declared == "uint32" and len(ids) >= 8:
        large = int(np.count_nonzero(ids >= _SMALL << 16))
        narrow = whole.view(DTYPES["uint16"])
        if 2 * large >= len(ids) and (vocab_size is None or int(narrow.max()) < vocab_size):
            return "uint16"
    return None


def _upper_parts_alone(groups: np.ndarray) -> bool:
    """Whether column 0 holds ids and the other columns only the zero (or small) upper parts of
    wider ones (see :func:`written_as`)."""
    count = len(groups)
    if count < 8:
        return False
    lower, upper = groups[:, 0], groups[:, 1:]
    if not upper.any():
        return 2 * int(np.count_nonzero(lower)) >= count
    return count >= 64 and int(upper.max()) < _SMALL and 2 * int(np.count_nonzero(lower >= _SMALL)) >= count


def dtype_refusal(path: str, declared: str, written: str, raw: np.ndarray) -> str:
    """The line refusing a file read as ``declared`` that was written as ``written``: names
    data.dtype and the fix (a dtype to give, or how to write the file again)."""
    head = f"field 'data.dtype': {path!r} looks written as {written}, not {declared}"
    if written == "uint16":
        why = "read as uint32, its ids pair up into numbers no vocabulary holds"
        return f"{head} ({why}); give data.dtype 'uint16'"
    if written == "uint32":
        why = "every second uint16 id read from it is 0: 4-byte ids, uint32 or int32"
        return f"{head} ({why}); give data.dtype 'uint32'"
    largest = int(raw[: len(raw) // 8 * 8].view("<i8").max(initial=0))
    fits = "uint16" if largest < 1 << 16 else "uint32"
    zeros = (
        "three of every four uint16 ids read from it are"
        if declared == "uint16"
        else "every second uint32 id read from it is"
    )
    return (
        f"{head} ({zeros} 0: 8-byte ids, numpy's default for np.array(ids)); "
        f"token files hold uint16 or uint32 ids: write it again with "
        f"np.array(ids, dtype=np.{fits}).tofile(path) and give data.dtype '{fits}'"
    )


def windows_in(tokens: np.ndarray, seq_len: int, *, field: str, path: str) -> int:
    """How many windows of ``seq_len`` a file holds; SpecError on data.seq_len when none fit."""
    count = (len(tokens) - 1) // seq_len
    if count < 1:
        raise SpecError(
            f"field 'data.seq_len': {seq_len} needs at least {seq_len + 1} tokens, and {path!r} "
            f"({field}) holds {len(tokens)}; give a smaller seq_len or a longer file"
        )
    return count


@functools.lru_cache(maxsize=8)
def _largest_id(path: str, dtype: str, size: int, mtime_ns: int) -> int:
    tokens = np.memmap(path, dtype=DTYPES[dtype], mode="r")
    return max(int(tokens[i : i + _SCAN_CHUNK].max()) for i in range(0, len(tokens), _SCAN_CHUNK))


def largest_id(path: str, dtype: str) -> int:
    """The largest token id in a file (one pass; cached for the file as it is now)."""
    st = os.stat(path)
    return _largest_id(path, dtype, st.st_size, st.st_mtime_ns)


def token_file(spec: DataSpec, split: str) -> TokenFile:
    """The ``split`` ("train" or "eval") of a token-file spec. Raises SpecError naming the field."""
    assert spec.path is not None and spec.dtype is not None and spec.seq_len is not None  # the schema
    seq_len, dtype = spec.seq_len, spec.dtype
    tokens = open_tokens(spec.path, dtype, field="data.path", vocab_size=spec.vocab_size)
    total = windows_in(tokens, seq_len, field="data.path", path=spec.path)
    held_out = spec.eval_samples if spec.eval_path is None else 0
    if held_out >= total:
        raise SpecError(
            f"field 'data.eval_samples': holding out {held_out} of the {total} windows of "
            f"{spec.path!r} (seq_len {seq_len}) leaves none to train on; give fewer, or an eval_path"
        )
    trainable = total - held_out
    if spec.samples is not None and spec.samples > trainable:
        raise SpecError(
            f"field 'data.samples': {spec.path!r} holds {trainable} windows of seq_len {seq_len}"
            + (f" besides the {held_out} held out" if held_out else "")
            + f", not {spec.samples}; give at most {trainable}, or leave it unset to train on all"
        )
    eval_tokens = (
        open_tokens(spec.eval_path, dtype, field="data.eval_path", vocab_size=spec.vocab_size)
        if spec.eval_path
        else None
    )
    vocab = spec.vocab_size
    if vocab is None:
        vocab = 1 + max(largest_id(p, dtype) for p in (spec.path, spec.eval_path) if p is not None)
    meta = {"vocab_size": vocab, "seq_len": seq_len, "task": "lm"}
    checked = spec.vocab_size  # a derived vocabulary holds every id
    if split == "train":
        count = spec.samples if spec.samples is not None else trainable
        return TokenFile(tokens, seq_len, 0, count, spec.path, checked, meta=meta)
    if eval_tokens is None:
        return TokenFile(tokens, seq_len, trainable, held_out, spec.path, checked, meta=meta)
    assert spec.eval_path is not None
    available = windows_in(eval_tokens, seq_len, field="data.eval_path", path=spec.eval_path)
    if spec.eval_samples > available:
        raise SpecError(
            f"field 'data.eval_samples': {spec.eval_path!r} holds {available} windows of seq_len "
            f"{seq_len}, not {spec.eval_samples}; give at most {available}, or 0 for all of them"
        )
    count = spec.eval_samples or available
    return TokenFile(eval_tokens, seq_len, 0, count, spec.eval_path, checked, meta=meta)

"""The checkpoint manifest: what a published step directory holds, as plain dataclasses.

Torch-free and pure (the control plane imports it): the values in :mod:`.model`, the layout
rules in :mod:`.rules`, the JSON form in :mod:`.codec`; import everything from this package.
``manifest.json`` is plain JSON: nothing on the load path unpickles or evaluates anything.
:func:`manifest_from_json` refuses anything that is not exactly the schema below, so a crafted
manifest fails with :class:`CorruptCheckpointError` instead of reaching the readers.

Layout rules the validator enforces:

* a tensor's logical bytes are its rows (dim-0 slices, C order) concatenated; a 0-d tensor has
  one row. A piece holds rows ``[start, stop)`` of one tensor at ``offset`` in one file;
* the pieces of a ``replicated`` or ``sharded`` tensor tile ``[0, rows)`` exactly; a
  ``per_rank`` tensor (state only its ``owner`` rank uses) has one piece with all rows;
* the pieces in a file tile ``[0, size)`` exactly, so every byte of every file is covered;
* ``aliases`` maps a tensor name to the stored tensor it is (a tied or shared parameter, e.g.
  GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``): stored once, under the first name
  in the model's state dict; written only when there is one, so manifests of models without
  ties are what older versions wrote, and a manifest without the table has no ties;
* ``digests[i]`` is the xxh3-128 hex digest of bytes ``[i*block_size, (i+1)*block_size)`` of the
  piece; a file's ``digest`` is :func:`worker.checkpoint.blocks.file_digest` of its blocks.

Limits (a manifest is untrusted input): the text is parsed by
:func:`worker.jobspec.jsonlimits.loads` (nested at most :data:`MAX_DEPTH` levels: a run record holds
a job spec, which the API admits 64 levels deep);
integers are below 2**63, a shape has at most :data:`MAX_NDIM` dimensions and ``block_size`` is at
most :data:`MAX_BLOCK_SIZE`, so no number here sizes a read or a buffer beyond that before the
files are checked. The size cap and the check against the files on disk belong to the reader
(:func:`worker.checkpoint.layout.load_manifest`); :func:`manifest_cap` is its rule, and a writer
never publishes a manifest that :func:`check_readable` says a reader would refuse.
"""

from __future__ import annotations

from worker.checkpoint.manifest.codec import manifest_from_json, manifest_to_dict, manifest_to_json
from worker.checkpoint.manifest.model import (
    FORMAT_VERSION,
    ITEMSIZE,
    KINDS,
    MANIFEST_BASE_BYTES,
    MANIFEST_NAME,
    MAX_BLOCK_SIZE,
    MAX_DEPTH,
    MAX_NDIM,
    FileEntry,
    Kind,
    Manifest,
    Piece,
    Shaped,
    TensorEntry,
    block_count,
    manifest_cap,
    row_bytes,
)
from worker.checkpoint.manifest.rules import check_readable, validate

__all__ = [
    "FORMAT_VERSION",
    "ITEMSIZE",
    "KINDS",
    "MANIFEST_BASE_BYTES",
    "MANIFEST_NAME",
    "MAX_BLOCK_SIZE",
    "MAX_DEPTH",
    "MAX_NDIM",
    "FileEntry",
    "Kind",
    "Manifest",
    "Piece",
    "Shaped",
    "TensorEntry",
    "block_count",
    "check_readable",
    "manifest_cap",
    "manifest_from_json",
    "manifest_to_dict",
    "manifest_to_json",
    "row_bytes",
    "validate",
]

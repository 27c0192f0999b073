"""The README's JobSpec reference, generated from the schema: every field once, with its type
and bounds and its default as the pydantic models (``worker.jobspec.spec.JobSpec``) declare them, and
what it does.

``python -m scripts.jobspec_table`` prints the table; ``--write`` puts it into README.md between
:data:`BEGIN` and :data:`END`. ``tests/unit/test_jobspec_table.py`` fails when the README's table
and the schema disagree, when a field has no description, or when a description names a field
the schema does not have.

A field's description is the schema's own (``Field(description=...)``, which ``/openapi.json``
publishes too) or, for fields without one, :data:`DESCRIPTIONS` below; never both.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[1] / "README.md"
BEGIN = "<!-- jobspec-table:begin (generated: python -m scripts.jobspec_table --write) -->"
END = "<!-- jobspec-table:end -->"

DESCRIPTIONS: dict[str, str] = {
    "name": "The job's name (a DNS label); without the service it is the job's identity, "
    "the owner of its checkpoint directory.",
    "model.name": "A built-in model.",
    "model.factory": "`package.module:function`, called as `fn(meta, **kwargs)` on every rank; returns a "
    "`torch.nn.Module` built on CPU in fp32 (see [Your own model](#your-own-model-and-data)).",
    "model.kwargs": "Keyword arguments of the factory or the built-in (scalars only; the built-ins take "
    "`dropout`).",
    "data.name": "A built-in dataset: generated `synthetic` (regression) or `tokens` (a language model's), "
    "or `token-file` (a flat binary file of token ids, see [A token file](#a-token-file)).",
    "data.factory": "`package.module:function`, called as `fn(samples=, seed=, split=, **kwargs)`.",
    "data.version": "Your data's version, recorded in every checkpoint.",
    "data.kwargs": "Keyword arguments of the factory or the built-in (scalars only).",
    "data.path": "token-file: the file of token ids (required with `token-file`).",
    "data.eval_path": "token-file: a held-out file in the same format.",
    "data.dtype": "token-file: the ids' type as the file was written (required with `token-file`).",
    "data.seq_len": "token-file: tokens per sample (required with `token-file`).",
    "loss.factory": "`package.module:function`, called as `fn(output, targets, **kwargs)` on every "
    "micro-batch, outside autocast; returns one loss per sample.",
    "loss.kwargs": "Keyword arguments of the loss (scalars only).",
    "precision": "Autocast dtype of the forward; master weights and optimizer state stay fp32; fp16 uses "
    "dynamic loss scaling.",
    "micro_batch_size": "Samples per rank per micro-step.",
    "grad_accum_steps": "Micro-steps per optimizer step (A); unset: 1, or derived from "
    "`global_batch_size`. Give at most one of the two.",
    "global_batch_size": "Samples per step over all ranks, kept across world sizes by changing A where it "
    "divides (else `lr_scaling` applies).",
    "max_steps": "Successful optimizer steps to train (a skipped non-finite step does not count).",
    "seed": "The global seed: model initialisation, sampler order, every rank's generators.",
    "deterministic": "Deterministic algorithms (torch, cuDNN, cuBLAS): resume is bit for bit at the same "
    "world size.",
    "parallelism": "`ddp`: replicated state; `fsdp`: FSDP2, parameters and optimizer state sharded.",
    "optimizer": "The optimizer.",
    "optimizer.name": "AdamW or SGD.",
    "optimizer.lr": "The learning rate (at `lr_reference_batch_size`, or the first run's global batch).",
    "optimizer.weight_decay": "Weight decay (decoupled for AdamW).",
    "optimizer.betas": "AdamW's betas.",
    "optimizer.momentum": "SGD's momentum.",
    "optimizer.grad_clip_norm": "Clip the global gradient norm to this, after unscaling (null: no clipping).",
    "lr_schedule.warmup_samples": "Linear warm-up over this many samples.",
    "lr_schedule.decay": "The decay after warm-up.",
    "lr_schedule.decay_samples": "Samples over which the LR decays (unset: the run's total).",
    "lr_schedule.min_lr_ratio": "The decayed LR's floor, as a fraction of `lr`.",
    "lr_scaling": "How the LR follows a global batch that cannot be kept at a new world size.",
    "lr_reference_batch_size": "The global batch `optimizer.lr` is meant for (unset: the first run's).",
    "loss_scale.init_scale": "The starting scale.",
    "loss_scale.growth_factor": "Multiplies the scale after `growth_interval` good steps.",
    "loss_scale.backoff_factor": "Multiplies the scale after a non-finite step (which is skipped).",
    "loss_scale.growth_interval": "Good steps before the scale grows.",
    "loss_scale.min_scale": "The scale never goes below this.",
    "ddp": "The process group and DDP.",
    "ddp.backend": "`auto`: NCCL when each process of the node has a GPU of its own, else gloo on CPU "
    "(the run record's `notes` say why). `nccl` without a GPU per process: exit 2 naming the field.",
    "ddp.bucket_cap_mb": "DDP's gradient bucket size in MB.",
    "monitor.every_steps": "Gradient statistics (zero fraction, smallest non-zero magnitude) every this "
    "many steps; one measurement costs about a sixth of a small model's step on CPU.",
    "monitor.stale_after_steps": "A parameter whose gradient is zero or absent this many steps is reported.",
    "monitor.time_communication": "Time the exposed gradient communication with a DDP comm hook (costs "
    "about 5-10% of throughput on CPU).",
    "checkpoint": "Checkpoints (see [docs/checkpoints.md](docs/checkpoints.md)).",
    "checkpoint.dir": "The job's checkpoint directory (under the service: inside its storage root; unset "
    "there: `<root>/<job id>`). Unset under torchrun: no checkpoints.",
    "checkpoint.interval_steps": "Save every this many steps (give at most one interval).",
    "checkpoint.interval_seconds": "Save every this many seconds.",
    "checkpoint.interval": "`auto`: Young/Daly, sqrt(2 x save cost x MTBF), from the measured save cost.",
    "checkpoint.mtbf_seconds": "The mean time between failures for `interval: auto` (unset: observed from "
    "the run's restarts, else 24 h).",
    "checkpoint.async": "Save in the background: training waits only for the snapshot's copy.",
    "checkpoint.resume": "`auto`: the newest verified step of `dir`, else a fresh start; `never`: start "
    "over; or a local path: start from that step or job directory (read only; later restarts resume the "
    "job's own newer steps; under the service a relative path is inside the job's directory).",
    "checkpoint.retention": "Which published steps are kept; the newest verified one never goes.",
    "checkpoint.retention.keep_latest": "The newest K steps (at least 2).",
    "checkpoint.retention.milestone_every_steps": "Also keep every step that is a multiple of this.",
    "checkpoint.retention.keep_best": "Also keep the best K by `best_metric`.",
    "checkpoint.retention.best_metric": "The metric `keep_best` ranks by.",
    "checkpoint.retention.best_mode": "Whether lower or higher is better.",
    "checkpoint.retention.pinned_steps": "Steps never deleted.",
    "eval": "Evaluation on held-out data.",
    "eval.every_steps": "Evaluate every this many steps (also at the end when there is held-out data).",
    "integrity": "Data-parallel replicas compare a digest of their state; a silent corruption is "
    "named and trained away from the newest checkpoint they agreed on (see "
    "[docs/recovery.md](docs/recovery.md#silent-corruption-replicas-compare-their-state)).",
    "log_every_steps": "A `progress` event and a readable line every this many steps.",
    "recovery": "How a lost rank is recovered (see [docs/recovery.md](docs/recovery.md)).",
    "preemption": "A SIGTERM (a node drain, a spot reclaim, a cancel) is a graceful stop: every rank stops "
    "at the same step, the group saves it, the processes exit (see "
    "[docs/recovery.md](docs/recovery.md#preemption-a-sigterm-is-a-graceful-stop)).",
    "stragglers": "Each rank's compute time per step is compared with the others' once per window; a rank "
    "that stays slower is named (see [docs/recovery.md](docs/recovery.md#stragglers-a-slow-rank-is-named)).",
    "nodes": "Under the service: nodes (torchrun agents), `N` or `MIN:MAX`; scaling stays within it.",
    "initial_nodes": "Nodes launched first (unset: the maximum).",
    "nproc_per_node": "Processes (ranks) per node.",
    "max_restarts": "Restarts of the workers (restart mode) before the job fails.",
    "resources": 'Per node, e.g. `{"cpu": "4", "gpu": "1", "memory": "16Gi"}` (also `memMB`, '
    "`instance_type`); checked at submit. Empty: no limit.",
}


@dataclass(frozen=True, slots=True)
class Field:
    """One row: a field's dotted path, type and bounds, default and description."""

    path: str
    type: str
    default: str
    description: str
    in_schema: bool = False
    """Whether the description is the schema's own."""

    def row(self) -> str:
        cells = (f"`{self.path}`", self.type, self.default, self.description)
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _num(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, int) and v >= 1 << 16:
        for base, name in ((2, "2"), (10, "10")):
            k, n = 0, v
            while n % base == 0 and n > 1:
                n, k = n // base, k + 1
            if n == 1:
                return f"{name}^{k}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def _bounds(s: dict[str, Any]) -> str:
    parts = []
    for key, sign in (
        ("minimum", ">="),
        ("exclusiveMinimum", ">"),
        ("maximum", "<="),
        ("exclusiveMaximum", "<"),
    ):
        if key in s:
            parts.append(f"{sign} {_num(s[key])}")
    for key, what in (("maxLength", "characters"), ("maxItems", "items"), ("maxProperties", "keys")):
        if key in s and not (key == "maxItems" and s.get("minItems") == s[key]):
            parts.append(f"at most {_num(s[key])} {what}")
    return ", ".join(parts)


def type_of(s: dict[str, Any]) -> str:
    """A schema's type in a few words, with its bounds. Pure."""
    if "anyOf" in s:
        kinds = [k for k in s["anyOf"] if k.get("type") != "null"]
        text = " or ".join(type_of(k) for k in kinds)
        return text + (" or null" if len(kinds) < len(s["anyOf"]) else "")
    if "enum" in s:
        return " | ".join(f"`{json.dumps(v)}`" for v in s["enum"])
    kind = s.get("type", "any")
    if kind == "array" and "prefixItems" in s:
        kind = f"[{', '.join(type_of(i) for i in s['prefixItems'])}]"
    elif kind == "array":
        kind = f"list of {type_of(s.get('items', {}))}"
    elif kind == "object" and "additionalProperties" in s:
        kind = f"map of {type_of(s['additionalProperties'])}"
    bounds = _bounds(s)
    return f"{kind} ({bounds})" if bounds else kind


def _default(name: str, prop: dict[str, Any], model: Any, required: bool) -> str:
    if required:
        return "required"
    if "default" in prop:
        return f"`{json.dumps(prop['default'])}`"
    info = next(f for n, f in model.model_fields.items() if (f.alias or n) == name)
    if info.default_factory is not None:
        return f"`{json.dumps(info.default_factory())}`"  # type: ignore[call-arg]
    return "unset"


def _ref(prop: dict[str, Any]) -> str | None:
    for s in (prop, *prop.get("anyOf", ())):
        if "$ref" in s:
            return str(s["$ref"]).rsplit("/", 1)[-1]
    return None


def fields() -> Iterator[Field]:
    """Every field of the JobSpec, depth first, as the schema declares it."""
    from worker.jobspec.spec import JobSpec

    schema = JobSpec.model_json_schema(by_alias=True)
    defs = schema.get("$defs", {})
    models = {cls.__name__: cls for cls in _models(JobSpec)}
    yield from _walk(schema, JobSpec, "", defs, models)


def _models(root: Any) -> Iterator[Any]:
    seen = set()
    todo = [root]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        yield cls
        for info in cls.model_fields.values():
            for arg in _args(info.annotation):
                if isinstance(arg, type) and hasattr(arg, "model_fields"):
                    todo.append(arg)


def _args(annotation: Any) -> Iterator[Any]:
    yield annotation
    for arg in getattr(annotation, "__args__", ()):
        yield from _args(arg)


def _walk(
    schema: dict[str, Any], model: Any, prefix: str, defs: dict[str, Any], models: dict[str, Any]
) -> Iterator[Field]:
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        path = prefix + name
        ref = _ref(prop)
        if ref is not None:
            nested = defs[ref]
            kind = "object or null" if "anyOf" in prop else "object"
            default = "required" if name in required else ("unset" if "anyOf" in prop else "see its fields")
            own = bool(prop.get("description") or nested.get("description"))
            yield Field(path, kind, default, describe(path, prop) or describe(path, nested), own)
            yield from _walk(nested, models[ref], path + ".", defs, models)
            continue
        default = _default(name, prop, model, name in required)
        yield Field(path, type_of(prop), default, describe(path, prop), bool(prop.get("description")))


def describe(path: str, prop: dict[str, Any]) -> str:
    text = str(prop.get("description") or DESCRIPTIONS.get(path, ""))
    return " ".join(text.replace("``", "`").split())


def table() -> str:
    """The markdown table. Pure but for importing the schema."""
    head = ["| field | type | default | what it does |", "| --- | --- | --- | --- |"]
    return "\n".join(head + [f.row() for f in fields()])


def replace(document: str, block: str) -> str:
    """``document`` with the text between :data:`BEGIN` and :data:`END` replaced. Pure."""
    head, rest = document.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def current(document: str) -> str:
    """The table between the markers of ``document``. Pure."""
    return document.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the table in {README.name}")
    args = parser.parse_args(argv)
    if args.write:
        README.write_text(replace(README.read_text(encoding="utf-8"), table()), encoding="utf-8")
    else:
        print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The JobSpec: one schema for a training job, used by the REST API, the CLI and the worker.

Torch-free on purpose: the service imports it. Every model is frozen and refuses unknown
fields; types are strict (``"8"`` is not a batch size). ``load_spec`` turns a validation
failure into a :class:`SpecError` whose message names the field and what would fix it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from worker.errors import SpecError
from worker.jobspec.integrity import IntegritySpec
from worker.jobspec.limits import (
    IMAGE_RE,
    MAX_ACCUM,
    MAX_ENV,
    MAX_GLOBAL_BATCH,
    MAX_IMAGE,
    MAX_KWARGS,
    MAX_MICRO_BATCH,
    MAX_NODES,
    MAX_SAMPLES,
    MAX_STEPS,
    MAX_TEXT,
    Frozen,
    check_env_name,
)
from worker.jobspec.paths import check_env_value, check_local_path, check_location, check_resume
from worker.jobspec.preemption import PreemptionSpec
from worker.jobspec.recovery import MAX_SPARES, RecoverySpec
from worker.jobspec.stragglers import StragglerSpec

_FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_NODES_RE = re.compile(r"^([0-9]{1,18})(?::([0-9]{1,18}))?$")  # ASCII digits: int() takes any script's

Steps = Annotated[int, Field(gt=0, le=MAX_STEPS)]
Text = Annotated[str, Field(max_length=MAX_TEXT)]


def _one_scalar(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A kwargs value: one error that says what is allowed, instead of one per union branch."""
    try:
        return handler(value)
    except ValidationError:
        if isinstance(value, str):
            raise PydanticCustomError(
                "string_too_long", "give at most {limit} characters", {"limit": MAX_TEXT}
            ) from None
        kind = {dict: "an object", list: "a list", type(None): "null"}.get(type(value), type(value).__name__)
        raise PydanticCustomError(
            "scalar_type",
            "values must be scalars (a string, a number, true or false), not {kind}; "
            "pass nested options as separate flat keys, or build them inside your factory",
            {"kind": kind},
        ) from None


Scalar = Annotated[
    Annotated[str, Field(max_length=MAX_TEXT)] | int | float | bool, WrapValidator(_one_scalar)
]
Kwargs = Annotated[dict[Annotated[str, Field(max_length=100)], Scalar], Field(max_length=MAX_KWARGS)]


def _one_output(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError(
            "output_choice",
            "give 'auto', 'logits', 'loss', the name of a key or attribute of the model's output "
            "(1-100 characters), or an index into a tuple (0-1024)",
        ) from None


OutputChoice = Annotated[
    Annotated[int, Field(ge=0, le=1024)] | Annotated[str, Field(min_length=1, max_length=100)],
    WrapValidator(_one_output),
]


_Frozen = Frozen


def _check_path(value: str | None) -> str | None:
    return None if value is None else check_local_path(value)


def _check_dir(value: str | None) -> str | None:
    return check_location(value, field="checkpoint.dir")


def _check_factory(value: str | None) -> str | None:
    if value is not None and not _FACTORY_RE.match(value):
        raise ValueError(f"{value!r} is not of the form 'package.module:function'")
    return value


class ModelSpec(_Frozen):
    """Which network to train: a built-in by ``name`` or user code by ``factory``."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        json_schema_extra={"oneOf": [{"required": ["name"]}, {"required": ["factory"]}]},
    )

    name: Literal["mlp", "tiny-gpt"] | None = None
    factory: Text | None = None
    kwargs: Kwargs = Field(default_factory=dict)
    output: OutputChoice = Field(
        default="auto",
        description=(
            "Which part of the forward's output the worker uses: 'auto' (a tensor as is; else its "
            "'logits' key or attribute, else its first element; with a 'loss' factory the output "
            "unchanged), 'logits', 'loss' (per-sample losses the model computed: no loss function "
            "is applied), another key or attribute name, or an index into a tuple."
        ),
    )

    _factory = field_validator("factory")(_check_factory)

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.name is None) == (self.factory is None):
            raise ValueError("give exactly one of 'name' (mlp, tiny-gpt) or 'factory'")
        return self


TOKEN_FILE_FIELDS = ("path", "eval_path", "dtype", "seq_len", "vocab_size")
"""The fields of the built-in ``token-file`` dataset (refused with any other data)."""
_TOKEN_FILE_REQUIRED = {
    "path": "the flat binary file of token ids to train on (as nanoGPT's prepare.py writes train.bin)",
    "dtype": "'uint16' (ids below 65536, nanoGPT's format) or 'uint32', as the file was written",
    "seq_len": "the tokens per sample (a sample is seq_len inputs and the next seq_len targets)",
}


class DataSpec(_Frozen):
    """Which data: a built-in by ``name`` (generated sets, or ``token-file``: a flat binary file of
    token ids read through a memory map) or user code by ``factory``."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        json_schema_extra={"oneOf": [{"required": ["name"]}, {"required": ["factory"]}]},
    )

    name: Literal["synthetic", "tokens", "token-file"] | None = None
    factory: Text | None = None
    samples: Annotated[int, Field(gt=0, le=MAX_SAMPLES)] | None = Field(
        default=None,
        description="Training samples; unset: the dataset's own length (the generated built-ins make "
        "4096, token-file every window of its file; a factory gets samples=None). token-file: its "
        "first `samples` windows.",
    )
    eval_samples: int = Field(
        default=0,
        ge=0,
        le=MAX_SAMPLES,
        description="Held-out samples (0: none). token-file: the last eval_samples windows of `path` "
        "are held out of training, or with eval_path at most this many of its windows (0: all).",
    )
    version: str = Field(default="1", max_length=200)
    kwargs: Kwargs = Field(default_factory=dict)
    prefetch: int | None = Field(
        default=None,
        ge=0,
        le=64,
        description="Micro-batches loaded ahead of the step on a background thread, in the sampler's "
        "order; 0: on the training thread, between micro-steps; unset: 4 ahead on a GPU or when a "
        "batch() takes 1 ms or more, else 0. Results do not depend on it.",
    )
    path: str | None = Field(default=None, validate_default=True, min_length=1, max_length=4096)
    eval_path: str | None = Field(default=None, validate_default=True, min_length=1, max_length=4096)
    dtype: Literal["uint16", "uint32"] | None = Field(default=None, validate_default=True)
    seq_len: int | None = Field(default=None, validate_default=True, gt=0, le=2**24)
    vocab_size: int | None = Field(
        default=None, validate_default=True, gt=0, le=2**32,
        description="token-file: the model's vocabulary; unset: the largest id in the files + 1.",
    )  # fmt: skip

    _factory = field_validator("factory")(_check_factory)
    _paths = field_validator("path", "eval_path")(_check_path)

    @field_validator(*TOKEN_FILE_FIELDS)
    @classmethod
    def _token_file_field(cls, value: Any, info: ValidationInfo) -> Any:
        """token-file's fields go with name 'token-file' and no other data; three are required."""
        if "name" not in info.data:
            return value  # the name itself is wrong: that error is the one to read
        token_file = info.data["name"] == "token-file"
        field = str(info.field_name)
        if token_file and value is None and field in _TOKEN_FILE_REQUIRED:
            raise ValueError(f"required with name 'token-file': {_TOKEN_FILE_REQUIRED[field]}")
        if not token_file and value is not None:
            used = f"name {info.data['name']!r}" if info.data["name"] else "a factory (use data.kwargs)"
            raise ValueError(f"belongs to name 'token-file', not to {used}; remove it")
        return value

    @field_validator("kwargs")
    @classmethod
    def _token_file_kwargs(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if value and info.data.get("name") == "token-file":
            raise ValueError(
                "token-file takes no kwargs; its options are fields of data: " + ", ".join(TOKEN_FILE_FIELDS)
            )
        return value

    @model_validator(mode="after")
    def _one_source(self) -> DataSpec:
        if (self.name is None) == (self.factory is None):
            raise ValueError("give exactly one of 'name' (synthetic, tokens, token-file) or 'factory'")
        return self


class LossSpec(_Frozen):
    """A user loss, called as ``factory(output, targets, **kwargs)`` on every micro-batch; it
    returns one loss per sample (a tensor whose first dimension is the micro-batch)."""

    factory: Text
    kwargs: Kwargs = Field(default_factory=dict)

    _factory = field_validator("factory")(_check_factory)


class OptimizerSpec(_Frozen):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(default=1e-3, gt=0, le=1e6)
    weight_decay: float = Field(default=0.0, ge=0, le=1e6)
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    momentum: float = Field(default=0.0, ge=0, lt=1)
    grad_clip_norm: float | None = Field(default=1.0, gt=0, le=1e12)


class LRScheduleSpec(_Frozen):
    """An LR schedule keyed by samples seen, never by local steps."""

    warmup_samples: int = Field(default=0, ge=0, le=1 << 62)
    decay: Literal["constant", "linear", "cosine"] = "constant"
    decay_samples: int | None = Field(default=None, gt=0, le=1 << 62)
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)


class LossScaleSpec(_Frozen):
    """Dynamic loss scaling for fp16 (ignored for fp32 and bf16)."""

    init_scale: float = Field(default=2.0**16, gt=0, le=2.0**64)
    growth_factor: float = Field(default=2.0, gt=1, le=1e3)
    backoff_factor: float = Field(default=0.5, gt=0, lt=1)
    growth_interval: Steps = 2000
    min_scale: float = Field(default=1.0, gt=0, le=2.0**64)


class DDPSpec(_Frozen):
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    bucket_cap_mb: float = Field(default=25.0, gt=0, le=65536)


class MonitorSpec(_Frozen):
    """Underflow watch: how often to measure, and when a parameter counts as stale."""

    # Gradient statistics (zero fraction, smallest non-zero magnitude) every 100 steps, as often
    # as Lightning's default logging: one measurement costs about a sixth of a step of the
    # benchmark MLP on CPU (about 2 ms of 13), so every 10 steps cost ~1.5% of samples/s
    # (benchmarks/worker_segments.py: 0.972 against 0.986 every 100).
    every_steps: Steps = 100
    stale_after_steps: Steps = 100
    # Exposed gradient communication, timed by a DDP comm hook (Python futures on every bucket):
    # off by default because it cost about 5-10% of samples/s on CPU/gloo in benchmarks/.
    time_communication: bool = False


class RetentionSpec(_Frozen):
    # At least two: the newest may still be in flight when a failure hits.
    keep_latest: int = Field(default=3, ge=2, le=10_000)
    milestone_every_steps: int | None = Field(default=None, gt=0, le=MAX_STEPS)
    keep_best: int = Field(default=0, ge=0, le=10_000)
    best_metric: str = Field(default="loss", max_length=100)
    best_mode: Literal["min", "max"] = "min"
    pinned_steps: tuple[Annotated[int, Field(ge=0, le=MAX_STEPS)], ...] = Field(default=(), max_length=1000)


class CheckpointSpec(_Frozen):
    dir: Text | None = None
    interval_steps: int | None = Field(default=None, gt=0, le=MAX_STEPS)
    interval_seconds: float | None = Field(default=None, gt=0, le=1e7)
    interval: Literal["fixed", "auto"] = "fixed"
    mtbf_seconds: float | None = Field(default=None, gt=0, le=1e9)
    async_save: bool = Field(default=False, alias="async")
    resume: Text = "auto"
    retention: RetentionSpec = Field(default_factory=RetentionSpec)

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True)

    _dir = field_validator("dir")(_check_dir)
    _resume = field_validator("resume")(check_resume)

    @model_validator(mode="after")
    def _one_interval(self) -> CheckpointSpec:
        if self.interval_steps is not None and self.interval_seconds is not None:
            raise ValueError("give at most one of 'interval_steps' or 'interval_seconds'")
        return self


class EvalSpec(_Frozen):
    every_steps: int | None = Field(default=None, gt=0, le=MAX_STEPS)


class JobSpec(_Frozen):
    """A training job. The worker reads the fields it needs; the service also uses
    ``nodes``, ``nproc_per_node``, ``max_restarts`` and ``resources``."""

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
    model: ModelSpec
    data: DataSpec
    loss: LossSpec | None = None
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    micro_batch_size: int = Field(gt=0, le=MAX_MICRO_BATCH)
    grad_accum_steps: int | None = Field(default=None, gt=0, le=MAX_ACCUM)
    global_batch_size: int | None = Field(default=None, gt=0, le=MAX_GLOBAL_BATCH)
    max_steps: Steps
    seed: int = Field(default=0, ge=0, lt=2**32)
    deterministic: bool = False
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    lr_schedule: LRScheduleSpec = Field(default_factory=LRScheduleSpec)
    lr_scaling: Literal["linear", "sqrt", "none"] = "linear"
    lr_reference_batch_size: int | None = Field(default=None, gt=0, le=MAX_GLOBAL_BATCH)
    loss_scale: LossScaleSpec = Field(default_factory=LossScaleSpec)
    ddp: DDPSpec = Field(default_factory=DDPSpec)
    monitor: MonitorSpec = Field(default_factory=MonitorSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    integrity: IntegritySpec = Field(default_factory=IntegritySpec)
    log_every_steps: Steps = 10
    stragglers: StragglerSpec = Field(default_factory=StragglerSpec)
    # Fields for the control plane; a bare torchrun worker ignores them.
    recovery: RecoverySpec = Field(default_factory=RecoverySpec)
    preemption: PreemptionSpec = Field(default_factory=PreemptionSpec)
    spares: int = Field(
        default=0,
        ge=0,
        le=MAX_SPARES,
        description="Warm spare processes kept beside the job's nodes (peer recovery only).",
    )
    nodes: str = Field(default="1", json_schema_extra={"pattern": r"^[0-9]+(:[0-9]+)?$"})
    initial_nodes: int | None = Field(default=None, gt=0, le=MAX_NODES)
    nproc_per_node: int = Field(default=1, gt=0, le=1024)
    max_restarts: int = Field(default=3, ge=0, le=10_000)
    resources: dict[Annotated[str, Field(max_length=100)], Annotated[str, Field(max_length=300)]] = Field(
        default_factory=dict, max_length=16
    )
    priority: int = Field(
        default=0,
        ge=-1_000_000,
        le=1_000_000,
        description=(
            "Higher starts first when jobs wait for capacity (then by submission); on Kubernetes "
            "the PriorityClass named 'elastrain-priority-<priority>' when not 0 (see 'queue')."
        ),
    )
    queue: str | None = Field(
        default=None,
        max_length=63,
        pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$",
        description=(
            "Kubernetes: the Volcano queue this job's pods wait in (default: the service's, "
            "ELASTRAIN_K8S_QUEUE). The local scheduler has one queue and ignores it."
        ),
    )
    image: str | None = Field(
        default=None,
        max_length=MAX_IMAGE,
        pattern=IMAGE_RE,
        description=(
            "Kubernetes: the container image of this job's worker pods (default: the service's "
            "worker image); it must contain elastrain's worker. Ignored on one machine."
        ),
    )
    env: dict[str, Annotated[str, Field(max_length=MAX_TEXT)]] = Field(
        default_factory=dict,
        max_length=MAX_ENV,
        description=(
            "Environment of this job's nodes (and so of its workers), e.g. PYTHONPATH for the "
            "team's code; names like shell variables, none of ELASTRAIN_*, TORCH* or torchrun's own."
        ),
    )

    @field_validator("nodes")
    @classmethod
    def _nodes(cls, value: str) -> str:
        lo, hi = parse_nodes(value)
        if lo < 1 or hi < lo:
            raise ValueError(f"{value!r} must be N or MIN:MAX with 1 <= MIN <= MAX")
        if hi > MAX_NODES:
            raise ValueError(f"{value!r} asks for more than {MAX_NODES} nodes; give a smaller MAX")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for name, text in value.items():
            check_env_name(name)
            check_env_value(name, text)
        return value

    @model_validator(mode="after")
    def _initial_nodes(self) -> JobSpec:
        lo, hi = parse_nodes(self.nodes)
        if self.initial_nodes is not None and not lo <= self.initial_nodes <= hi:
            raise ValueError(f"'initial_nodes' {self.initial_nodes} must lie within 'nodes' {self.nodes!r}")
        return self

    @model_validator(mode="after")
    def _peer_needs_ddp(self) -> JobSpec:
        if self.recovery.mode == "peer" and self.parallelism != "ddp":
            raise ValueError(
                "field 'recovery.mode': peer recovery needs parallelism 'ddp' (FSDP state is sharded: "
                "no peer holds a lost rank's shard); use 'auto' or 'restart'"
            )
        return self

    @model_validator(mode="after")
    def _one_loss(self) -> JobSpec:
        if self.loss is not None and self.model.output == "loss":
            raise ValueError(
                "field 'loss': give either model.output 'loss' (the model computes per-sample "
                "losses) or a 'loss' factory, not both"
            )
        return self

    @model_validator(mode="after")
    def _batch(self) -> JobSpec:
        if self.grad_accum_steps is not None and self.global_batch_size is not None:
            raise ValueError("give only one of 'grad_accum_steps' or 'global_batch_size'")
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"'global_batch_size' {self.global_batch_size} is not a multiple of "
                f"'micro_batch_size' {self.micro_batch_size}"
            )
        return self

    @property
    def accum_steps_or_default(self) -> int:
        return self.grad_accum_steps if self.grad_accum_steps is not None else 1


def parse_nodes(value: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2), ``"1:4"`` -> (1, 4)."""
    match = _NODES_RE.match(value.strip())
    if not match:
        raise ValueError(f"{value[:40]!r} is not N or MIN:MAX in the digits 0-9; give e.g. '2' or '1:4'")
    lo = int(match.group(1))
    hi = int(match.group(2)) if match.group(2) else lo
    return lo, hi


_FIX_HINTS = {
    "extra_forbidden": "remove it (check the spelling against the documented fields)",
    "missing": "add it",
    "int_type": "give a whole number without quotes",
    "float_type": "give a number without quotes",
    "bool_type": "give true or false",
    "string_type": "give a string in quotes",
    "greater_than": "give a larger value",
    "greater_than_equal": "give a larger value",
    "less_than": "give a smaller value",
    "less_than_equal": "give a smaller value",
    "literal_error": "use one of the listed values",
    "string_pattern_mismatch": "use lowercase letters, digits and '-' (like a DNS label)",
    "json_invalid": "fix the JSON syntax",
    "finite_number": "give a finite number (not NaN or Infinity)",
}


def describe(error: ValidationError) -> str:
    """One line per problem: the field path, what is wrong, and what would fix it."""
    lines = []
    for item in error.errors():
        loc = ".".join(str(part) for part in item["loc"]) or "spec"
        msg = item["msg"].removeprefix("Value error, ")
        hint = _FIX_HINTS.get(item["type"])
        if not item["loc"] and msg.startswith("field '"):  # a rule across fields names its own
            lines.append(msg)
            continue
        lines.append(f"field '{loc}': {msg}" + (f"; {hint}" if hint else ""))
    return "; ".join(lines)


def parse_spec(raw: str | bytes | dict[str, Any]) -> JobSpec:
    """Validate a spec given as JSON text or a decoded dict. Raises :class:`SpecError`."""
    try:
        if isinstance(raw, dict):
            return JobSpec.model_validate(raw)
        return JobSpec.model_validate_json(raw)
    except ValidationError as exc:
        raise SpecError(describe(exc)) from None


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a spec file. Raises :class:`SpecError` naming the problem."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"cannot read spec file {str(path)!r}: {exc.strerror}") from None
    return parse_spec(text)


def spec_json(spec: JobSpec) -> str:
    """Canonical JSON of a spec (sorted keys, aliases): what the hash and the run record use."""
    return json.dumps(spec.model_dump(mode="json", by_alias=True), sort_keys=True, separators=(",", ":"))

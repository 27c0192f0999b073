"""The trainer-facing checkpointer: ``should_save``, ``save``, ``restore``, ``close``, ``stats``.

All ranks call ``save`` and ``restore`` collectively (same steps, same order). The job's
checkpoint directory is ``cfg.dir`` (``<dir>/step-<8 digits>/``, ``<dir>/latest``). With
``cfg.dir`` unset checkpointing is off: ``should_save`` is False, ``save`` does nothing and
``restore`` returns None.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worker.checkpoint.asyncsave import AsyncWriter, Snapshot
from worker.checkpoint.blocks import DEFAULT_BLOCK_SIZE
from worker.checkpoint.coordinator import (
    Coordinator,
    InJobCoordinator,
    KeyValueStore,
    MemoryStore,
    Outcome,
    session_id,
)
from worker.checkpoint.engine import SaveJob, json_copy, new_job, persist
from worker.checkpoint.export import hf_config_of
from worker.checkpoint.final import no_space, unpublished_final
from worker.checkpoint.interval import auto_interval_seconds, observed_mtbf, policy_from_spec, should_save
from worker.checkpoint.layout import (
    collect_orphans,
    parse_staging_dir,
    remove_tree,
    staging_dir_name,
)
from worker.checkpoint.manifest import MAX_BLOCK_SIZE
from worker.checkpoint.owner import check_owner, claim
from worker.checkpoint.places import Place, list_published, place_of, same_place
from worker.checkpoint.remote import collect_unpublished
from worker.checkpoint.restore import RestoreContext, Restored, restore
from worker.checkpoint.retention import apply_retention
from worker.checkpoint.rng import capture_rng
from worker.checkpoint.state import capture, optimizer_owned
from worker.checkpoint.storage import check_reachable
from worker.errors import CheckpointError
from worker.failpoints import failpoint
from worker.jobspec.location import S3Location
from worker.jobspec.spec import CheckpointSpec

log = logging.getLogger("elastrain.checkpoint")
EventHook = Callable[[str, dict[str, Any]], None]
COPY_ON_RESUME_ENV = "ELASTRAIN_CHECKPOINT_COPY_ON_RESUME"
"""A directory: right after a resume, the state just loaded is saved there as a checkpoint of
its own (before anything trains), so that its logical digest can be compared with the source's
(``elastrain checkpoint digest``): equal when every tensor landed where it belongs, at any world
size. Off when unset."""


@dataclass(slots=True)
class CheckpointStats:
    """Counters for metrics (``elastrain_checkpoint_<name>``; ``_total`` ones are counters)."""

    saves_total: int = 0
    aborts_total: int = 0
    verification_failures_total: int = 0
    restores_total: int = 0
    orphans_collected_total: int = 0
    deleted_total: int = 0
    blocking_seconds_total: float = 0.0
    persist_seconds_total: float = 0.0
    bytes_written_total: int = 0
    bytes_read_total: int = 0
    no_space_aborts_total: int = 0
    last_blocking_seconds: float = 0.0
    last_persist_seconds: float = 0.0
    last_published_step: int = -1
    interval_seconds: float = 0.0

    def as_metrics(self) -> dict[str, float]:
        return {f"elastrain_checkpoint_{k}": float(getattr(self, k)) for k in self.__slots__}


class Checkpointer:
    """Sharded, two-phase, verified checkpoints for one rank of a job (see the package docs)."""

    def __init__(
        self,
        cfg: CheckpointSpec,
        *,
        job: str,
        spec_hash: str,
        data_version: str,
        rank: int,
        world_size: int,
        generation: int,
        parallelism: str,
        seed: int,
        run_record: dict[str, Any],
        coordinator: Coordinator | None = None,
        store: KeyValueStore | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        timeout_s: float = 600.0,
        on_event: EventHook | None = None,
        open_on_thread: bool = False,
        after: Checkpointer | None = None,
    ) -> None:
        """``open_on_thread``: the job directory's checks, the store's session and the
        coordinator are made on a thread that :meth:`start_opening` starts, or else the first
        save or restore (or :attr:`store`), which waits for them; their error, if any, is raised
        there. Peer mode builds every re-formed generation's checkpointer so (the directory was
        claimed at the first generation) and starts the opening after the generation's first
        step: that work -- a store round trip, the directory reads -- was 1-7 ms of a join's
        critical path here when it ran inline, and 4.4 ms of the join's first window (its median
        excess over the median window, 12 interleaved 1 -> 2 joins a side: 6.95 -> 2.6 ms) when
        its thread started at once: it shares the interpreter with the training thread, and the
        store it calls is hosted in the leader's process.

        ``after``: the previous generation's checkpointer in this process, whose save may still
        be in flight (peer mode, after a planned re-formation: every member of the old group is
        alive to complete it). The opening first closes it -- its save is published or aborted
        -- and only then reads the directory: rank 0's orphan scan removes other generations'
        staging directories, and would otherwise abort that save under its writer. With
        ``open_on_thread`` the wait is the thread's; this one's first save waits for it, as a save
        waits for the one before."""
        self.cfg = cfg
        self.job, self.spec_hash, self.data_version = job, spec_hash, data_version
        self.rank, self.world_size, self.generation = rank, world_size, generation
        self.parallelism, self.seed, self.run_record = parallelism, seed, run_record
        self.block_size, self.timeout_s = block_size, timeout_s
        self.job_dir: Place | None = place_of(cfg.dir) if cfg.dir else None
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise CheckpointError(f"block_size {block_size} must be between 1 and {MAX_BLOCK_SIZE} bytes")
        self.stats = CheckpointStats()
        self.policy = policy_from_spec(cfg)
        self._on_event = on_event
        self._store: KeyValueStore = MemoryStore()
        self._coordinator = coordinator
        self._writer = AsyncWriter()
        self._hooks: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = weakref.WeakKeyDictionary()
        self._seq = 0
        self._restores = 0
        self._last_step: int | None = None
        self._abort_reason: str | None = None  # the newest save's, when it aborted
        self._last_time = time.time()
        self._started = self._last_time
        self._parent_step: int | None = None
        self._origin = ""  # the checkpoint.resume this job started from (recorded in every manifest)
        self._hf: tuple[nn.Module, dict[str, Any] | None] | None = None
        self.session = "off"
        self._opening: threading.Thread | None = None
        self._open_error: BaseException | None = None
        self._after = after
        if self.job_dir is None:
            return
        if open_on_thread:
            self._opening = threading.Thread(
                target=self._open_quietly, args=(store,), name="elastrain-checkpointer-open", daemon=True
            )  # started by start_opening, or by the first use
        else:
            self._open(store)

    def start_opening(self) -> None:
        """Start an ``open_on_thread`` opening (once); a no-op otherwise."""
        if self._opening is not None and self._opening.ident is None:
            self._opening.start()

    def _open(self, store: KeyValueStore | None) -> None:
        """The previous generation's save (``after``), then the job directory's checks, the store's
        session, the coordinator, the orphans."""
        assert self.job_dir is not None
        self._close_after()
        job, rank, world_size, generation = self.job, self.rank, self.world_size, self.generation
        if isinstance(self.job_dir, S3Location):
            check_reachable(self.job_dir)  # one line, before any rank waits on another
        # Before anything is written there: the directory belongs to this job or to none.
        elif rank == 0:
            claim(self.job_dir, job)
        else:
            check_owner(self.job_dir, job)
        self._store = store if store is not None else _default_store(world_size)
        self.session = session_id(self._store, job=job, generation=generation, world_size=world_size)
        self._coordinator = self._coordinator or InJobCoordinator(
            self._store,
            rank=rank,
            world_size=world_size,
            job=job,
            job_dir=self.job_dir,
            session=self.session,
        )
        if rank == 0:
            if isinstance(self.job_dir, S3Location):
                removed = collect_unpublished(self.job_dir)
            else:
                self.job_dir.mkdir(parents=True, exist_ok=True)
                removed = collect_orphans(self.job_dir, current_generation=generation)
            self.stats.orphans_collected_total += len(removed)
            if removed:
                self.event("checkpoint_orphans_collected", removed=removed)

    def _close_after(self) -> None:
        """Close the previous generation's checkpointer (``after``); its newest save counts as
        this one's until this one saves (a run's final save may be that one: see
        :meth:`final_problem`)."""
        after, self._after = self._after, None
        if after is None:
            return
        after.close()
        if self._last_step is None:
            self._last_step, self._abort_reason = after._last_step, after._abort_reason

    def _open_quietly(self, store: KeyValueStore | None) -> None:
        try:
            self._open(store)
        except BaseException as exc:  # raised by the caller that needs what _open makes
            self._open_error = exc

    def _opened(self) -> None:
        """Start an ``open_on_thread`` opening if it waits, wait for it; raise what it raised."""
        self.start_opening()
        self._join_opening()
        if self._open_error is not None:
            raise self._open_error

    def _join_opening(self) -> None:
        if self._opening is not None:
            self._opening.join()
            self._opening = None

    @property
    def enabled(self) -> bool:
        return self.job_dir is not None

    def event(self, name: str, **fields: Any) -> None:
        """Log a structured event (and hand it to ``on_event``)."""
        fields = {"rank": self.rank, **fields}
        level = logging.WARNING if "abort" in name or "refused" in name else logging.INFO
        log.log(level, "%s %s", name, fields)
        if self._on_event is not None:
            self._on_event(name, fields)

    # ------------------------------------------------------------ interval

    def should_save(self, step: int, *, now: float) -> bool:
        """Whether the interval policy wants ``step`` saved (the caller always saves the final step)."""
        if not self.enabled:
            return False
        cost = self.stats.last_blocking_seconds or None
        mtbf = observed_mtbf(
            now - float(self.run_record.get("job_started_unix", self._started)), self.generation
        )
        if self.policy.mode == "auto":
            every = auto_interval_seconds(self.policy, save_cost_s=cost, observed_mtbf_s=mtbf)
            if abs(every - self.stats.interval_seconds) > 0.05 * max(every, 1e-9):
                self.stats.interval_seconds = every
                self.event("checkpoint_interval", seconds=round(every, 3), save_cost_s=cost, mtbf_s=mtbf)
        return should_save(
            self.policy, step=step, now=now, last_save_step=self._last_step, last_save_time=self._last_time,
            save_cost_s=cost, observed_mtbf_s=mtbf,
        )  # fmt: skip

    # ------------------------------------------------------------ save

    def save(
        self, *, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, progress: dict[str, Any],
        metrics: dict[str, float],
    ) -> None:  # fmt: skip
        """Checkpoint ``step`` (collective). Sync: returns once published or aborted. Async:
        finishes the previous async save first, captures progress, RNG, optimizer
        hyper-parameters and module buffers, starts copying parameters and optimizer state on
        the writer thread and returns; ``optimizer.step()`` waits for that copy (a step
        pre-hook), and a caller that changes those tensors otherwise must call
        :meth:`wait_snapshot` first (see :mod:`worker.checkpoint.asyncsave`). A failed save is
        aborted, logged and counted; training goes on."""
        if not self.enabled or step == self._last_step:
            return
        t0 = time.perf_counter()
        self._opened()
        self._writer.wait()
        job = self._prepare(step, model, optimizer, progress, metrics)
        self._last_step, self._last_time = step, time.time()
        if self.cfg.async_save:
            self._guard(optimizer)
            deferred = optimizer_owned(model, optimizer)
            snap = Snapshot(self._writer.buffers, job.items, eager=lambda t: not deferred(t))
            snap.copy_eager()
            self._writer.submit(lambda: self._persist_snapshot(job, snap), snapshot=snap)
            self._blocked(time.perf_counter() - t0)
        else:
            self._persist(job)
            self._blocked(time.perf_counter() - t0)

    def wait_snapshot(self) -> None:
        """The fence of an async save: block until the parameters and optimizer state of the
        save in flight are copied (the optimizer step pre-hook calls it). A no-op, at once, when
        no copy is pending (sync saves, or already fenced). The time blocked counts as blocking."""
        waited = self._writer.wait_snapshot()
        if waited:
            self.stats.last_blocking_seconds += waited
            self.stats.blocking_seconds_total += waited

    def _guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Fence before every ``optimizer.step()`` (a step pre-hook): the step cannot change
        tensors while they are copied, whoever calls it."""
        if optimizer in self._hooks:
            return
        fence = weakref.WeakMethod(self.wait_snapshot)  # the optimizer must not keep this alive

        def hook(_opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
            method = fence()
            if method is not None:
                method()

        self._hooks[optimizer] = optimizer.register_step_pre_hook(hook)

    def _persist_snapshot(self, job: SaveJob, snap: Snapshot) -> None:
        """The writer thread, once the snapshot is copied. A failure (of the copy, or a failpoint
        raising here) is reported, so every rank learns that the save is aborted."""
        job.items = snap.items
        error = snap.error
        try:
            failpoint("async_before_write")
        except OSError as exc:
            error = error or exc
        self._persist(job, error=error)

    def _blocked(self, seconds: float) -> None:
        self.stats.last_blocking_seconds = seconds
        self.stats.blocking_seconds_total += seconds

    def _prepare(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, progress: dict[str, Any],
        metrics: dict[str, float],
    ) -> SaveJob:  # fmt: skip
        assert self.job_dir is not None
        self._seq += 1
        live = capture(model, optimizer)
        meta = {"progress": json_copy(progress, "progress"), "extra": live.extra}
        if self._origin:
            meta["origin"] = self._origin  # which checkpoint.resume this job started from
        hf = self._hf_config(model)
        if hf is not None:
            meta["hf"] = hf
        context = {
            "job": self.job, "parallelism": self.parallelism, "block_size": self.block_size, "meta": meta,
            "metrics": json_copy(metrics, "metrics"), "run_record": json_copy(self.run_record, "run_record"),
            "parent_step": self._parent_step, "spec_hash": self.spec_hash, "data_version": self.data_version,
            "aliases": live.aliases,
        }  # fmt: skip
        if self.rank == 0:
            self._collect_stale_staging(step)
        agreed = meta
        if self.parallelism == "fsdp":
            # Each rank's gradient monitor sees only its own shards (a parameter whose shard here
            # is empty looks never updated): rank 0's is the one kept, the others are not compared.
            agreed = {**meta, "progress": {k: v for k, v in meta["progress"].items() if k != "monitor"}}
        return new_job(
            live, step=step, generation=self.generation, seq=self._seq, rank=self.rank,
            world_size=self.world_size, job_dir=self.job_dir, block_size=self.block_size, meta=agreed,
            rank_meta={"rng": capture_rng()}, context=context,
        )  # fmt: skip

    def _hf_config(self, model: nn.Module) -> dict[str, Any] | None:
        """The Hugging Face config the export needs (see :mod:`worker.checkpoint.export`), found
        once per model."""
        if self._hf is None or self._hf[0] is not model:
            self._hf = (model, hf_config_of(model))
        return self._hf[1]

    def _collect_stale_staging(self, step: int) -> None:
        """Staging left by an aborted save of this generation (no other save is in flight)."""
        assert self.job_dir is not None
        if isinstance(self.job_dir, S3Location):
            return  # on S3 an aborted save's shards are removed by the abort
        current = staging_dir_name(step, self.generation)
        for p in self.job_dir.iterdir():
            if parse_staging_dir(p.name) is not None and p.name != current:
                remove_tree(p)
                self.stats.orphans_collected_total += 1

    def _persist(self, job: SaveJob, error: Exception | None = None) -> None:
        assert self._coordinator is not None
        outcome, nbytes, seconds = persist(job, self._coordinator, timeout=self.timeout_s, error=error)
        self.stats.persist_seconds_total += seconds
        self.stats.last_persist_seconds = seconds
        self.stats.bytes_written_total += nbytes
        self._record_outcome(outcome, nbytes, seconds)

    def _record_outcome(self, outcome: Outcome, nbytes: int, seconds: float) -> None:
        if not outcome.published:
            self.stats.aborts_total += 1
            full = no_space(outcome.reason)
            self.stats.no_space_aborts_total += int(full)
            self._abort_reason = outcome.reason
            self.event(
                "checkpoint_aborted", step=outcome.step, generation=outcome.generation, reason=outcome.reason,
                path=str(self.job_dir), no_space=full,
            )  # fmt: skip
            return
        self._abort_reason = None
        self.stats.saves_total += 1
        self.stats.last_published_step = outcome.step
        self._parent_step = outcome.step
        self.event(
            "checkpoint_published", step=outcome.step, path=outcome.path, bytes=nbytes,
            persist_seconds=round(seconds, 4), background=self.cfg.async_save,
        )  # fmt: skip
        if self.rank == 0 and self.job_dir is not None:
            deleted = apply_retention(self.job_dir, self.cfg.retention, newest=outcome.step, job=self.job)
            self.stats.deleted_total += len(deleted)
            if deleted:
                self.event("checkpoint_retention_deleted", steps=deleted)
            if isinstance(self.job_dir, S3Location):
                self._collect_abandoned(outcome.step)

    def _collect_abandoned(self, newest: int) -> None:
        """With retention on S3: what abandoned saves before ``newest`` left (shards of a step
        without a manifest, open multipart uploads). A store that fails here fails no save."""
        assert isinstance(self.job_dir, S3Location)
        try:
            removed = collect_unpublished(self.job_dir, below=newest)
        except CheckpointError as exc:
            log.warning("could not collect abandoned saves in %s: %s", self.job_dir, exc)
            return
        self.stats.orphans_collected_total += len(removed)
        if removed:
            self.event("checkpoint_orphans_collected", removed=removed)

    # ------------------------------------------------------------ restore / close

    def restore(self, *, model: nn.Module, optimizer: torch.optim.Optimizer) -> Restored | None:
        """Load per ``cfg.resume`` (collective); see :mod:`worker.checkpoint.restore`."""
        if not self.enabled or self.cfg.resume == "never":
            return None
        self._opened()
        self._writer.wait()
        self._restores += 1
        assert self.job_dir is not None
        ctx = RestoreContext(
            job_dir=self.job_dir, resume=self.cfg.resume, job=self.job, session=self.session, rank=self.rank,
            world_size=self.world_size, generation=self.generation, seed=self.seed,
            data_version=self.data_version, timeout_s=self.timeout_s, store=self._store,
        )  # fmt: skip
        result = restore(
            ctx, model=model, optimizer=optimizer, attempt=self._restores, event=self.event,
            on_refused=self._count_refused,
        )  # fmt: skip
        if result is not None:
            self.stats.restores_total += 1
            self.stats.bytes_read_total += result.bytes_read
            self._parent_step = result.step
            self._origin = result.origin
            if self.job_dir is not None and same_place(result.path.parent, self.job_dir):
                self._last_step = result.step  # already in this job's directory: saving it again is a no-op
            copy_to = os.environ.get(COPY_ON_RESUME_ENV)
            if copy_to:
                self._copy_loaded(Path(copy_to), result, model=model, optimizer=optimizer)
        return result

    def _copy_loaded(
        self, directory: Path, result: Restored, *, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        """Save what was just loaded into ``directory`` (collective, synchronous; see
        :data:`COPY_ON_RESUME_ENV`), coordinated in the job through the store. Draws from no
        generator: the RNG restored for the first step is left as it is."""
        cfg = self.cfg.model_copy(update={"dir": str(directory), "async_save": False, "resume": "never"})
        copy = Checkpointer(
            cfg, job=self.job, spec_hash=self.spec_hash, data_version=self.data_version, rank=self.rank,
            world_size=self.world_size, generation=self.generation, parallelism=self.parallelism,
            seed=self.seed, run_record=self.run_record, store=self._store, block_size=self.block_size,
            timeout_s=self.timeout_s,
        )  # fmt: skip
        copy.save(step=result.step, model=model, optimizer=optimizer, progress=result.progress, metrics={})
        copy.close()
        published = copy.stats.last_published_step == result.step
        self.event("checkpoint_copied", step=result.step, path=str(directory), published=published)

    def _count_refused(self) -> None:
        self.stats.verification_failures_total += 1

    def close(self) -> None:
        """Wait for an in-flight async save to be published or aborted (its snapshot included).
        An ``open_on_thread`` checkpointer closed before its opening started opens nothing (its
        generation is over): it closes the one it was to wait for (``after``)."""
        if self._opening is not None and self._opening.ident is None:
            self._opening = None
            self._close_after()
        self._join_opening()  # its error, if any, is nobody's now: nothing was saved
        self._writer.wait()

    def final_problem(self, step: int) -> str | None:
        """After :meth:`close`: None when the run's final ``step`` is kept (published in the job's
        directory, or checkpointing is off, or this checkpointer never saved that step: nothing
        was trained since it was loaded); else the line that says it is not
        (:func:`~worker.checkpoint.final.unpublished_final`). Reads the job's directory."""
        if self.job_dir is None or self._last_step != step:
            return None
        published = list_published(self.job_dir)
        return unpublished_final(
            final_step=step, newest_published=published[-1][0] if published else None,
            reason=self._abort_reason, job_dir=str(self.job_dir),
        )  # fmt: skip

    @property
    def store(self) -> KeyValueStore:
        self._opened()
        return self._store


def _default_store(world_size: int) -> KeyValueStore:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        store: KeyValueStore = dist.distributed_c10d._get_default_store()
        return store
    if world_size > 1:
        raise CheckpointError(
            "a checkpointer for several ranks needs a store (or an initialised process group)"
        )
    return MemoryStore()

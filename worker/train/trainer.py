"""The training loop every rank runs: windows of micro-steps, checkpoints, progress, the finish line."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from worker.checkpoint.rng import capture_rng
from worker.datapath.feed import Feed, make_feed
from worker.datapath.sampler import Window
from worker.datapath.trace import LoadRecorder, SampleTrace, rng_fingerprint, spent, thread_clock
from worker.errors import FinalCheckpointError
from worker.jobspec.location import is_url
from worker.metrics import WorkerMetrics, peak_memory_bytes
from worker.report.events import Events, progress_line, resumed_line
from worker.start import lifeline, startgc
from worker.start.build import Built
from worker.start.dist import DistInfo
from worker.start.hangs import Beacon
from worker.start.parts import (
    build_optimizer,
    params_digest,
    rank_seed,
    run_record,
    seed_all,
    shared_parameters,
    spec_hash,
    wrap,
)
from worker.train import preemption
from worker.train.amp import OPTIMIZER_ROW, DynamicLossScaler, optimizer_row, state_dtypes
from worker.train.evaluation import evaluate
from worker.train.integrity import ReplicaCheck, replica_check
from worker.train.monitor import GradMonitor, GradStats
from worker.train.progress import Progress
from worker.train.schedule import lr_at, plan_batch
from worker.train.step import Commit, StepResult, forward_backward, optimizer_step
from worker.train.straggler_watch import StragglerWatch, node_number

if TYPE_CHECKING:
    from worker.checkpoint import Checkpointer


class Trainer:
    """Owns one rank's model, optimizer, scaler and data position for a whole run.

    Constructed complete, once the process group exists: from what :func:`worker.start.build.build`
    decided before it, and its collaborators (events, the checkpointer, the generation this group
    agreed on, the metrics exporter). :meth:`start` resumes and writes the run record; :meth:`run`
    trains.
    """

    def __init__(
        self,
        built: Built,
        info: DistInfo,
        *,
        events: Events,
        checkpointer: Checkpointer | None,
        generation: int,
        metrics: WorkerMetrics | None,
    ) -> None:
        spec = built.spec
        self.spec, self.info, self.events = spec, info, events
        self.checkpointer, self.generation, self.metrics = checkpointer, generation, metrics
        self.device = torch.device(info.device)
        self.flags = built.flags
        self.model, self.objective, self.plan = built.model, built.objective, built.plan
        self.eval_data = built.eval_data
        trace_dir = os.environ.get("ELASTRAIN_TRACE_SAMPLES")
        self.trace = SampleTrace(trace_dir, info.rank) if trace_dir else None
        self.recorder = LoadRecorder() if self.trace is not None else None
        self.data, self.prefetch = built.data, built.prefetch
        self.progress = Progress()
        self.scaler = DynamicLossScaler(spec.loss_scale, enabled=spec.precision == "fp16")
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self.monitor = GradMonitor(names, stale_after=spec.monitor.stale_after_steps)
        self.notes: list[str] = list(built.notes)
        self.record: dict[str, Any] = {}
        self.data_wait = 0.0
        self.local_samples = 0
        self.lr = spec.optimizer.lr
        self.stepped = False
        self.wrapped = wrap(
            self.model, info, parallelism=spec.parallelism, bucket_cap_mb=spec.ddp.bucket_cap_mb
        )
        self.optimizer = build_optimizer(self.model, spec.optimizer)
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        # Restart mode, DDP: the replicas compare their state (peer mode sets it to None)
        self.replicas: ReplicaCheck | None = replica_check(
            spec, self.model, self.optimizer, info, events=events, metrics=metrics, notes=self.notes
        )
        self.tokens_per_sample = int(getattr(self.data, "meta", {}).get("seq_len", 0))
        self.last_log = (time.perf_counter(), 0)
        # Peer mode (worker.peer.loop): the window's commit vote, and the per-window random streams.
        self.commit: Commit | None = None
        self.window_rng: Callable[[], None] | None = None
        self.on_first_step: Callable[[], None] | None = None
        # Restart mode: where this rank is, for naming the ranks a timed-out collective waited for
        self.beacon: Beacon | None = None
        self.stragglers = StragglerWatch(
            spec.stragglers, model=self.model, optimizer=self.optimizer, events=events, metrics=metrics,
            node=node_number(os.environ), active=not self.wrapped.fsdp and self.device.type == "cpu",
        )  # fmt: skip
        if metrics is not None and spec.monitor.time_communication and not self.wrapped.fsdp:
            self.wrapped.module.register_comm_hook(None, metrics.comm.hook)  # type: ignore[operator]

    def start(self) -> None:
        """Resume if a checkpoint says so (else reseed per rank) and write the run record.

        Nothing after the RNG restore draws from a generator before the first step: the resumed
        run continues the very streams (dropout masks...) the checkpointed run would have used.
        """
        seed_all(rank_seed(self.spec.seed, self.info.rank))
        self._resume()
        if self.progress.reference_batch is None:
            self.progress.reference_batch = self.plan.global_batch
        record = self._new_record(state_dtypes(self.model, self.optimizer))
        if self.info.is_main:
            self._write_record(record)
        self.events.emit("run_record", **record)

    def _new_record(self, state: dict[str, list[str]]) -> dict[str, Any]:
        """This process's run record for the world it trains in now (and the checkpointer's)."""
        record = run_record(
            self.spec, self.info, plan=self.plan, flags=self.flags, notes=self.notes, state=state
        )
        record["generation"] = self.generation
        record["loss"] = self.objective.source
        self.record = record
        if self.checkpointer is not None:
            self.checkpointer.run_record = record
        return record

    def _resume(self) -> bool:
        """Load the newest published checkpoint, if there is one; whether one was loaded."""
        if self.checkpointer is None:
            return False
        try:
            restored = self.checkpointer.restore(model=self.model, optimizer=self.optimizer)
        finally:  # a refusal is visible at once, not at the next save (nor never, if nothing verifies)
            if self.metrics is not None:
                self.metrics.checkpoint(self.checkpointer.stats.as_metrics())
        if restored is None:
            return False
        raw = restored.progress
        self.progress = Progress.from_json(raw)
        self.scaler.load_state_dict(raw["loss_scaler"])
        self.monitor.load_state_dict(raw["monitor"])
        self.plan = plan_batch(
            self.spec, self.info.world_size, reference_batch=self.progress.reference_batch, resuming=True
        )
        self.notes.extend(restored.notes)
        self.notes.append(f"resumed from step {restored.step}: {self.plan.note}")
        self.events.emit(
            "resumed",
            step=restored.step,
            samples_seen=self.progress.samples_seen,
            checkpoint=str(restored.path),
            rng_restored=restored.rng_restored,
            batch_plan=self.plan.to_json(),
            bytes_read=restored.bytes_read,
        )
        self.events.say(
            resumed_line(
                step=restored.step, checkpoint=str(restored.path), samples=self.progress.samples_seen,
                world_size=self.info.world_size, saved_at=restored.saved_world_size, note=self.plan.note,
            )
        )  # fmt: skip
        return True

    def _write_record(self, record: dict[str, Any]) -> None:
        out = self.spec.checkpoint.dir
        if out is None or is_url(out):  # on S3 only the manifests carry it (no local directory)
            return
        path = Path(out)
        tmp = path / f".run-record.{os.getpid()}.tmp"
        try:
            path.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(record, indent=2, sort_keys=True, default=str))
            os.replace(tmp, path / "run-record.json")
        except OSError as exc:  # a full volume: every checkpoint's manifest carries the record too
            with contextlib.suppress(OSError):
                tmp.unlink()
            self.events.emit("run_record_not_written", path=str(path), reason=exc.strerror or str(exc))

    def run(self) -> dict[str, Any]:
        """Train to ``max_steps``; returns the finished event's fields."""
        feed = make_feed(
            self.data, depth=self.prefetch, seed=self.spec.seed, rank=self.info.rank,
            world_size=self.info.world_size, micro_batch=self.plan.micro_batch,
            accum_steps=self.plan.accum_steps, device=self.device,
        )  # fmt: skip
        try:
            self._loop(feed)
        finally:
            feed.close()  # batches loaded past the last step are dropped
        return self._finish()

    def _loop(self, feed: Feed) -> None:
        self.model.train()
        self.last_log = (time.perf_counter(), self.progress.samples_seen)
        while self.progress.step < self.spec.max_steps:
            self.window(feed)

    def window(self, feed: Feed) -> None:
        """Train one window and do what follows a committed one (progress, report, eval, save).
        The state changes only after the step's commit point (:func:`worker.train.step.optimizer_step`);
        what follows it may fail with the window committed (peer mode recovers from there)."""
        spec, prog = self.spec, self.progress
        if self.window_rng is not None:  # peer mode: streams derived from (seed, version, rank)
            self.window_rng()
        window = feed.plan(prog.sampler)
        # the sample trace: the generators right before the window, and the thread's clocks
        traced = (rng_fingerprint(capture_rng()), thread_clock()) if self.trace is not None else None
        started = time.perf_counter()
        waited = feed.wait_s
        result = self._train_window(feed, window)
        self.data_wait = feed.wait_s - waited
        self.stragglers.measured(
            started=started, data_wait=self.data_wait, rank=self.info.rank, world_size=self.info.world_size
        )
        self._observe_step(time.perf_counter() - started, result.skipped)
        if traced is not None:
            self._trace(window, traced[0], spent(traced[1]))
        prog.sampler = window.after
        if result.skipped:
            prog.samples_skipped += window.samples
            self.events.emit("skipped_step", step=prog.step, loss_scale=self.scaler.scale)
            return
        prog.step += 1
        if self.beacon is not None:
            self.beacon.done(prog.step)
        prog.samples_seen += window.samples
        prog.last_loss = result.loss_sum / window.samples
        if result.stats is not None:
            self._grad_stats(result.stats)
        if not self.stepped:
            self.stepped = True  # the first step of this group: a recovery is over
            self._first_step()
        final = prog.step == spec.max_steps
        save = self._want_save(final, result)
        if prog.step % spec.log_every_steps == 0 or save or final:
            now = time.perf_counter()
            last_log, last_log_samples = self.last_log
            rate = (prog.samples_seen - last_log_samples) / max(now - last_log, 1e-9)
            self.last_log = (now, prog.samples_seen)
            self._report(rate)
        if self._eval_due(final):
            self._evaluate()
        if save:
            self._save()
        elif self.replicas is not None and self.replicas.due(prog.step):
            self.replicas.check(prog.step, full=False)
        if result.stop and not final:
            self._stop(result.stop)

    def _stop(self, asking: int) -> None:
        """``asking`` ranks asked the group to stop after this window (:mod:`worker.train.preemption`).
        In peer mode with ranks remaining, the ones asking leave now without a save and the
        others go on (they re-form without them from memory). Otherwise save the step reached
        (unless just saved), wait for its publication, and raise :class:`Preempted`."""
        request = preemption.REQUEST
        if preemption.hand_off(asking=asking, world_size=self.info.world_size, peer=self.commit is not None):
            if not request.requested:
                return
            event = "straggler_left" if request.signal_name == preemption.STRAGGLER else "preempted"
            self.events.record(
                event, step=self.progress.step, signal=request.signal_name,
                received_at=request.received_at, save_seconds=0.0, saved_step=None, handed_off=True,
            )  # fmt: skip
            raise preemption.Preempted(self.progress.step)
        began = time.time()
        if self.checkpointer is not None:
            self._save(extra=True)
            self.checkpointer.close()
        self.events.emit(
            "preempted", step=self.progress.step, signal=request.signal_name,
            received_at=request.received_at, save_seconds=round(time.time() - began, 4),
            saved_step=self.checkpointer.stats.last_published_step if self.checkpointer else None,
        )  # fmt: skip
        raise preemption.Preempted(self.progress.step)

    def _train_window(self, feed: Feed, window: Window) -> StepResult:
        batches = feed.batches(self.progress.sampler, window)
        if self.recorder is not None:
            batches = self.recorder.record(batches)
        batches = lifeline.glancing(batches)  # peer mode: the agent's sign of life stays fresh
        if self.beacon is not None:
            self.beacon.entered(self.progress.step + 1)
        local_loss, self.local_samples = forward_backward(
            self.wrapped,
            batches,
            micro_steps=len(window.micro_steps),
            weight=self.info.world_size / window.samples,
            objective=self.objective,
            precision=self.spec.precision,
            scale=self.scaler.scale,
            device=self.device,
        )
        self.stragglers.backward_done()
        total = self.spec.max_steps * self.plan.global_batch
        self.lr = lr_at(
            self.progress.samples_seen,
            base_lr=self.spec.optimizer.lr,
            factor=self.plan.lr_factor,
            schedule=self.spec.lr_schedule,
            total=total,
        )
        if self.beacon is not None:
            self.beacon.reduces(self.progress.step + 1)
        step, rank, world = self.progress.step + 1, self.info.rank, self.info.world_size
        save_vote = self._save_vote()
        ballot = self.stragglers.ballot(step, rank=rank, world_size=world)
        result = optimizer_step(
            self.params,
            self.optimizer,
            self.scaler,
            lr=self.lr,
            clip=self.spec.optimizer.grad_clip_norm,
            loss_sum=local_loss,
            sharded=self.wrapped.fsdp,
            monitor=self.monitor,
            measure=(self.progress.step + 1) % self.spec.monitor.every_steps == 0,
            votes=(*save_vote, *ballot),
            commit=self.commit,
            stop=preemption.REQUEST.requested,
        )
        self.stragglers.read(result.votes[len(save_vote) :], step, rank=rank, world_size=world)
        lifeline.glance()
        return dataclasses.replace(result, votes=result.votes[: len(save_vote)]) if ballot else result

    def _observe_step(self, seconds: float, skipped: bool) -> None:
        """Feed the rank's Prometheus exporter (worker.metrics) after every window."""
        metrics = self.metrics
        if metrics is None:
            return
        tokens = self.local_samples * self.tokens_per_sample
        step = self.progress.step + (0 if skipped else 1)
        metrics.observe_step(seconds, self.local_samples, tokens, self.data_wait, step=step)
        if skipped:
            metrics.skipped()
        if self.spec.precision == "fp16":
            metrics.set_scale(self.scaler.scale, min_scale=self.spec.loss_scale.min_scale)

    def _trace(self, window: Window, rng: str, used: dict[str, float | None]) -> None:
        """ELASTRAIN_TRACE_SAMPLES (see worker.datapath.trace): what the step trained on in this window,
        and what the training thread spent on it."""
        assert self.trace is not None and self.recorder is not None
        self.trace.write(
            generation=self.generation, step=self.progress.step, epoch=window.epoch,
            world_size=self.info.world_size, indices=self.recorder.take(), rng=rng, t=time.time(),
            **used,
        )  # fmt: skip

    def _first_step(self) -> None:
        """The group's first successful step: a recovery is over, and the optimizer's moments
        now exist, so the run record's optimizer entry says what they really are. In peer mode
        this is every generation's first step: the record says the world it trains in now
        (world size, batch plan, generation), and a process that joined a running group (a spare,
        a replacement, a newcomer: it never started the run) builds its record here, so that as
        rank 0 it does not write a record of nothing but the optimizer's dtypes."""
        if self.on_first_step is not None:
            self.on_first_step()
        state = state_dtypes(self.model, self.optimizer)
        if not self.record:
            self._new_record(state)
        self.record.update(
            state_dtypes=state, world_size=self.info.world_size, batch=self.plan.to_json(),
            generation=self.generation, gc=startgc.state(),
        )  # fmt: skip
        self.record.setdefault("precision_table", {})[OPTIMIZER_ROW] = optimizer_row(state)
        if self.info.is_main:
            self._write_record(self.record)
        self.events.emit("first_step", step=self.progress.step, state_dtypes=state)

    def _grad_stats(self, stats: GradStats) -> None:
        if self.metrics is not None:
            self.metrics.grad_stats(stats.zero_fraction, stats.min_nonzero)
        self.events.emit(
            "grad_stats",
            step=self.progress.step,
            zero_fraction=stats.zero_fraction,
            min_nonzero=stats.min_nonzero,
            stale_params=list(stats.stale_params),
        )

    def _save_vote(self) -> tuple[float, ...]:
        """Time-based policies read local clocks: the ranks agree through the step's all-reduce
        (a vote for saving the step about to run), or they would diverge on a collective."""
        cfg = self.spec.checkpoint
        if self.checkpointer is None or (cfg.interval_seconds is None and cfg.interval != "auto"):
            return ()
        return (float(self.checkpointer.should_save(self.progress.step + 1, now=time.time())),)

    def _want_save(self, final: bool, result: StepResult) -> bool:
        if self.checkpointer is None:
            return False
        if final:
            return True
        if result.votes:
            return result.votes[0] > 0
        return self.checkpointer.should_save(self.progress.step, now=time.time())

    def _report(self, rate: float) -> None:
        prog = self.progress
        line = progress_line(
            step=prog.step,
            max_steps=self.spec.max_steps,
            samples=prog.samples_seen,
            loss=prog.last_loss or 0.0,
            rate=rate,
            scale=self.scaler.scale,
            skipped=self.scaler.state.skipped_total,
        )
        self.events.say(line)
        extra: dict[str, Any] = {}
        if self.metrics is not None:
            # Read here, not every step: the process's max RSS is a getrusage call that cost up to
            # 0.4 ms a step under load (it walks every thread of the process).
            self.metrics.peak_memory(peak_memory_bytes(self.info.device))
            if prog.last_loss is not None:
                self.metrics.set_loss(prog.last_loss)
            extra = self.metrics.progress_fields()
        self.events.emit(
            "progress",
            **extra,
            step=prog.step,
            samples_seen=prog.samples_seen,
            loss=prog.last_loss,
            samples_per_second=rate,
            loss_scale=self.scaler.scale,
            lr=self.lr,
            skipped_steps=self.scaler.state.skipped_total,
            epoch=prog.sampler.epoch,
            world_size=self.info.world_size,
        )

    def _eval_due(self, final: bool) -> bool:
        every = self.spec.eval.every_steps
        return self.eval_data is not None and (
            final or (every is not None and self.progress.step % every == 0)
        )

    def _evaluate(self) -> None:
        assert self.eval_data is not None
        value, count = evaluate(
            self.model, self.eval_data, objective=self.objective, precision=self.spec.precision,
            device=self.device, micro_batch=self.plan.micro_batch, rank=self.info.rank,
            world_size=self.info.world_size,
        )  # fmt: skip
        best = self.progress.best_metric
        if best is None or value < best:
            self.progress.best_metric = value
        self.events.emit("eval", step=self.progress.step, loss=value, samples=count)

    def _save(self, *, extra: bool = False) -> None:
        """Checkpoint the step reached. ``extra``: a save the run's policy did not ask for (a
        graceful stop's): it leaves the best metric alone, so that the state the run goes on with
        is the one an undisturbed run has at this step."""
        checkpointer = self.checkpointer
        assert checkpointer is not None  # _want_save is False without one
        if self.replicas is not None:  # nothing is saved while the replicas disagree
            self.replicas.check(self.progress.step, full=True)
        metric = self.progress.best_metric if self.eval_data is not None else self.progress.last_loss
        if self.eval_data is None and metric is not None and not extra:
            best = self.progress.best_metric
            self.progress.best_metric = metric if best is None else min(best, metric)
        progress = self.progress.to_json(self.scaler, self.monitor, self.plan)
        progress["spec_hash"] = spec_hash(self.spec)
        progress["data_version"] = self.spec.data.version
        metrics = {"loss": metric} if metric is not None else {}
        checkpointer.save(
            step=self.progress.step,
            model=self.model,
            optimizer=self.optimizer,
            progress=progress,
            metrics=metrics,
        )
        if self.metrics is not None:  # the checkpoint counters change only here and on restore
            self.metrics.checkpoint(checkpointer.stats.as_metrics())

    def _finish(self) -> dict[str, Any]:
        """The end of the run: its final checkpoint published (else a CheckpointError that says
        which step is kept and why: see :mod:`worker.checkpoint.final`), its digests gathered,
        ``finished`` said."""
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self.metrics is not None:
            if self.checkpointer is not None:
                self.metrics.checkpoint(self.checkpointer.stats.as_metrics())
            self.metrics.flush()
        problem = self.checkpointer.final_problem(self.progress.step) if self.checkpointer else None
        if problem is not None:  # every rank: the save's outcome is the group's
            raise FinalCheckpointError(problem)
        digest = params_digest(self.model)
        rank_digests: list[Any] = [None] * self.info.world_size
        torch.distributed.all_gather_object(rank_digests, digest)
        fields = {
            "step": self.progress.step,
            "samples_seen": self.progress.samples_seen,
            "samples_skipped": self.progress.samples_skipped,
            "skipped_steps": self.scaler.state.skipped_total,
            "loss": self.progress.last_loss,
            "loss_scale": self.scaler.scale,
            "world_size": self.info.world_size,
            "params_digest": digest,
            "rank_params_digests": rank_digests,
            "shared_params": shared_parameters(self.model),
        }
        self.events.emit("finished", **fields)
        return fields

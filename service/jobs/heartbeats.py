"""Ranks' heartbeats: each rank beats every few seconds; a beat reaches etcd when the stored one
is older than ``write_every_s`` (the server sets a quarter of the reconciler's heartbeat timeout,
so a live rank is never seen as silent, and each etcd write is a WAL fsync on the training
machine; the server batches these writes, :mod:`service.jobs.writebehind`). The reconciler
reads, per launch, the oldest of its ranks' newest beats (is the node silent?) and the newest
beat of any rank (its last sign of life, which this instance holds for every beat it took,
written or not: a lost node's recovery is timed from it)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Collection

from service.etcd.kv import FEW, read_all
from service.jobs import keys
from service.jobs.cadence import Cadence
from service.jobs.writebehind import WriteBehind
from service.jobs.writes import LeaderWrites


class Heartbeats:
    def __init__(
        self,
        writes: LeaderWrites,
        *,
        write_every_s: float = 15.0,
        clock: Callable[[], float] = time.time,
        behind: WriteBehind | None = None,
    ) -> None:
        self._writes = writes
        self._behind = behind if behind is not None else WriteBehind(writes)
        self._write_every_s = write_every_s
        self._clock = clock
        self._written: dict[str, float] = {}
        self._heard: dict[str, dict[str, float]] = {}
        """Per job, per launch id: the newest beat this instance took."""
        self._ranks: dict[str, dict[tuple[str, int], float]] = {}
        """Per job, per (launch id, local rank): the newest beat this instance took."""
        self._pruned_at = -math.inf
        self.cadence = Cadence()
        """The periods every answer to a worker asks for (the leader's reconciler sets them each
        full pass from the jobs it runs, :func:`service.jobs.cadence.cadence_of`)."""

    @property
    def deferred(self) -> bool:
        """Whether a beat is written behind (no etcd I/O in :meth:`beat`, the leader's fence
        check aside)."""
        return self._behind.deferred

    def beat(self, job_id: str, launch_id: str, local_rank: int, step: int | None) -> None:
        """A rank is alive: written to etcd when its stored beat is older than ``write_every_s``."""
        now = self._clock()
        self._heard.setdefault(job_id, {})[launch_id] = now
        self._ranks.setdefault(job_id, {})[(launch_id, local_rank)] = now
        key = keys.heartbeat(job_id, launch_id, local_rank)
        if now - self._written.get(key, -math.inf) < self._write_every_s:
            return
        value = f'{{"time": {now!r}, "step": {step if step is not None else "null"}}}'
        self._behind.put(key, value.encode())
        if now - self._pruned_at >= 4 * self._write_every_s:  # forget ranks of ended launches
            self._written = {k: t for k, t in self._written.items() if now - t < 4 * self._write_every_s}
            self._pruned_at = now
        self._written[key] = now

    def last_seen(self, job_id: str) -> dict[str, float]:
        """Per launch id, the oldest of its ranks' newest heartbeat times (as stored)."""
        return self.seen(job_id)[0]

    def seen(self, job_id: str) -> tuple[dict[str, float], dict[str, float]]:
        """Per launch id: the oldest of its ranks' newest heartbeat times (as stored), and the
        newest of any of its ranks (stored, or taken by this instance since)."""
        return self.seen_of([job_id])[job_id]

    def seen_of(self, job_ids: Collection[str]) -> dict[str, tuple[dict[str, float], dict[str, float]]]:
        """:meth:`seen` of each of ``job_ids``, from one read of every stored beat (a pass reads
        them once, not once a job; only live jobs have beats: an ended job's are deleted)."""
        out: dict[str, tuple[dict[str, float], dict[str, float]]] = {
            job_id: ({}, dict(self._heard.get(job_id, {}))) for job_id in job_ids
        }
        if len(out) <= FEW:  # a few jobs: their own prefixes
            entries = [e for job_id in out for e in self._writes.store.list_prefix(keys.heartbeats(job_id))]
        else:
            entries = read_all(self._writes.store, keys.HEARTBEATS) if out else []
        for entry in entries:
            job_id, _, rest = entry.key[len(keys.HEARTBEATS) :].partition("/")
            if job_id not in out:
                continue
            launch_id = rest.split("/", 1)[0]
            try:
                seen = float(json.loads(entry.value)["time"])
            except (ValueError, KeyError, TypeError):
                continue
            oldest, newest = out[job_id]
            oldest[launch_id] = min(oldest.get(launch_id, seen), seen)
            newest[launch_id] = max(newest.get(launch_id, seen), seen)
        return out

    def quietest(self, job_id: str) -> dict[str, float]:
        """Per launch id, the oldest of its ranks' newest beats, stored or taken by this instance
        since: when the service last heard from the node's quietest rank (a stopped rank's last
        sign of life, while the node's other ranks beat on)."""
        prefix = keys.heartbeats(job_id)
        newest = dict(self._ranks.get(job_id, {}))
        for entry in self._writes.store.list_prefix(prefix):
            launch_id, _, rank = entry.key[len(prefix) :].partition("/")
            try:
                seen, local_rank = float(json.loads(entry.value)["time"]), int(rank)
            except (ValueError, KeyError, TypeError):
                continue
            newest[(launch_id, local_rank)] = max(newest.get((launch_id, local_rank), seen), seen)
        out: dict[str, float] = {}
        for (launch_id, _), seen in newest.items():
            out[launch_id] = min(out.get(launch_id, seen), seen)
        return out

    def forget(self, job_id: str) -> None:
        """The job ended: drop what this instance holds of its beats."""
        self._heard.pop(job_id, None)
        self._ranks.pop(job_id, None)
        self._behind.drop(keys.heartbeats(job_id))

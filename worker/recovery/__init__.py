"""Recovery without a restart: the survivors of a lost rank keep their processes,
re-form the data-parallel group among themselves (plus a warm spare or a replacement), agree on
the newest committed state, and hand it to whoever lacks it from memory.

Pure deciders: :mod:`.vote` (the commit vote), :mod:`.plan` (who forms the next generation,
which state wins, the trace rule), :mod:`.records` (the values exchanged), :mod:`.failure`
(what an exception means). I/O: :mod:`.control` (the control channel), :mod:`.hub` (what a
leader knows of its members), :mod:`.membership` (etcd keys), :mod:`.resolve` (a member finding the
leader), :mod:`.answers` (what it is told), :mod:`.leader` (deciding, writing the generation),
:mod:`.readahead` and :mod:`.joincommit` (a planned re-formation's read ahead, a join's
compare-and-set after its announcement), :mod:`.group` (process groups), :mod:`.agree`,
:mod:`.transfer` and :mod:`.handover` (state), :mod:`.rewrap` (DDP and its settle), :mod:`.rng`
(per-window streams); :mod:`.recover` runs the sequence for one process
(:class:`~worker.recovery.recover.GroupMember`) and :mod:`.seam` is what the trainer provides and
gets back. :mod:`worker.start.lifeline` (a worker dies with its agent) serves both recovery modes.
docs/recovery.md ("Recovery without a restart: the workers' side") says why; docs/benchmarks.md
has the measurements.
"""

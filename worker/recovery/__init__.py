"""Recovery without a restart (issue 14): the survivors of a lost rank keep their processes,
re-form the data-parallel group among themselves (plus a warm spare or a replacement), agree on
the newest committed state, and hand it to whoever lacks it from memory.

Pure deciders: :mod:`.vote` (the commit vote), :mod:`.plan` (who forms the next generation,
which state wins, the trace rule), :mod:`.records` (the values exchanged), :mod:`.failure`.
I/O: :mod:`.control` (the control channel), :mod:`.membership` (etcd keys), :mod:`.group`
(process groups), :mod:`.agree` and :mod:`.transfer` (state), :mod:`.rewrap` (DDP), and
:mod:`.recover`, which runs the sequence. See issue14-design.md for the why.
"""

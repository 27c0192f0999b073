"""Peer mode: one process's run in the job's data-parallel group, which recovers without a
restart (the protocol it drives is :mod:`worker.recovery`)."""

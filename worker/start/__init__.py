"""A worker's start-up: building the run before any process group (bad input fails here),
the process group and its start-up round, and the process's own guards (lifeline, collector)."""

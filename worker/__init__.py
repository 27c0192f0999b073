"""elastrain's worker: what torchrun starts in each process."""

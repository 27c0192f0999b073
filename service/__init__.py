"""elastrain's control plane. Imports no torch."""

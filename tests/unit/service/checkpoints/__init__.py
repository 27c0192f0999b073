"""Unit tests of ``service/checkpoints``."""

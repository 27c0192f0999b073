"""Unit tests of ``service/jobs``."""

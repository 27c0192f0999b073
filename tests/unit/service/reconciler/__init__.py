"""Unit tests of ``service/reconciler``."""

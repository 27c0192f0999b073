"""Unit tests of ``service/api``."""

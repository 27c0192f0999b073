"""Unit tests of ``service/server.py``, its settings and ports."""

"""Unit tests of the control plane (``service/``), by part."""

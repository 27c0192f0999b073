"""Unit tests of ``service/etcd``."""

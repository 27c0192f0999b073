"""The GPUs this host's processes see, read from the environment and the NVIDIA driver (the I/O
beside :mod:`service.launch.gpus`, which decides what a job's nodes get)."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path

from service.launch import gpus

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


def count(env: Mapping[str, str], gpus_dir: Path, dev: Path = Path("/dev")) -> int:
    """The GPUs a process started with ``env`` sees: ``CUDA_VISIBLE_DEVICES``' entries when it is
    set (:func:`service.launch.gpus.visible`), else the NVIDIA driver's GPUs: ``gpus_dir``'s
    entries, or where the driver shows no such directory (some sandboxes), the ``/dev/nvidiaN``
    devices."""
    seen = gpus.visible(env)
    if seen is not None:
        return seen
    try:
        return sum(1 for _ in gpus_dir.iterdir())
    except OSError:
        pass
    try:
        return gpus.nvidia_devices(d.name for d in dev.iterdir())
    except OSError:
        return 0


@functools.cache
def host_gpus() -> int:
    """The GPUs this service's nodes would see: read once (:func:`count`)."""
    return count(os.environ, NVIDIA_GPUS)

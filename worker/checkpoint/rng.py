"""Per-rank RNG state (python, numpy global, torch CPU, CUDA) as JSON, and its derivation.

A rank that did not exist in the saved world gets generators seeded from (seed, step, rank), so a
resumed run at a new world size is still a function of its inputs.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch
import xxhash


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def capture_rng() -> dict[str, Any]:
    """This process's generator states, JSON-able."""
    version, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out: dict[str, Any] = {
        "python": [version, list(state), gauss],
        "numpy": [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(state: dict[str, Any]) -> None:
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


def derived_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit seed that is a pure function of (seed, step, rank)."""
    return xxhash.xxh64_intdigest(f"elastrain-rng:{seed}:{step}:{rank}".encode()) >> 1


def derive_rng(seed: int, step: int, rank: int) -> int:
    """Seed every generator of this process from (seed, step, rank); returns the seed used."""
    s = derived_seed(seed, step, rank)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    return s

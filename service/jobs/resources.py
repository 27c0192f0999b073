"""``JobSpec.resources`` read once, pure and torch-free: what the submit checks and what the
launch turns into a TorchX ``Resource`` (:func:`service.launch.apps.resource_from_spec`).

Keys: ``cpu`` (whole cores), ``gpu`` (a count), ``memory`` (``"16Gi"``, ``"512Mi"``, ``"2G"`` or
bytes) or ``memMB``, ``instance_type`` (a node selector). Unset: no limit (``-1``). A value no
scheduler can use is a :class:`SpecError` naming the field (``resources.cpu``) and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from worker.errors import SpecError

KNOWN = ("cpu", "gpu", "memory", "memMB", "instance_type")
_MEM_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9}
_MEM_RE = re.compile(r"^([0-9]{1,15}(?:\.[0-9]{1,6})?)(Ki|Mi|Gi|Ti|K|M|G)?$")  # ASCII digits only
_COUNT_RE = re.compile(r"^[0-9]{1,7}$")
MAX_INSTANCE_TYPE = 253


@dataclass(frozen=True, slots=True)
class Resources:
    """Per node: cores, GPUs and memory (MiB), ``-1`` for no limit; the instance type or ''."""

    cpu: int = -1
    gpu: int = -1
    mem_mb: int = -1
    instance_type: str = ""


def parse_resources(resources: Mapping[str, str]) -> Resources:
    """Read ``spec.resources``; raises :class:`SpecError` naming the field and the fix."""
    unknown = sorted(set(resources) - set(KNOWN))
    if unknown:
        raise SpecError(f"field 'resources': unknown key(s) {unknown}; known: {sorted(KNOWN)}")
    if "memory" in resources and "memMB" in resources:
        raise SpecError("field 'resources': give 'memory' or 'memMB', not both")
    mem_mb = _count(resources, "memMB") if "memMB" in resources else _memory_mb(resources.get("memory"))
    instance_type = resources.get("instance_type", "")
    if len(instance_type) > MAX_INSTANCE_TYPE or any(c.isspace() for c in instance_type):
        raise SpecError(
            f"field 'resources.instance_type': give a node label value (at most {MAX_INSTANCE_TYPE} "
            "characters, no spaces), e.g. 'm5.xlarge'"
        )
    return Resources(_count(resources, "cpu"), _count(resources, "gpu"), mem_mb, instance_type)


def _count(resources: Mapping[str, str], key: str) -> int:
    if key not in resources:
        return -1
    text = resources[key].strip()
    if text.startswith("-") and _COUNT_RE.match(text[1:]):
        raise SpecError(f"field 'resources.{key}': {resources[key]!r} is negative; give 0 or more")
    if not _COUNT_RE.match(text):
        raise SpecError(
            f"field 'resources.{key}': {resources[key]!r} is not a whole number; give one, e.g. '4'"
        )
    return int(text)


def _memory_mb(text: str | None) -> int:
    if text is None:
        return -1
    match = _MEM_RE.match(text.strip())
    if not match:
        raise SpecError(
            f"field 'resources.memory': {text!r} is not a size; give a size like '16Gi', '512Mi' or bytes"
        )
    size = float(match.group(1)) * _MEM_UNITS.get(match.group(2) or "", 1)
    return max(int(size // 2**20), 1)

"""Failpoints: deliberate faults at named places, armed by ``ELASTRAIN_FAILPOINTS`` (torch-free).

Grammar: ``name=action[@RANK][#NTH][^ATTEMPT]`` items separated by commas, e.g.
``before_publish_rename=kill@0#2^0,during_shard_write=enospc@1``.

* ``action``: ``kill`` (SIGKILL this process), ``raise`` (OSError EIO), ``enospc`` (OSError
  ENOSPC), ``sleep:SECONDS``, or any other word, which :func:`failpoint` returns to the caller to
  act on (the trainer uses ``after_grad_sync=nonfinite``);
* ``@RANK``: only in the process whose env ``RANK`` is RANK;
* ``#NTH``: only at the NTH hit of this name in this process (1-based);
* ``^ATTEMPT``: only when ``TORCHELASTIC_RESTART_COUNT`` is ATTEMPT.

Names used by the checkpoint engine, each named after the durable step it precedes:
``during_shard_write`` (after the first piece of a rank's shard file is written),
``after_shard_write`` (shard file written and fsynced), ``before_report``,
``before_manifest_write`` (rank 0, decision taken), ``before_publish_rename``,
``after_publish_rename`` (step directory renamed, parent not yet fsynced),
``before_latest_update``, ``after_latest_update``, ``before_retention_delete``,
``async_before_write`` (background writer, before any byte is written).

In the service: ``service_before_scale_write`` (a scale request has read the job and holds the
leader fence it will write with; used to pause a leader between its read and its write).
"""

from __future__ import annotations

import errno
import os
import re
import signal
import sys
import time
from dataclasses import dataclass

from worker.errors import ElastrainError
from worker.start import lifeline

ENV = "ELASTRAIN_FAILPOINTS"
_BUILTIN = ("kill", "raise", "enospc")
_ITEM = re.compile(
    r"^(?P<name>[A-Za-z_][\w.-]*)=(?P<action>[A-Za-z_]\w*(?::\d+(?:\.\d+)?)?)(?P<mods>(?:[@#^]\d+)*)$"
)
_MOD = re.compile(r"([@#^])(\d+)")


class FailpointError(ElastrainError):
    """``ELASTRAIN_FAILPOINTS`` could not be parsed."""


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    action: str
    rank: int | None = None
    nth: int | None = None
    attempt: int | None = None

    def applies(self, *, rank: int | None, hit: int, attempt: int | None) -> bool:
        return (
            (self.rank is None or self.rank == rank)
            and (self.nth is None or self.nth == hit)
            and (self.attempt is None or self.attempt == attempt)
        )


def parse(text: str) -> dict[str, tuple[Rule, ...]]:
    """Rules by name. Raises :class:`FailpointError` naming the bad item and the grammar."""
    rules: dict[str, list[Rule]] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        match = _ITEM.match(item)
        if not match:
            raise FailpointError(
                f"{ENV}: cannot parse {item!r}; expected name=action[@RANK][#NTH][^ATTEMPT] with action "
                "kill, raise, enospc, sleep:SECONDS or a word"
            )
        mods: dict[str, int] = {}
        for sign, value in _MOD.findall(match.group("mods")):
            if sign in mods:
                raise FailpointError(f"{ENV}: {item!r} gives {sign} twice")
            mods[sign] = int(value)
        if mods.get("#") == 0:
            raise FailpointError(f"{ENV}: {item!r}: #NTH counts from 1")
        action = match.group("action")
        if action.startswith("sleep") and action != "sleep" and not action.startswith("sleep:"):
            raise FailpointError(f"{ENV}: {item!r}: write sleep:SECONDS")
        if action == "sleep":
            raise FailpointError(f"{ENV}: {item!r}: sleep needs a duration, e.g. sleep:2.5")
        rule = Rule(match.group("name"), action, mods.get("@"), mods.get("#"), mods.get("^"))
        rules.setdefault(rule.name, []).append(rule)
    return {name: tuple(found) for name, found in rules.items()}


def _env_int(key: str) -> int | None:
    raw = os.environ.get(key)
    return int(raw) if raw and raw.isdigit() else None


_cache: tuple[str, dict[str, tuple[Rule, ...]]] | None = None
_hits: dict[str, int] = {}


def failpoint(name: str) -> str | None:
    """Hit failpoint ``name``: kill/raise/enospc/sleep are performed here; another armed action
    is returned; None when nothing applies. Costs one dict lookup when the variable is unset."""
    text = os.environ.get(ENV)
    if not text:
        return None
    global _cache
    if _cache is None or _cache[0] != text:
        _cache = (text, parse(text))
    rules = _cache[1].get(name)
    if not rules:
        return None
    hit = _hits[name] = _hits.get(name, 0) + 1
    rank, attempt = _env_int("RANK"), _env_int("TORCHELASTIC_RESTART_COUNT")
    for rule in rules:
        if rule.applies(rank=rank, hit=hit, attempt=attempt):
            return _perform(rule)
    return None


def _perform(rule: Rule) -> str | None:
    sys.stderr.write(f"elastrain failpoint {rule.name}: {rule.action} (pid {os.getpid()})\n")
    sys.stderr.flush()
    if rule.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # SIGKILL is delivered asynchronously; never continue past a kill
    if rule.action == "raise":
        raise OSError(errno.EIO, f"failpoint {rule.name}: injected I/O error")
    if rule.action == "enospc":
        raise OSError(errno.ENOSPC, f"failpoint {rule.name}: No space left on device (injected)")
    if rule.action.startswith("sleep:"):  # a slow step's work: the lifeline's glances go on in it
        lifeline.nap(float(rule.action.split(":", 1)[1]))
        return None
    return rule.action


def reset_hits() -> None:
    """Forget hit counts (tests)."""
    _hits.clear()

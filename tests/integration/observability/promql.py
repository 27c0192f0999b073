"""Every PromQL expression the project ships (dashboard panels and annotations, alert rules) with
the Grafana variables filled in, and the signals a test asks Prometheus for: an alert
``<signal> > <threshold>`` is asked for its signal, which has data whether or not it fires."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]
VARIABLES = {"$__rate_interval": "1m", "$__range": "5m", "$__interval": "15s", "$job_id": ".*"}
# Defined in service/metrics.py, not yet observed by the service. The test checks the service
# really lacks them, so the list stays true.
NEEDS_SERVICE_WIRING: tuple[str, ...] = ()
_COMPARISONS = ("==", "!=", ">=", "<=", ">", "<")
_NUMBER = re.compile(r"^\s*-?\d+(\.\d+)?([eE][-+]?\d+)?\s*$")


def _fill(expr: str) -> str:
    for name, replacement in VARIABLES.items():
        expr = expr.replace(name, replacement)
    return " ".join(expr.split())


def expressions() -> list[tuple[str, str]]:
    """(where, expression) for every dashboard target and annotation and every rule."""
    out = []
    for path in sorted((ROOT / "deploy" / "grafana").glob("*.json")):
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            out += [(f"{path.name} / {panel['title']}", _fill(t["expr"])) for t in panel["targets"]]
        out += [
            (f"{path.name} / annotation {a['name']}", _fill(a["expr"]))
            for a in board["annotations"]["list"]
            if "expr" in a
        ]
    for path in sorted((ROOT / "deploy" / "prometheus").glob("*rules.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            out += [
                (f"{path.name} / {r.get('alert') or r.get('record')}", _fill(r["expr"]))
                for r in group["rules"]
            ]
    return out


def split_comparison(expr: str) -> tuple[str, str] | None:
    """The two sides of a top-level comparison (outside brackets and strings), or None."""
    depth, quote, i = 0, "", 0
    while i < len(expr):
        c = expr[i]
        if quote:
            quote = "" if c == quote and expr[i - 1] != "\\" else quote
        elif c in "\"'`":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            for op in _COMPARISONS:
                if expr.startswith(op, i) and not expr.startswith("=~", i):
                    rhs = expr[i + len(op) :].strip()
                    return expr[:i].strip(), rhs.removeprefix("bool ").strip()
        i += 1
    return None


def signals(expr: str) -> list[str]:
    """What to ask Prometheus for: the expression, or the non-numeric sides of its comparison."""
    sides = split_comparison(expr)
    if sides is None:
        return [expr]
    return [side for side in sides if not _NUMBER.match(side)]


def exempt_reason(signal: str, *, service_page: str) -> str | None:
    """Why a signal may have no data in the test scenario, or None when it must have data."""
    if "offset 30m" in signal:
        return "compares with half an hour ago: needs 30+ minutes of history"
    for name in NEEDS_SERVICE_WIRING:
        if name in signal:
            assert name not in service_page, (
                f"the service now exports {name}: drop it from NEEDS_SERVICE_WIRING"
            )
            return "defined in service/metrics.py, not yet wired into the service"
    return None

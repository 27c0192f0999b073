"""The ``elastrain`` command. Each sub-command family lives in its own module that
exposes ``register(subparsers)``; the parser sets ``func`` which returns an exit code."""

from __future__ import annotations

import argparse
import importlib
import sys

from worker.errors import ElastrainError

_COMMAND_MODULES = (
    "service.cli.checkpoint",
    "service.cli.jobs",
    "service.cli.report",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastrain", description="Fault-tolerant elastic training.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except ElastrainError as exc:
        print(f"elastrain: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `elastrain jobs | head`
        return 141
    return code

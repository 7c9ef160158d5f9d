"""Command line of deep_ep: ``python -m deep_ep bench ...`` (installed as ``deep-ep``).

Subcommands:
  bench   run and check dispatch + combine for a model preset; see ``python -m deep_ep bench -h``.
  env     what this machine gives deep_ep (versions, GPUs, the JIT's compiler, headers and cache):
          include it in a bug report.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    """The top-level parser with its subcommands."""
    from .bench.cli import add_arguments  # noqa: WPS433

    parser = argparse.ArgumentParser(
        prog=prog, description="deep_ep: expert-parallel dispatch/combine for Mixture-of-Experts.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    add_arguments(sub.add_parser(
        "bench", help="benchmark and check dispatch + combine (CPU gloo ranks, or the GPU path)"))
    sub.add_parser("env", help="what this machine gives deep_ep: versions, GPUs, the JIT's compiler, headers "
                               "and cache (include it in a bug report)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``deep-ep`` and ``python -m deep_ep``; returns the exit code."""
    prog = "python -m deep_ep" if sys.argv and sys.argv[0].endswith("__main__.py") else None
    args = build_parser(prog).parse_args(argv)
    if args.command == "bench":
        from .bench.cli import main as bench_main  # noqa: WPS433

        return bench_main(args)
    if args.command == "env":
        from .environment import report  # noqa: WPS433

        print(report())
        return 0
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())

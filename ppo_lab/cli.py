"""The `ppo-lab` command line."""

from __future__ import annotations

import argparse
import sys

from . import __all__ as exported
from . import __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ppo-lab",
        description="PPO Lab: Proximal Policy Optimization for language models.",
    )
    parser.add_argument("--version", action="version", version=f"ppo-lab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("api", help="list the functions and classes ppo_lab exports")
    args = parser.parse_args(argv)
    if args.command == "api":
        import ppo_lab

        for name in sorted(n for n in exported if not n.startswith("_")):
            doc = (getattr(ppo_lab, name).__doc__ or "").strip().splitlines()
            summary = doc[0] if doc and callable(getattr(ppo_lab, name)) else ""
            print(f"{name:32s} {summary}")
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Entry point of the ``tfscale`` command: registers each subcommand module, nothing else."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from tfscale import __version__
from tfscale.errors import TfscaleError
from tfscale.runtime import chatter, tf_import

__all__ = ["build_parser", "main"]

# Each module has register(subparsers) and run(args) -> int.
_SUBCOMMANDS: tuple[str, ...] = (
    "devices",
    # >>> subcommands added by feature work (one line each) >>>
    "bench",
    "profile",
    "launch",
    "doctor",
    "demo",
    # <<< subcommands added by feature work <<<
)


def build_parser() -> argparse.ArgumentParser:
    """Builds the parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="tfscale",
        description="Use every device TensorFlow can see, and find out why it does not.",
    )
    parser.add_argument("--version", action="version", version=f"tfscale {__version__}")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="keep TensorFlow's start-up messages (oneDNN, CPU features, absl), in this "
        "process and the ones it starts; setting TF_CPP_MIN_LOG_LEVEL yourself does too",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMANDS:
        module = importlib.import_module(f"tfscale.cli.{name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # TensorFlow's start-up chatter (oneDNN, CPU features) buries the command's own output.
    chatter.decide(verbose=bool(args.verbose))
    tf_import.on_import()
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args))
    except TfscaleError as error:
        print(f"tfscale: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tfscale: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

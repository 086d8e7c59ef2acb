"""``tfscale devices``: the devices TensorFlow sees, physical and logical."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    """Adds the ``devices`` subcommand."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "devices", help="list the physical and logical devices TensorFlow sees"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Prints the device list."""
    from rich.console import Console
    from rich.table import Table

    from tfscale.devices.discovery import discover_devices

    infos = discover_devices()
    if args.json:
        print(json.dumps([asdict(i) for i in infos], indent=2))
        return 0
    table = Table(title="Devices seen by TensorFlow")
    for column in ("name", "kind", "physical", "memory", "description"):
        table.add_column(column)
    for info in infos:
        memory = f"{info.memory_bytes / 2**30:.1f} GiB" if info.memory_bytes else "-"
        table.add_row(info.name, info.kind, str(info.physical), memory, info.description)
    Console().print(table)
    return 0

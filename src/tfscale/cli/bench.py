"""``tfscale bench``: scaling sweep, step breakdown, all-reduce bandwidth, advice and a report."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register", "run"]


def _counts(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def register(subparsers: Any) -> None:
    """Adds the ``bench`` subcommand."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="measure how training scales over replicas and say what to change",
        description="Runs the workload at each replica count (logical CPU devices where there "
        "is no GPU) in weak and strong scaling, splits every step into input wait, compute and "
        "exposed communication, benchmarks the all-reduce, and writes report.json, report.md "
        "and report.html with advice whose effect is predicted from the measurements.",
    )
    parser.add_argument("--model", default="mlp", help="mlp, cnn or module:function (default mlp)")
    parser.add_argument("--replicas", type=_counts, default=[1, 2, 4], help="e.g. 1,2,4")
    parser.add_argument("--batch-per-replica", type=int, default=64, metavar="N")
    parser.add_argument("--accumulation", type=_counts, default=[1], help="e.g. 1,4")
    parser.add_argument("--steps", type=int, default=20, metavar="N", help="measured steps")
    parser.add_argument("--warmup", type=int, default=3, metavar="N")
    parser.add_argument(
        "--trace-steps",
        type=int,
        default=3,
        metavar="N",
        help="steps captured with the TF profiler per configuration (0: off)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="measure across N worker processes on this host (MultiWorkerMirroredStrategy "
        "over gRPC, one replica each, as on N machines) instead of over local devices; "
        "--replicas is then ignored",
    )
    parser.add_argument(
        "--project",
        type=_counts,
        default=[],
        metavar="N,N",
        help="also project to these replica counts with the alpha-beta model (rows marked "
        "'projected'), e.g. 8,64,512",
    )
    parser.add_argument(
        "--interconnect",
        default="ethernet-25g",
        help="link between nodes for --project (ethernet-10g, ethernet-25g, roce-25g, "
        "ethernet-100g, ib-edr, ib-hdr, ib-ndr, ...; default ethernet-25g)",
    )
    parser.add_argument(
        "--intra",
        default=None,
        help="link inside a node for --project with --gpus-per-node > 1 (pcie3, pcie4, "
        "nvlink1..nvlink4)",
    )
    parser.add_argument(
        "--gpus-per-node", type=int, default=1, metavar="G", help="replicas per node (--project)"
    )
    parser.add_argument("--no-strong", action="store_true", help="skip strong scaling")
    parser.add_argument("--xla", action="store_true", help="compile the step with XLA")
    parser.add_argument("--out", default="tfscale-bench", metavar="DIR")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="apply the top advice, re-measure, print predicted vs measured",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Runs the sweep and prints the summary."""
    import os
    import sys

    sys.path.insert(0, os.getcwd())  # so that --model module:function finds local modules
    if args.workers <= 1:  # with workers, this process only runs them: no TensorFlow here
        import tensorflow as tf

        # Retracing notes (one Trainer per measured configuration) and "MirroredStrategy
        # used eagerly" (placing the all-reduce benchmark's buffers) are expected here: keep
        # the summary readable.
        tf.get_logger().setLevel("ERROR")
    from tfscale.profiling.bench import profile
    from tfscale.profiling.report import print_summary

    report = profile(
        args.model,
        replicas=args.replicas,
        batch_per_replica=args.batch_per_replica,
        accumulation=args.accumulation,
        steps=args.steps,
        warmup=args.warmup,
        out=args.out,
        verify=args.verify,
        strong=not args.no_strong,
        trace_steps=args.trace_steps,
        jit_compile=args.xla,
        workers=args.workers,
        project=args.project,
        interconnect=args.interconnect,
        intra=args.intra,
        gpus_per_node=args.gpus_per_node,
    )
    print_summary(report, args.out)
    return 0

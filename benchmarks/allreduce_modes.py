"""Packed, bucketed and bucketed + bf16 all-reduce across worker processes (gRPC): exposed
communication and examples/s of one training update, measured in one run.

Two worker processes on 127.0.0.1 (a local job of the launcher, one replica each, as on two
machines: ``MultiWorkerMirroredStrategy``, whose all-reduce crosses processes through
TensorFlow's collective ops over gRPC) train a communication-bound MLP (wide dense layers,
a small batch) with ``tfscale.Trainer`` in five configurations, timed in alternating chunks
so that every configuration sees the same machine load:

- ``packed``: every dense gradient in one all-reduce per dtype (tfscale's default);
- ``bucketed``: buckets of ``--bucket-mib`` MiB, each reduced as soon as its gradients exist;
- ``bucketed + bf16`` / ``+ fp16``: the same buckets all-reduced in bfloat16 / float16 (half
  the bytes, plus a cast each way);
- ``no all-reduce``: each replica applies its own gradient; the same step without a byte
  crossing between the processes.

Exposed communication = a configuration's step minus the no-all-reduce step. Worker 0's
timings are printed (both workers run the same steps in lockstep).

Between two processes of one machine the "link" is memory: gRPC's copies and serialization
cost CPU time that does not halve with the bytes, and both workers share the cores. A link
between machines is bandwidth-bound; ``--link-mbit R`` (Linux, root: ``tc``) makes the
loopback such a link for the workers' traffic only: each worker's gRPC server sends at most
R Mbit/s (an HTB class per worker port on ``lo``, matched by source port: the tensors of
TensorFlow's collectives travel in the responses of the worker that holds them), removed
afterwards.

    python benchmarks/allreduce_modes.py [--width 2048] [--batch 16] [--steps 30]
        [--bucket-mib 4] [--link-mbit R] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

MODES = ("packed", "bucketed", "bucketed + bf16", "bucketed + fp16")
FEATURES, CLASSES, EXAMPLES = 512, 10, 2048


def _model(width: int) -> Any:
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(CLASSES),
        ]
    )
    model.compile(
        keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def worker(settings: dict[str, Any]) -> None:
    """One worker: the four configurations, timed interleaved; worker 0 writes the result."""
    import numpy as np

    from tfscale.profiling.harness import MeasuredStep, Workload, strategy_for
    from tfscale.profiling.steptime import robust_means, time_interleaved

    width, batch = int(settings["width"]), int(settings["batch"])
    rng = np.random.default_rng(0)
    workload = Workload(
        "wide-mlp",
        lambda: _model(width),
        rng.standard_normal((EXAMPLES, FEATURES)).astype(np.float32),
        rng.integers(0, CLASSES, EXAMPLES).astype(np.int32),
    )
    strategy = strategy_for(())  # the cluster's MultiWorkerMirroredStrategy
    bucket = int(float(settings["bucket_mib"]) * 2**20)
    steps = {
        "packed": MeasuredStep(workload, (), batch),
        "bucketed": MeasuredStep(workload, (), batch, bucket_bytes=bucket),
        "bucketed + bf16": MeasuredStep(
            workload, (), batch, bucket_bytes=bucket, gradient_compression="bf16"
        ),
        "bucketed + fp16": MeasuredStep(
            workload, (), batch, bucket_bytes=bucket, gradient_compression="fp16"
        ),
    }
    packed = steps["packed"]
    assert packed.without_reduce is not None
    runs = [(s.with_reduce, s.examples_per_step) for s in steps.values()]
    runs.append((packed.without_reduce, packed.examples_per_step))
    times = time_interleaved(runs, steps=int(settings["steps"]), warmup=3)
    for step in steps.values():
        step.close()  # their input iterators prefetch until destroyed
    means = [sum(robust_means(t)) for t in times]
    local = means[-1]
    gradient_bytes = sum(packed.gradient_sizes)
    result = {
        "replicas": int(strategy.num_replicas_in_sync),
        "gradient_bytes": gradient_bytes,
        "bucket_bytes": bucket,
        "global_batch": packed.examples_per_step,
        "no_allreduce_step_s": local,
        "modes": {
            mode: {
                "step_s": step,
                "exposed_s": max(step - local, 0.0),
                "examples_per_s": packed.examples_per_step / step,
            }
            for mode, step in zip(MODES, means, strict=False)
        },
    }
    if settings["out"] and os.environ.get("TF_CONFIG", "").find('"index": 0') >= 0:
        with open(settings["out"], "w") as handle:
            json.dump(result, handle)


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def shaped_link(ports: list[int], mbit: float | None) -> Iterator[None]:
    """Each of ``ports``' senders limited to ``mbit`` Mbit/s on the loopback (see the module
    doc); nothing when ``mbit`` is None. The loopback's queueing is restored afterwards."""
    if mbit is None:
        yield
        return
    if shutil.which("tc") is None or os.geteuid() != 0:
        raise SystemExit(
            f"--link-mbit {mbit:g} shapes the loopback with tc, which needs Linux, root and "
            "the tc command; run without --link-mbit, or as root"
        )
    _tc("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "1")
    try:
        _tc("class", "add", "dev", "lo", "parent", "1:", "classid", "1:1", "htb", "rate", "100gbit")
        for index, port in enumerate(ports):
            classid = f"1:{10 + index}"
            rate = f"{mbit:g}mbit"
            _tc("class", "add", "dev", "lo", "parent", "1:", "classid", classid, "htb",
                "rate", rate, "ceil", rate)  # fmt: skip
            _tc("filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1",
                "u32", "match", "ip", "sport", str(port), "0xffff", "flowid", classid)  # fmt: skip
        yield
    finally:
        _tc("qdisc", "del", "dev", "lo", "root")


def _port_base(count: int) -> int:
    from tfscale.errors import LaunchError
    from tfscale.launch.ports import check_ports

    for _ in range(50):
        base = random.randint(20000, 40000)
        try:
            check_ports(base, count)
        except LaunchError:
            continue
        return base
    raise SystemExit(f"no {count} consecutive free ports found between 20000 and 40000")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16, help="per replica")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--bucket-mib", type=float, default=4.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument(
        "--link-mbit", type=float, default=None,
        help="limit each worker's sending to this many Mbit/s (tc on lo; root)",
    )  # fmt: skip
    parser.add_argument("--json", default=None, help="also write the result here")
    parser.add_argument("--worker-settings", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_settings:
        worker(json.loads(args.worker_settings))
        return 0

    from tfscale.launch.local import run_local_job
    from tfscale.launch.plan import LocalJob

    with tempfile.TemporaryDirectory(prefix="tfscale-allreduce-") as tmp:
        out = os.path.join(tmp, "result.json")
        settings = {
            "width": args.width,
            "batch": args.batch,
            "steps": args.steps,
            "bucket_mib": args.bucket_mib,
            "out": out,
        }
        env = dict(os.environ)
        env.pop("TFSCALE_VIRTUAL_DEVICES", None)  # one replica per worker
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        job = LocalJob(
            script=(os.path.abspath(__file__), "--worker-settings", json.dumps(settings)),
            workers=args.workers,
            gpus_per_worker=0,
        )
        print(f"{args.workers} workers measuring (about a minute) ...", file=sys.stderr)
        base = _port_base(args.workers)
        with shaped_link(list(range(base, base + args.workers)), args.link_mbit):
            done = run_local_job(
                job, timeout_s=args.timeout, base_env=env, output_dir=tmp, log=lambda _: None,
                port_base=base,
            )  # fmt: skip
        if done.exit_code != 0 or not os.path.exists(out):
            for name in sorted(os.listdir(tmp)):
                if name.endswith(".log"):
                    with open(os.path.join(tmp, name)) as handle:
                        print(f"--- {name}\n{handle.read()[-3000:]}", file=sys.stderr)
            return done.exit_code or 1
        with open(out) as handle:
            result = json.load(handle)
    result["link_mbit"] = args.link_mbit
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    modes = result["modes"]
    packed = modes["packed"]
    link = "loopback" if args.link_mbit is None else f"loopback shaped to {args.link_mbit:g} Mbit/s"
    print(
        f"{result['replicas']} worker processes (gRPC, {link}), gradients "
        f"{result['gradient_bytes'] / 2**20:.1f} MiB, global batch {result['global_batch']}, "
        f"buckets {result['bucket_bytes'] / 2**20:g} MiB; step without all-reduce "
        f"{1000 * result['no_allreduce_step_s']:.1f} ms"
    )
    print(
        f"{'mode':<16} {'step ms':>8} {'exposed comm ms':>16} {'vs packed':>10} "
        f"{'examples/s':>11} {'vs packed':>10}"
    )
    for mode in MODES:
        m = modes[mode]
        print(
            f"{mode:<16} {1000 * m['step_s']:8.1f} {1000 * m['exposed_s']:16.1f} "
            f"{m['exposed_s'] / packed['exposed_s']:9.2f}x {m['examples_per_s']:11.0f} "
            f"{m['examples_per_s'] / packed['examples_per_s']:9.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

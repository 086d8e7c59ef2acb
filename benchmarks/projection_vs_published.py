"""The α-β projection of ``tfscale bench --project`` against published multi-GPU runs.

For each published configuration, the projection gets what ``bench`` would measure on one
device (the one-GPU step: global batch per GPU / the published one-GPU images/s) and the
gradient bytes (float32 parameters of the Keras application model, counted here), and
projects the run at the published GPU count over the published interconnect with
tfscale's presets (nominal line rates). The projected scaling efficiency is compared with
the published one (images/s at N GPUs / (N x images/s at 1 GPU)).

Sources:
- [TF] tensorflow/docs, site/en/r1/guide/performance/benchmarks.md (tf_cnn_benchmarks, May
  2017): DGX-1 with 8 P100 (NVLink), VGG16 "replicated (with NCCL)", synthetic data; Amazon
  EC2 distributed, 8 p2.8xlarge instances x 8 K80 (PCIe inside, 10 Gb/s between), synthetic
  data, ``distributed_replicated``.
- [Horovod] Sergeev and Del Balso, "Horovod: fast and easy distributed deep learning in
  TensorFlow", arXiv:1802.05799 (2018): 128 Pascal GPUs, 4 per server, 25 GbE (TCP):
  88% scaling efficiency for Inception V3, 68% for VGG-16; the one-GPU step is taken from
  [TF]'s P100 figure at batch 64 (an assumption: the paper gives efficiencies, not its
  one-GPU images/s).

    python benchmarks/projection_vs_published.py
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from tfscale.profiling.projection import interconnect, project


@dataclass(frozen=True)
class Published:
    source: str
    model: str
    batch: int
    gpus: int
    one_gpu_images_s: float
    n_gpu_images_s: float | None  # None: the source gives the efficiency itself
    efficiency: float | None
    inter: str
    intra: str | None
    per_node: int


RUNS = [
    Published("TF DGX-1", "VGG16", 64, 8, 154, 1081, None, "nvlink1", None, 1),
    Published("TF DGX-1", "VGG16", 32, 8, 144, 820, None, "nvlink1", None, 1),
    Published("TF EC2 K80", "ResNet50", 64, 64, 52.4, 2744, None, "ethernet-10g", "pcie3", 8),
    Published("TF EC2 K80", "InceptionV3", 64, 64, 29.7, 1783, None, "ethernet-10g", "pcie3", 8),
    Published("TF EC2 K80", "ResNet152", 32, 64, 19.4, 981, None, "ethernet-10g", "pcie3", 8),
    Published("Horovod", "InceptionV3", 64, 128, 142, None, 0.88, "ethernet-25g", None, 1),
    Published("Horovod", "VGG16", 64, 128, 154, None, 0.68, "ethernet-25g", None, 1),
]


def parameters(name: str) -> int:
    import keras

    return int(getattr(keras.applications, name)(weights=None).count_params())


def main() -> int:
    counts = {name: parameters(name) for name in sorted({r.model for r in RUNS})}
    print(
        f"{'source':<11} {'model':<12} {'batch':>5} {'GPUs':>5} {'interconnect':<22} "
        f"{'MiB':>6} {'published':>9} {'projected':>9} {'error':>8}"
    )
    errors = []
    for run in RUNS:
        published = run.efficiency or run.n_gpu_images_s / (run.gpus * run.one_gpu_images_s)
        (row,) = project(
            local_step_s=run.batch / run.one_gpu_images_s,
            gradient_bytes=4 * counts[run.model],
            batch_per_replica=run.batch,
            replicas=[run.gpus],
            inter=interconnect(run.inter),
            intra=interconnect(run.intra) if run.intra else None,
            per_node=run.per_node,
        )
        error = row.efficiency - published
        errors.append(abs(error))
        links = run.inter + (f" + {run.intra}/{run.per_node}" if run.intra else "")
        print(
            f"{run.source:<11} {run.model:<12} {run.batch:>5} {run.gpus:>5} {links:<22} "
            f"{4 * counts[run.model] / 2**20:6.0f} {100 * published:8.1f}% "
            f"{100 * row.efficiency:8.1f}% {100 * error:+7.1f}"
        )
    print(f"mean absolute error: {100 * sum(errors) / len(errors):.1f} points of efficiency")
    return 0


if __name__ == "__main__":
    sys.exit(main())

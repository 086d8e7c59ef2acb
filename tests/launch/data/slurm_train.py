"""A task of the real-Slurm tests: mwms_train's model and data, and what each task saw.

Usage: slurm_train.py OUT_DIR [--epochs E] [--checkpoint-dir DIR] [--crash-once-at EPOCH:BATCH]

Every task writes OUT_DIR/task{SLURM_PROCID}-{attempt}.json when training starts (Slurm's job,
step and rank, the strategy's kind and replicas, its worker index, the cluster of its
TF_CONFIG, the update it starts from) and OUT_DIR/task{SLURM_PROCID}.npz with its final
weights, so the test compares the weights of both tasks, not only the chief's. With
--crash-once-at the task of rank 1 SIGKILLs itself after that batch on the job's first
attempt (TFSCALE_LAUNCH_ATTEMPT 0: the sbatch script's restart loop exports it).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import keras
import mwms_train
import numpy as np

import tfscale


class _Record(keras.callbacks.Callback):
    def __init__(self, path: str, facts: dict[str, Any]) -> None:
        super().__init__()
        self._path = path
        self._facts = facts

    def on_train_begin(self, logs: Any = None) -> None:
        record = self._facts | {"start_step": int(self.model.optimizer.iterations.numpy())}
        with open(self._path, "w") as handle:
            json.dump(record, handle)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--crash-once-at")
    args = parser.parse_args()
    choice = tfscale.choose_strategy(strict=True)
    rank = int(os.environ["SLURM_PROCID"])
    attempt = os.environ.get("TFSCALE_LAUNCH_ATTEMPT", "0")
    cluster = choice.cluster
    facts = {
        "rank": rank,
        "attempt": attempt,
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "step_id": os.environ.get("SLURM_STEP_ID"),
        "kind": choice.kind,
        "replicas": choice.strategy.num_replicas_in_sync,
        "workers": None if cluster is None else cluster.num_workers,
        "task_index": None if cluster is None else cluster.task_index,
        "cluster": json.loads(os.environ["TF_CONFIG"])["cluster"],
        "pid": os.getpid(),
    }
    record = os.path.join(args.out_dir, f"task{rank}-{attempt}.json")
    callbacks: list[Any] = [_Record(record, facts)]
    if args.crash_once_at and attempt == "0" and rank == 1:
        epoch, batch = (int(v) for v in args.crash_once_at.split(":"))
        callbacks.append(mwms_train._CrashOnce(epoch, batch))
    _, weights = mwms_train.train(
        choice.strategy, epochs=args.epochs, checkpoint_dir=args.checkpoint_dir, callbacks=callbacks
    )
    np.savez(os.path.join(args.out_dir, f"task{rank}.npz"), *weights)
    replicas = choice.strategy.num_replicas_in_sync
    print(f"task {rank}: {choice.kind} with {replicas} replicas: done", flush=True)


if __name__ == "__main__":
    main()

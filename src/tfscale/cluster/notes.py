"""What a launched job's tasks and its launcher tell each other, TensorFlow-free.

``tfscale launch`` gives each task a report folder (:data:`REPORT_ENV`); a worker leaves its
verdict there (``launch/together.py``) and the chief's ``tfscale.fit`` notes where its
latest checkpoint is (:func:`write_checkpoint_note`), so that the launcher's last line can
say where to resume from. Both sides import this module, so training never imports the
launcher.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "CHECKPOINT_NOTE",
    "REPORT_ENV",
    "CheckpointNote",
    "read_checkpoint_note",
    "write_checkpoint_note",
]

#: The folder where a launched job's tasks leave their verdicts and notes (set by the
#: launcher for each job).
REPORT_ENV = "TFSCALE_LAUNCH_REPORT_DIR"

#: The file, in the job's report folder, where the chief notes its latest checkpoint (not a
#: ``.json``: those are the workers' verdicts, ``launch/together.py``).
CHECKPOINT_NOTE = "checkpoint.note"


@dataclass(frozen=True)
class CheckpointNote:
    """Where the chief's latest checkpoint is (``tfscale.fit(checkpoint_dir=...)``).

    Attributes:
        directory: The checkpoint folder.
        path: The latest checkpoint's prefix.
        epoch: The epoch it resumes at.
        batches: Global batches of that epoch already trained.
        updates: ``optimizer.iterations`` at the save.
    """

    directory: str
    path: str
    epoch: int
    batches: int
    updates: int


def write_checkpoint_note(folder: str, note: CheckpointNote) -> None:
    """Notes ``note`` in ``folder`` (replaced atomically: the launcher may read it any time)."""
    target = os.path.join(folder, CHECKPOINT_NOTE)
    partial = target + ".partial"
    with open(partial, "w", encoding="utf-8") as handle:
        json.dump(note.__dict__, handle)
    os.replace(partial, target)


def read_checkpoint_note(folder: str) -> CheckpointNote | None:
    """The note in ``folder``, or None when the job wrote none (or it cannot be read)."""
    try:
        with open(os.path.join(folder, CHECKPOINT_NOTE), encoding="utf-8") as handle:
            data: Mapping[str, object] = json.load(handle)
        return CheckpointNote(**data)  # type: ignore[arg-type]
    except (OSError, ValueError, TypeError):
        return None

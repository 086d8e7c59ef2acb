"""A TF-free worker for elastic launcher tests: one slot dies on every start.

Usage: elastic_sleeper.py OUT_DIR DIE_LABEL FINISH_AT. Writes OUT_DIR/<label>-<attempt>.json
(its pid, TF_CONFIG, the cluster size); the task labelled DIE_LABEL (``worker 2``) then
SIGKILLs itself, as a machine that fails for good; the others exit 0 when the cluster has at
most FINISH_AT workers, else wait (to be stopped by the launcher). Worker 0 notes a
checkpoint in the launcher's report folder, as ``tfscale.fit(checkpoint_dir=...)`` does.
"""

import json
import os
import signal
import sys
import time

from tfscale.cluster.notes import CheckpointNote, write_checkpoint_note

out_dir, die_label, finish_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
config = json.loads(os.environ["TF_CONFIG"])
label = os.environ["TFSCALE_LAUNCH_TASK"]
attempt = os.environ["TFSCALE_LAUNCH_ATTEMPT"]
workers = len(config["cluster"]["worker"])
record = {"pid": os.getpid(), "tf_config": config, "workers": workers}
path = os.path.join(out_dir, f"{label.replace(' ', '')}-{attempt}.json")
with open(path + ".tmp", "w") as handle:
    json.dump(record, handle)
os.rename(path + ".tmp", path)
if config["task"]["index"] == 0:
    ck = os.path.join(out_dir, "ck")
    note = CheckpointNote(ck, os.path.join(ck, "ckpt-7"), 1, 3, 7)
    write_checkpoint_note(os.environ["TFSCALE_LAUNCH_REPORT_DIR"], note)
if label == die_label:
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)
if workers <= finish_at:
    sys.exit(0)
time.sleep(60)

"""A TF-free worker for launcher tests: reports its TF_CONFIG and pids, then waits or exits.

Usage: sleeper.py OUT_DIR [EXIT_CODE]. Writes OUT_DIR/<label>.json with its pid, the pid of a
child it starts (to check that the whole process group is stopped) and its environment's
TF_CONFIG / TFSCALE_* values; then, with EXIT_CODE, exits with it once every task of its
attempt has written its file (so that the first to fail cannot stop a peer before it has),
else sleeps 120 s.
"""

import json
import os
import subprocess
import sys
import time

out_dir = sys.argv[1]
config = json.loads(os.environ["TF_CONFIG"])
label = f"{config['task']['type']}{config['task']['index']}"
child = subprocess.Popen(["sleep", "120"])
record = {
    "pid": os.getpid(),
    "child": child.pid,
    "tf_config": config,
    "virtual_devices": os.environ.get("TFSCALE_VIRTUAL_DEVICES"),
    "attempt": os.environ.get("TFSCALE_LAUNCH_ATTEMPT"),
}
path = os.path.join(out_dir, f"{label}-{record['attempt']}.json")
with open(path + ".tmp", "w") as handle:
    json.dump(record, handle)
os.rename(path + ".tmp", path)
print(f"hello from {label}", flush=True)
if len(sys.argv) > 2:
    tasks = sum(len(addresses) for addresses in config["cluster"].values())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if (
            len([n for n in os.listdir(out_dir) if n.endswith(f"-{record['attempt']}.json")])
            >= tasks
        ):
            break
        time.sleep(0.02)
    child.kill()
    child.wait()
    sys.exit(int(sys.argv[2]))
time.sleep(120)

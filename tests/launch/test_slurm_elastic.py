"""The elastic sbatch loop's decisions with fakes: srun's stderr, node states, the nodes left.

The real one-node cluster runs the printed loop in test_slurm_cluster.py: one node shows the
failed node named, counted and refused below the minimum; leaving a node out of the next
step needs two nodes, so it is shown here from srun's and scontrol's own text.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tfscale.cluster.notes import CheckpointNote, write_checkpoint_note
from tfscale.launch.slurm import sbatch_script
from tfscale.launch.slurm_elastic import (
    StepState,
    decide,
    failed_node,
    next_step,
    srun_options,
    unusable_nodes,
)

from .slurm_cluster import SlurmCluster

_ROOT = Path(__file__).resolve().parents[2]

# What srun printed on the one-node cluster (Slurm 22.05) when task 1 was SIGKILLed under
# --kill-on-bad-exit=1: the failed task first, then the ones srun stopped.
_SRUN_KILLED = """srun: error: n2: task 1: Killed
srun: launch/slurm: _step_signal: Terminating StepId=1.0
slurmstepd-n1: error: *** STEP 1.0 ON n1 CANCELLED AT 2026-11-26T06:09:46 ***
srun: error: n1: task 0: Terminated
srun: error: n3: tasks 2-3: Terminated
srun: Force Terminated StepId=1.0
"""
_NODES = (
    "NodeName=n1 Arch=x86_64 State=ALLOCATED ThreadsPerCore=1\n"
    "NodeName=n2 Arch=x86_64 State=ALLOCATED ThreadsPerCore=1\n"
    "NodeName=n3 Arch=x86_64 State=IDLE+DRAIN ThreadsPerCore=1\n"
    "NodeName=n4 Arch=x86_64 State=MIXED* ThreadsPerCore=1\n"
)


def test_failed_node_is_the_first_task_srun_names() -> None:
    assert failed_node(_SRUN_KILLED) == ("n2", "Killed")
    assert failed_node("srun: error: n1: task 0: Exited with exit code 3\n") == (
        "n1",
        "Exited with exit code 3",
    )
    assert failed_node("srun: error: Unable to allocate resources: busy\n") is None


def test_unusable_nodes_are_drained_down_or_not_responding() -> None:
    assert unusable_nodes(_NODES) == {"n3", "n4"}
    assert unusable_nodes("") == set()


def _decide(state: StepState, failure: tuple[str, str] | None, unusable: set[str] = set()):  # type: ignore[no-untyped-def] # noqa: B006
    return decide(state, failure, unusable, max_restarts=2, min_workers=4, tasks_per_node=2)


def test_a_node_failing_on_every_start_is_left_out_after_its_restarts() -> None:
    state = StepState(nodes=["n1", "n2", "n3"])
    assert _decide(state, ("n2", "Killed")).restart and srun_options(state, 2) == ""
    assert _decide(state, ("n2", "Killed")).restart
    last = _decide(state, ("n2", "Killed"))
    assert last.restart and last.drop is not None and last.drop.label == "node n2"
    assert state.left == ["n1", "n3"] and state.failed == []
    assert srun_options(state, 2) == "--nodes=2 --ntasks=4 --exclude=n2"


def test_an_unusable_node_is_left_out_at_once() -> None:
    state = StepState(nodes=["n1", "n2", "n3"])
    decision = _decide(state, ("n1", "Terminated"), {"n3"})
    assert decision.drop is not None and decision.drop.label == "node n3"
    assert srun_options(state, 2) == "--nodes=2 --ntasks=4 --exclude=n3"


def test_different_nodes_failing_end_the_loop_and_below_the_minimum_too() -> None:
    flaky = StepState(nodes=["n1", "n2", "n3"])
    for node in ("n1", "n2"):
        assert _decide(flaky, (node, "Killed")).restart
    decision = _decide(flaky, ("n3", "Killed"))
    assert not decision.restart and decision.below is None and decision.drop is None
    two = StepState(nodes=["n1", "n2"])
    for _ in range(2):
        _decide(two, ("n2", "Killed"))
    below = _decide(two, ("n2", "Killed"))
    assert not below.restart and below.below is not None
    assert below.below.workers_left == 2 and two.left == ["n1", "n2"]


def test_next_step_turns_of_the_loop(tmp_path: Path) -> None:
    env = {"SLURM_JOB_NODELIST": "n[1-2]"}
    report = tmp_path / "report"
    report.mkdir()
    write_checkpoint_note(str(report), CheckpointNote("/ck", "/ck/ckpt-9", 1, 2, 9))

    def turn(attempt: int | None, stderr: str = _SRUN_KILLED, minimum: int = 1):  # type: ignore[no-untyped-def]
        if attempt is not None:
            (tmp_path / f"srun-{attempt}.err").write_text(stderr)
        return next_step(
            str(tmp_path), attempt=attempt, max_restarts=0, min_workers=minimum,
            tasks_per_node=1, report_dir=str(report), env=env, scontrol_nodes=lambda n: "",
        )  # fmt: skip

    status, options, line = turn(0)
    assert (status, options) == (0, "--nodes=1 --ntasks=1 --exclude=n2")
    assert "leaving out node n2 (its task: Killed); restarting the step on n1" in line
    assert json.loads((tmp_path / "state.json").read_text())["excluded"] == ["n2"]
    status, options, line = turn(None)
    assert (status, options) == (0, "")
    assert (
        line == "tfscale: finished on 1 of 2 workers: dropped node n2 (its task: Killed on 1 start)"
    )
    status, options, line = turn(1, "srun: error: n1: task 0: Killed\n")
    assert (status, options) == (1, "")
    assert "fewer than --min-workers 1 (lost: node n2, node n1)" in line
    assert "resume from /ck/ckpt-9 (epoch 1, batch 2, update 9)" in line


@pytest.mark.multiprocess
def test_the_printed_elastic_loop_runs_steps_on_the_nodes_left(tmp_path: Path) -> None:
    """The loop as bash runs it, with srun and tfscale replaced by fakes that record their
    arguments: node n2 kills its task on every start; the second step runs without it."""
    text = sbatch_script(["train.py"], nodes=2, max_restarts=0, min_workers=1)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n"
        f'echo "srun $*" >> {calls}\n'
        'case "$*" in *--exclude=n2*) exit 0 ;; esac\n'
        'echo "srun: error: n2: task 1: Killed" >&2\n'
        "exit 137\n"
    )
    (bin_dir / "tfscale").write_text(
        f'#!/bin/bash\necho "tfscale $*" >> {calls}\nexec {_python()} -m tfscale.cli.main "$@"\n'
    )
    for tool in ("srun", "tfscale"):
        (bin_dir / tool).chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = _env(bin_dir, {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"})
    done = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    sruns = [line for line in calls.read_text().splitlines() if line.startswith("srun")]
    assert len(sruns) == 2
    assert "--exclude" not in sruns[0]
    assert sruns[1].startswith("srun --kill-on-bad-exit=1 --nodes=1 --ntasks=1 --exclude=n2 ")
    assert "TFSCALE_LAUNCH_ATTEMPT" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "tfscale: finished on 1 of 2 workers: dropped node n2 (its task: Killed on 1 start)"
    )
    assert not (tmp_path / ".tfscale-7").exists()  # the report folder is removed


def _python() -> str:
    import sys

    return sys.executable


def _env(bin_dir: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(extra, PATH=f"{bin_dir}:{env['PATH']}", PYTHONPATH=str(_ROOT / "src"))
    return env


@pytest.mark.parametrize("minimum", [3])
def test_sbatch_refuses_a_minimum_above_the_workers(minimum: int) -> None:
    from tfscale.cli.main import main

    assert main(["launch", "--slurm", "--print-sbatch", "--nodes", "2",
                 "--min-workers", str(minimum), "t.py"]) == 2  # fmt: skip


# Task 1 SIGKILLs itself on every start, as a task on a broken machine; task 0 would wait
# (srun --kill-on-bad-exit stops it).
_KILLED = (
    "import os, signal, time\n"
    "if os.environ['SLURM_PROCID'] == '1':\n"
    "    time.sleep(0.5)\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n"
    "time.sleep(120)\n"
)


@pytest.mark.slurm
@pytest.mark.multiprocess
@pytest.mark.xdist_group("slurm-cluster")  # the process whose session holds the cluster
def test_elastic_sbatch_on_a_real_node_names_the_node_and_stops_below_the_minimum(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """The printed elastic loop under sbatch on the one-node cluster: the node of the task
    that failed is read from the real srun's stderr, counted over the starts and, since
    leaving it out would leave no worker, the loop ends with the job's last line. (Restarting
    on the nodes left needs a second node: shown above with srun's text.)"""
    from tfscale.processes import run

    from .slurm_cluster import free_port_bases, tfscale_bin

    cluster = slurm_cluster
    folder = cluster.root / "jobs" / "elastic"
    folder.mkdir(parents=True)
    (folder / "killed.py").write_text(_KILLED)
    bin_dir = tfscale_bin(cluster.root / "bin")
    env = {"PYTHONPATH": str(_ROOT / "src"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    port = free_port_bases(1, 2)[0]
    options = ["--nodes", "1", "--tasks-per-node", "2", "--time", "00:05:00", "--name",
               "elastic", "--port", str(port), "--max-restarts", "1", "--min-workers", "2",
               str(folder / "killed.py")]  # fmt: skip
    command = ["tfscale", "launch", "--slurm", "--print-sbatch", *options]
    printed = run(command, timeout=60, env=cluster.env | env, cwd=folder)
    assert printed.returncode == 0, printed.stderr
    script = folder / "job.sbatch"
    script.write_text(printed.stdout or "")
    job_id = cluster.submit(script, env=env, cwd=folder)
    fields = cluster.wait_job(job_id, 180)
    output = (folder / f"elastic-{job_id}.out").read_text(errors="replace")
    assert fields["JobState"] == "FAILED", output
    assert output.count("srun: error: ") >= 2 and "task 1: Killed" in output
    assert "tfscale: job step failed (status 143), attempt 0" in output, output  # srun's 143
    assert "tfscale: job step failed (status 143), attempt 1" in output, output
    last = output.strip().splitlines()[-1]
    assert last == (
        f"tfscale: job failed: node {cluster.node} (its task: Killed on 2 starts in a row), "
        "and without it 0 worker(s) would be left, fewer than --min-workers 2 "
        f"(lost: node {cluster.node}); no checkpoint was noted (resume needs "
        "tfscale.fit(checkpoint_dir=...))"
    ), output
    assert not list(folder.glob(".tfscale-*"))  # the report folder is removed
    assert cluster.processes(folder) == []

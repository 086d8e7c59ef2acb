"""A real one-node Slurm cluster for the tests: munged, slurmctld and slurmd, as root.

Debian's ``munge``, ``slurmctld`` and ``slurmd`` (``.ci/run`` installs them) run in the
foreground (``-F`` / ``-D``) as children of the test process, through
:mod:`tfscale.processes`, so they die with it even when pytest is killed. Everything they
write (munge key and socket, slurm.conf, state, spool, logs, the jobs' files) lives in one
private folder; nothing system-wide is touched. The node is this machine (``NodeName`` =
``hostname -s``, ``NodeAddr`` 127.0.0.1) with the CPUs ``slurmd -C`` reports, in one
partition that jobs share (``OverSubscribe=FORCE``), so several test jobs run at once.
Commands reach the cluster through ``SLURM_CONF`` (:attr:`SlurmCluster.env`).

:func:`start_cluster` raises :class:`UnavailableError`, with the reason, where this cannot run:
not root, a program missing, or the daemons not up within :data:`START_TIMEOUT_S`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tfscale.launch.ports import free_ports
from tfscale.processes import Child, Completed, run, start
from tfscale.testing import alive

START_TIMEOUT_S = 30.0
_COMMAND_TIMEOUT_S = 30.0
_PROGRAMS = (
    "munged",
    "slurmctld",
    "slurmd",
    "srun",
    "sbatch",
    "scontrol",
    "squeue",
    "scancel",
    "sinfo",
)
_SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")
#: Job states after which a job does nothing more (``scontrol show job``'s ``JobState``).
_ENDED = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}


class UnavailableError(Exception):
    """The cluster cannot run here; the message says why (the tests skip with it)."""


@dataclass
class SlurmCluster:
    """A running one-node cluster.

    Attributes:
        root: The private folder of the cluster and its jobs.
        env: The environment for Slurm commands and jobs: this process's, without Slurm
            variables of an enclosing allocation, with ``SLURM_CONF``.
        node: The node's name.
    """

    root: Path
    env: dict[str, str]
    node: str
    daemons: list[Child] = field(default_factory=list)

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float = _COMMAND_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> Completed:
        """Runs a Slurm command (``srun ...``, ``sbatch ...``) against this cluster."""
        return run(argv, timeout=timeout, env=self.env | dict(env or {}), cwd=cwd or self.root)

    def submit(
        self, script: Path, *, env: Mapping[str, str] | None = None, cwd: Path | None = None
    ) -> int:
        """``sbatch script``; returns the job id."""
        done = self.run(["sbatch", "--parsable", str(script)], env=env, cwd=cwd)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {script} failed ({done.returncode}): {done.stderr}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (``JobState``, ``ExitCode``, ``StdOut``, ...)."""
        done = self.run(["scontrol", "show", "job", "--oneliner", str(job_id)])
        if done.returncode != 0:
            raise RuntimeError(f"scontrol show job {job_id}: {done.stderr}")
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout))

    def wait_job(self, job_id: int, timeout: float) -> dict[str, str]:
        """Polls until the job has ended; returns its fields.

        Raises:
            TimeoutError: Still not ended after ``timeout`` seconds (it is cancelled).
        """
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in _ENDED:
                return fields
            if time.monotonic() > deadline:
                self.run(["scancel", str(job_id)])
                raise TimeoutError(f"job {job_id} still {fields.get('JobState')} after {timeout} s")
            time.sleep(1.0)

    def stop(self) -> None:
        """Cancels what still runs, stops the daemons and checks that no process is left.

        Raises:
            RuntimeError: Processes of the cluster outlived it (they have been killed).
        """
        try:
            if len(self.daemons) == 3 and all(d.poll() is None for d in self.daemons):
                self.run(["scancel", "--user", str(os.getuid())])
                _wait_until(lambda: not self._queue(), 30.0)
        finally:
            for daemon in reversed(self.daemons):  # slurmd, slurmctld, then munged
                daemon.stop(5.0)
                daemon.close()
        left = _wait_until(lambda: not self.processes(), 10.0)
        if not left:
            stray = self.processes()
            for pid in stray:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            raise RuntimeError(f"processes of the Slurm cluster outlived it: {stray}")
        shutil.rmtree(self.root, ignore_errors=True)

    def processes(self, under: Path | None = None) -> list[int]:
        """Live processes working in ``under`` (default: the cluster's folder): its daemons,
        their helpers and every job step (``slurmstepd`` leaves the daemons' process groups
        and sessions; jobs run with their working directory in the cluster's folder)."""
        folder = str(under or self.root)
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                cwd = os.readlink(f"/proc/{entry}/cwd")
                if (cwd == folder or cwd.startswith(f"{folder}/")) and alive(int(entry)):
                    found.append(int(entry))
        return found

    def _queue(self) -> list[str]:
        done = self.run(["squeue", "--noheader", "--format=%i"])
        return done.stdout.split() if done.returncode == 0 else []

    def logs(self) -> str:
        """The tail of each daemon's log, for messages about a cluster that failed."""
        tails = []
        for name in ("munged", "slurmctld", "slurmd"):
            path = self.root / f"{name}.log"
            text = path.read_text(errors="replace") if path.exists() else ""
            tails.append(f"--- {name}.log\n" + "\n".join(text.splitlines()[-15:]))
        return "\n".join(tails)


def _wait_until(ready: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if ready():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def free_port_bases(count: int, width: int) -> list[int]:
    """``count`` first ports, each with the ``width`` ports from it free on 127.0.0.1 now."""
    bases: list[int] = []
    held: list[socket.socket] = []
    try:
        candidate = 20000 + os.getpid() % 20000
        while len(bases) < count and candidate < 60000:
            block = []
            try:
                for port in range(candidate, candidate + width):
                    s = socket.socket()
                    block.append(s)
                    s.bind(("127.0.0.1", port))
            except OSError:
                for s in block:
                    s.close()
            else:
                bases.append(candidate)
                held += block
            candidate += width
        if len(bases) < count:
            raise RuntimeError(f"{count} blocks of {width} free ports not found")
        return bases
    finally:
        for s in held:
            s.close()


def _node_cpus(env: Mapping[str, str]) -> int:
    done = run(["slurmd", "-C"], timeout=_COMMAND_TIMEOUT_S, env=env)
    match = re.search(r"\bCPUs=(\d+)", done.stdout or "")
    return int(match.group(1)) if match else max(1, os.cpu_count() or 1)


def _slurm_conf(root: Path, node: str, cpus: int, ports: Sequence[int]) -> str:
    return f"""\
ClusterName=tfscale-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
# Seconds between SIGTERM and SIGKILL when a step is stopped (default 30): a
# MultiWorkerMirrored worker whose peer died can outlive SIGTERM (docs/launch.md).
KillWait=5
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


def _missing(path: str) -> str | None:
    if os.geteuid() != 0:
        return "the one-node Slurm cluster runs its daemons as root; this is not root"
    absent = [p for p in _PROGRAMS if shutil.which(p, path=path) is None]
    if absent:
        return (
            f"Slurm/munge not installed ({', '.join(absent)} missing): "
            "apt-get install slurmctld slurmd slurm-client munge (.ci/run does)"
        )
    return None


def start_cluster() -> SlurmCluster:
    """Starts munged, slurmctld and slurmd in a fresh private folder; returns when the node
    takes jobs.

    Raises:
        UnavailableError: Not root, a program missing, or the cluster not up in time.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    # The daemons live in sbin, which a user's PATH may lack.
    path = env.get("PATH", os.defpath).split(os.pathsep)
    env["PATH"] = os.pathsep.join(path + [d for d in _SBIN if d not in path])
    reason = _missing(env["PATH"])
    if reason:
        raise UnavailableError(reason)
    # munged wants every folder above its socket searchable by all (pytest's tmp_path
    # folders are 0700), so the cluster gets its own folder in the temp dir.
    root = Path(tempfile.mkdtemp(prefix="tfscale-slurm-")).resolve()
    root.chmod(0o711)
    for sub in ("munge", "state", "spool"):
        (root / sub).mkdir(mode=0o700)
    (root / "munge").chmod(0o711)
    key = root / "munge" / "munge.key"
    with open(key, "wb") as handle:
        handle.write(os.urandom(128))
    key.chmod(0o400)
    node = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, node, _node_cpus(env), free_ports(2)))
    env["SLURM_CONF"] = str(conf)
    cluster = SlurmCluster(root, env, node)
    daemons = [
        (
            "munged",
            [
                "munged",
                "--foreground",
                f"--key-file={key}",
                f"--socket={root}/munge/socket",
                f"--pid-file={root}/munge/munged.pid",
                f"--seed-file={root}/munge/munged.seed",
            ],
        ),
        # In the foreground the daemons log to stderr: {name}.log.
        ("slurmctld", ["slurmctld", "-D", "-f", str(conf)]),
        ("slurmd", ["slurmd", "-D", "-f", str(conf)]),
    ]
    try:
        for name, argv in daemons:
            with open(root / f"{name}.log", "wb") as out:
                cluster.daemons.append(start(argv, env=env, cwd=root, stdout=out, stderr=out))
            if name == "munged" and not _wait_until(
                lambda: (root / "munge" / "socket").exists(), START_TIMEOUT_S
            ):
                raise UnavailableError(f"munged did not create its socket in {START_TIMEOUT_S} s")
        if not _wait_until(lambda: _node_ready(cluster), START_TIMEOUT_S):
            raise UnavailableError(
                f"the Slurm node did not become idle within {START_TIMEOUT_S} s\n{cluster.logs()}"
            )
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _node_ready(cluster: SlurmCluster) -> bool:
    if any(d.poll() is not None for d in cluster.daemons):
        codes = [d.returncode for d in cluster.daemons]
        raise UnavailableError(f"a Slurm daemon exited (codes {codes})\n{cluster.logs()}")
    done = cluster.run(["sinfo", "--noheader", "--format=%t"], timeout=10.0)
    return done.returncode == 0 and done.stdout.strip() == "idle"


def tfscale_bin(folder: Path) -> Path:
    """A folder with a ``tfscale`` command running this interpreter's tfscale (what the
    console script does), for ``PATH`` in jobs: the sbatch script calls ``tfscale``."""
    folder.mkdir(parents=True, exist_ok=True)
    command = folder / "tfscale"
    command.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m tfscale.cli.main "$@"\n')
    command.chmod(0o755)
    return folder

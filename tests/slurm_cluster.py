"""A one-node Slurm cluster started from scratch in a temporary directory (for tests).

``SlurmCluster(root).start()`` writes a munge key and a minimal ``slurm.conf`` under
``root``, starts ``munged``, ``slurmctld`` and ``slurmd`` in the foreground of their own
processes on free ports, waits until the node is idle, and ``stop()`` ends exactly those
processes. Client commands (srun, sbatch, scancel, squeue) find the cluster through the
``env`` it exposes (``SLURM_CONF``). Needs root (slurmd runs jobs as their owner) and
Debian's slurm-wlm and munge packages.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def why_not_runnable() -> str | None:
    """A one-line reason this machine cannot run the daemons, or None."""
    missing = [d for d in (*DAEMONS, "srun", "sbatch") if shutil.which(d) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs, and these tests are not root"
    return None


class SlurmCluster:
    """One node (this host, ``cpus`` CPUs declared) in one partition ``debug``."""

    def __init__(self, root: Path, cpus: int = 8) -> None:
        self.root, self.cpus = Path(root), cpus
        self.host = socket.gethostname().split(".")[0]
        self.procs: list[subprocess.Popen] = []
        self.conf = self.root / "slurm.conf"
        self.socket = self.root / "munge" / "munge.socket"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def _write_config(self) -> None:
        r = self.root
        for d in ("munge", "state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        (r / "munge").chmod(0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        lines = [
            "ClusterName=meshtron-test",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            "SlurmUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire is also how long a requeued job waits before it may start again
            # (default 120 s); a test cluster need not wait that long.
            f"AuthInfo=socket={self.socket},cred_expire=5",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "ReturnToService=2",
            # Declare more CPUs than the machine has, so one node can run several ranks.
            "SlurmdParameters=config_overrides",
            "JobRequeue=1",
            "SchedulerParameters=sched_interval=1",  # look at pending jobs every second
            "MinJobAge=300",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, *cmd: str) -> None:
        log = open(self.root / "log" / f"{Path(cmd[0]).name}.out", "ab")  # noqa: SIM115
        self.procs.append(
            subprocess.Popen(
                cmd,
                env=self.env,
                cwd=self.root,  # never the checkout: the repository guard watches it
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    def start(self, timeout: float = 30.0) -> SlurmCluster:
        """Start the three daemons and wait until the node takes jobs."""
        self._write_config()
        m = self.root / "munge"
        self._spawn(
            "munged",
            "--foreground",
            "--force",
            f"--socket={self.socket}",
            f"--key-file={m / 'munge.key'}",
            f"--pid-file={m / 'munged.pid'}",
            f"--log-file={m / 'munged.log'}",
            f"--seed-file={m / 'munged.seed'}",
        )
        self._wait(lambda: self.socket.exists(), timeout, "munged did not create its socket")
        self._spawn("slurmctld", "-D", "-i", "-f", str(self.conf))
        self._spawn("slurmd", "-D", "-f", str(self.conf), "-N", self.host)
        self._wait(self._node_idle, timeout, "the node did not become idle")
        return self

    def _node_idle(self) -> bool:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%T"],
            env=self.env,
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip().startswith("idle")

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"{what} ({', '.join(dead) or 'timeout'}); {self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        """The tail of every daemon log, for failure messages."""
        out = []
        for path in sorted((self.root / "log").glob("*")) + [self.root / "munge" / "munged.log"]:
            if path.exists():
                out.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-1500:])
        return "\n".join(out)

    def stop(self) -> None:
        """Cancel leftover jobs, then end the daemons this object started (newest first)."""
        subprocess.run(
            ["scancel", "--full", "-u", "root"],
            env=self.env,
            cwd=self.root,
            capture_output=True,
            timeout=10,
        )
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def run(self, *cmd: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        """A client command against this cluster (run in the cluster's folder unless ``cwd``)."""
        kw.setdefault("cwd", self.root)
        return subprocess.run(
            cmd,
            env={**self.env, **kw.pop("env", {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            **kw,
        )

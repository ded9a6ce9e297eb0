"""A real single-node Slurm cluster on localhost for the tests: munged, slurmctld and slurmd (Debian's
slurm-wlm 22.05 and munge, installed by the Makefile), each with its own key, socket, ports, state and
logs under one temporary folder, started as root and stopped by PID.

    with SlurmCluster(tmp) as sl:
        job = sl.sbatch(script)
        sl.wait(job, "COMPLETED")
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from trainscale.runtime.parallel.mesh import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue")


def slurm_missing() -> str | None:
    """Why a Slurm cluster cannot be started here, or None."""
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if missing:
        return f"Slurm/munge not installed ({', '.join(missing)}); `make venv` installs slurm-wlm and munge"
    if os.geteuid() != 0:
        return "the test Slurm cluster runs its daemons as root"
    return None


def _exe(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    def __init__(self, root: Path, cpus: int = 4) -> None:
        self.root = Path(root)
        self.cpus = cpus
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.pids: dict[str, Path] = {}

    # ------------------------------------------------------------------ life cycle

    def start(self) -> SlurmCluster:
        r = self.root
        for d in ("state", "spool", "log", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        (r / "munge").chmod(0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = r / "munge" / "munge.socket"
        subprocess.run([_exe("munged"), "--force", f"--key-file={key}", f"--socket={sock}",
                        f"--pid-file={r / 'munge' / 'munged.pid'}", f"--log-file={r / 'munge' / 'munged.log'}",
                        f"--seed-file={r / 'munge' / 'seed'}"], check=True, capture_output=True, timeout=30)
        self.pids["munged"] = r / "munge" / "munged.pid"
        ctl, slurmd = free_port(), free_port()
        self.conf.write_text("\n".join([
            "ClusterName=trainscale-test",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={ctl}", f"SlurmdPort={slurmd}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            # a requeued job waits cred_expire seconds before it may start again (default 120 s); the tests'
            # jobs requeue themselves, so the wait is short here
            f"AuthInfo=socket={sock},cred_expire=10",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            # no cgroups in a container: plain process tracking, no task binding, no accounting
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SchedulerType=sched/backfill",
            # a requeued job, once eligible, starts at the next scheduling pass: every 5 s, not 60 (main) or 30
            "SchedulerParameters=bf_interval=5,sched_interval=5",
            "MpiDefault=none", "SwitchType=switch/none", "ReturnToService=2", "JobRequeue=1",
            # the node's CPU count is the test's, not the hardware's
            "SlurmdParameters=config_overrides",
            "MinJobAge=600",
            # a job at its time limit is killed then (no grace minutes), SIGKILL 5 s after SIGTERM (default 30)
            "OverTimeLimit=0", "KillWait=5",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=8000 State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))
        subprocess.run([_exe("slurmctld"), "-i"], env=self.env, check=True, capture_output=True, timeout=30)
        self.pids["slurmctld"] = r / "slurmctld.pid"
        subprocess.run([_exe("slurmd")], env=self.env, check=True, capture_output=True, timeout=30)
        self.pids["slurmd"] = r / "slurmd.pid"
        deadline = time.time() + 60
        while time.time() < deadline:
            p = self.run("sinfo", "-h", "-o", "%T", check=False)
            if p.returncode == 0 and p.stdout.strip() == "idle":
                return self
            time.sleep(0.5)
        raise RuntimeError(f"Slurm did not come up: {self.logs()}")

    def stop(self) -> None:
        for name in ("slurmd", "slurmctld", "munged"):
            pidfile = self.pids.get(name)
            if pidfile is None or not pidfile.exists():
                continue
            try:
                pid = int(pidfile.read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
                for _ in range(50):
                    os.kill(pid, 0)
                    time.sleep(0.1)
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, ValueError, IndexError):
                pass

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ jobs

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=60, check=check)

    def sbatch(self, script: Path, cwd: Path | None = None) -> int:
        p = subprocess.run(["sbatch", "--parsable", str(script)], env=self.env, capture_output=True, text=True,
                           timeout=60, cwd=cwd)
        if p.returncode:
            raise RuntimeError(f"sbatch failed: {p.stderr}")
        return int(p.stdout.strip().split(";")[0])

    def state(self, job: int) -> str:
        p = self.run("scontrol", "show", "job", str(job), check=False)
        m = re.search(r"JobState=(\S+)", p.stdout)
        return m.group(1) if m else "UNKNOWN"

    def wait(self, job: int, until: tuple[str, ...] = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                      "NODE_FAIL", "OUT_OF_MEMORY"),
             timeout: float = 600) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            s = self.state(job)
            if s in until:
                return s
            time.sleep(0.5)
        raise TimeoutError(f"job {job} still {self.state(job)} after {timeout} s")

    def requeue(self, job: int) -> None:
        """Requeue a running job and let it start again at once (Slurm holds a requeued job ~2 min by
        default through its begin time)."""
        self.run("scontrol", "requeue", str(job))
        deadline = time.time() + 60
        while self.state(job) != "PENDING" and time.time() < deadline:
            time.sleep(0.2)
        self.run("scontrol", "update", f"jobid={job}", "starttime=now")

    def logs(self) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*.log")):
            out.append(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-20:]))
        return "\n".join(out)

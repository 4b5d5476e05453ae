"""A real, throwaway single-node Slurm cluster (munged, slurmctld, slurmd) on localhost, for the
end-to-end tests of the Slurm backend. No systemd: the three daemons run in the foreground as
children of the test process, with everything they write (config, state, spool, logs, the munge
socket and key) in one temporary folder under /tmp.

Test modules take the module-scoped fixture by importing it::

    from tests.slurm_cluster import slurm_cluster  # noqa: F401

and drive the cluster's CLI with ``cluster.run("sbatch", ...)`` (or any process started with
``cluster.env``). It is skipped, with the reason, where a cluster cannot start here (see
``why_not``): it needs root, Slurm's and munge's programs (``make test`` installs Debian's
slurm-wlm and munge as root) and cgroup v1's memory and freezer controllers.

Several clusters may run at once (pytest-xdist's workers, another session, a cluster started by
hand on Slurm's default ports): each has its own ports, its own munge socket, and a node name of
its own. The node name matters: Debian builds Slurm with --enable-multiple-slurmd, and slurmd
keeps its jobs' cgroups under /sys/fs/cgroup/<controller>/slurm_<nodename>/, so two clusters
with the same node name would share (and tear down) each other's cgroups.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest

from oomguard.daemon.launch.slurm_text import parse_fields  # the daemon's reading of scontrol's lines
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")
DAEMONS = ("slurmctld", "slurmd", "munged", "mungekey")
CGROUP_V1 = Path("/sys/fs/cgroup")
# cgroup v1 controllers that slurmd's plugins use: task/cgroup (memory) and proctrack/cgroup (freezer).
CONTROLLERS = ("memory", "freezer")
START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
# How long stop() waits for cancelled jobs to end (slurmstepd outlives slurmd: a job still running
# when slurmd stops would be left behind): KillWait (5 s) and some.
DRAIN_TIMEOUT = 15.0


def _binary(name: str) -> str | None:
    # The daemons are in /usr/sbin, which a non-login root shell's PATH may lack.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")


def why_not() -> str | None:
    """Why a cluster cannot be started here, or None when it can."""
    if os.geteuid() != 0:
        return "a Slurm cluster needs root (euid 0): slurmd runs jobs as their users and makes their cgroups"
    missing = [name for name in (*CLIENTS, *DAEMONS) if _binary(name) is None]
    if missing:
        return f"Slurm or munge is not installed (missing: {', '.join(missing)}); `make test` installs slurm-wlm and munge as root"
    for controller in CONTROLLERS:
        if not (CGROUP_V1 / controller / "tasks").is_file():
            return f"no cgroup v1 {controller} controller at {CGROUP_V1 / controller} (the cluster's cgroup.conf uses CgroupPlugin=cgroup/v1)"
    probe = Path(tempfile.mkdtemp(prefix="og-slurm-probe-", dir="/tmp"))
    try:
        os.mknod(probe / "gpu", stat.S_IFCHR | 0o666, os.makedev(195, 0))
    except OSError as error:
        return f"cannot make the fake GPUs' device nodes (mknod: {error.strerror}): no CAP_MKNOD here"
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return None


def _free_ports(count: int) -> list[int]:
    """Ports nothing listens on now, all different (the sockets stay open until all are picked)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _client_env(conf: Path) -> dict[str, str]:
    # A test session run inside a Slurm job (or a shell with a cluster's SLURM_CONF) must not
    # leak that job's or cluster's SLURM_* variables into commands meant for this cluster.
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    env["SLURM_CONF"] = str(conf)
    env["PATH"] = env.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin"
    return env


class SlurmCluster:
    """One cluster: ``start()`` makes and starts it, ``stop()`` ends it and removes its folder."""

    def __init__(self, base: Path, ngpu: int, ctld_port: int, slurmd_port: int) -> None:
        self.base = base
        self.ngpu = ngpu
        self.ctld_port = ctld_port
        self.slurmd_port = slurmd_port
        # Unique among the clusters running now: its slurmd's port is taken while it runs.
        self.node = f"og{slurmd_port}"
        self.conf = base / "etc" / "slurm.conf"
        self.munge_socket = base / "munge" / "munge.socket.2"
        self.env = _client_env(self.conf)
        self.processes: dict[str, subprocess.Popen] = {}
        self.start_seconds: float | None = None

    # --- starting ---------------------------------------------------------------------------

    @classmethod
    def start(cls, ngpu: int = 2, attempts: int = 3) -> SlurmCluster:
        """A new cluster with ``ngpu`` fake GPUs, its node idle. A port picked free can be taken
        before the daemon binds it (by another cluster, or as an outgoing connection's local
        port): a start that fails that way is retried on new ports."""
        reason = why_not()
        if reason is not None:
            raise RuntimeError(reason)
        for attempt in range(attempts):
            base = Path(tempfile.mkdtemp(prefix="og-slurm-", dir="/tmp"))
            cluster = cls(base, ngpu, *_free_ports(2))
            try:
                cluster._start()
                return cluster
            except Exception as error:
                cluster.stop()
                if attempt + 1 < attempts and "Address already in use" in str(error):
                    continue
                raise
        raise AssertionError("unreachable")

    def _start(self) -> None:
        began = time.monotonic()
        for folder in ("etc", "state", "spool", "log", "run", "munge", "fakegpu"):
            (self.base / folder).mkdir()
        # Other users' sbatch (the backend's multi-user tests) must reach the config and the munge socket.
        self.base.chmod(0o755)
        (self.base / "munge").chmod(0o755)
        self._write_config()
        self._start_munged()
        self._spawn("slurmctld", "slurmctld", "-D", "-i", "-f", str(self.conf))
        self._spawn("slurmd", "slurmd", "-D", "-N", self.node, "-f", str(self.conf))
        self._wait_idle()
        self.start_seconds = time.monotonic() - began

    def _write_config(self) -> None:
        # The node's hardware as slurmd sees it: "NodeName=vm CPUs=2 Boards=1 ... RealMemory=24105".
        probe = subprocess.run([_binary("slurmd"), "-C"], capture_output=True, text=True, timeout=30, env=self.env)
        if probe.returncode != 0:
            raise RuntimeError(f"slurmd -C exited {probe.returncode}: {probe.stderr.strip()}")
        hardware = probe.stdout.splitlines()[0].split(" ", 1)[1]
        base = self.base
        gres = f" Gres=gpu:{self.ngpu}" if self.ngpu else ""
        self.conf.write_text(
            f"""\
ClusterName=og
SlurmctldHost=localhost
SlurmctldPort={self.ctld_port}
SlurmdPort={self.slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket},cred_expire=10
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
ReturnToService=2
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool
SlurmctldPidFile={base}/run/slurmctld.pid
SlurmdPidFile={base}/run/slurmd.pid
SlurmctldLogFile={base}/log/slurmctld.log
SlurmdLogFile={base}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
SchedulerParameters=sched_interval=1
MinJobAge=600
KillWait=5
GresTypes=gpu
NodeName={self.node} NodeAddr=127.0.0.1 NodeHostname=localhost {hardware}{gres} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
"""
        )
        gres_lines = ["AutoDetect=off"]
        for index in range(self.ngpu):
            os.mknod(base / "fakegpu" / f"nvidia{index}", stat.S_IFCHR | 0o666, os.makedev(195, index))
        if self.ngpu:
            gres_lines.append(f"NodeName={self.node} Name=gpu File={base}/fakegpu/nvidia[0-{self.ngpu - 1}]")
        (base / "etc" / "gres.conf").write_text("\n".join(gres_lines) + "\n")
        (base / "etc" / "cgroup.conf").write_text(
            "CgroupPlugin=cgroup/v1\nConstrainRAMSpace=yes\nConstrainSwapSpace=yes\nConstrainDevices=no\n"
        )

    def _start_munged(self) -> None:
        key = self.base / "munge" / "munge.key"
        made = subprocess.run([_binary("mungekey"), "--create", f"--keyfile={key}"], capture_output=True, text=True, timeout=30)
        if made.returncode != 0:
            raise RuntimeError(f"mungekey exited {made.returncode}: {made.stderr.strip()}")
        key.chmod(0o600)
        # Its own socket, key, log and seed: a system munged (one apt started, on
        # /run/munge/munge.socket.2) or another cluster's is never used.
        self._spawn(
            "munged", "munged", "--foreground", "--force",
            f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={self.base}/run/munged.pid", f"--seed-file={self.base}/munge/munged.seed",
            f"--log-file={self.base}/log/munged.log",
        )
        deadline = time.monotonic() + 10
        while not self.munge_socket.is_socket():
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged made no socket at {self.munge_socket} in 10 s\n{self.logs()}")
            time.sleep(0.02)

    def _spawn(self, name: str, *argv: str) -> None:
        with open(self.base / "log" / f"{name}.out", "wb") as out:
            self.processes[name] = subprocess.Popen(
                [_binary(argv[0]), *argv[1:]], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=self.env, cwd=self.base, start_new_session=True, preexec_fn=_die_with_parent,
            )

    def _check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited {process.returncode} while the cluster started\n{self.logs()}")

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        state = ""
        while True:
            self._check_alive()
            try:
                result = self.run("sinfo", "-h", "-N", "-o", "%T", timeout=5)
                state = result.stdout.strip() if result.returncode == 0 else result.stderr.strip()
            except subprocess.TimeoutExpired:
                state = "sinfo got no answer in 5 s"
            if state == "idle":
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node is {state!r}, not idle, after {START_TIMEOUT:.0f} s\n{self.logs()}")
            time.sleep(0.1)

    # --- using ------------------------------------------------------------------------------

    def run(self, *argv: str, timeout: float = 30, check: bool = False) -> subprocess.CompletedProcess[str]:
        """A Slurm command (``run("sbatch", "--parsable", script)``) against this cluster."""
        return subprocess.run([_binary(argv[0]) or argv[0], *argv[1:]], capture_output=True, text=True, env=self.env, timeout=timeout, check=check)

    def job(self, job_id: str | int) -> dict[str, str] | None:
        """``scontrol show job -o`` as fields, None when the controller does not know the job."""
        result = self.run("scontrol", "show", "job", "-o", str(job_id))
        if result.returncode != 0 or not result.stdout.strip():
            return None
        return parse_fields(result.stdout.splitlines()[0])

    def logs(self, lines: int = 20) -> str:
        """The last lines of each daemon's log and output, for a failure's message."""
        parts = []
        for path in sorted((self.base / "log").glob("*")) if (self.base / "log").is_dir() else []:
            try:
                tail = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            if tail:
                parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    # --- stopping ---------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel every job, end the daemons (slurmd, slurmctld, munged: SIGTERM, then SIGKILL
        after 10 s), kill what is left in the node's cgroups and remove the folder."""
        if self.processes.get("slurmctld") is not None and self.processes["slurmctld"].poll() is None:
            try:
                self._cancel_jobs()
            except (subprocess.TimeoutExpired, OSError):
                pass  # a controller that does not answer: the jobs' processes go with the cgroups below
        for name in ("slurmd", "slurmctld", "munged"):
            process = self.processes.get(name)
            if process is not None:
                _end(process)
        self._clean_cgroups()
        shutil.rmtree(self.base, ignore_errors=True)

    def _cancel_jobs(self) -> None:
        listed = self.run("squeue", "-h", "-o", "%i", timeout=10)
        ids = listed.stdout.split() if listed.returncode == 0 else []
        if not ids:
            return
        self.run("scancel", *ids, timeout=10)
        deadline = time.monotonic() + DRAIN_TIMEOUT
        while time.monotonic() < deadline:
            listed = self.run("squeue", "-h", "-t", "RUNNING,COMPLETING,SUSPENDED,CONFIGURING", "-o", "%i", timeout=10)
            if listed.returncode != 0 or not listed.stdout.strip():
                return
            time.sleep(0.2)

    def _clean_cgroups(self) -> None:
        """Processes still in this node's cgroups (a job's tasks, a slurmstepd that outlived
        slurmd) are this cluster's: kill them and remove the cgroups, deepest first."""
        tops = [CGROUP_V1 / controller / f"slurm_{self.node}" for controller in os.listdir(CGROUP_V1) if (CGROUP_V1 / controller / f"slurm_{self.node}").is_dir()] if CGROUP_V1.is_dir() else []
        for top in tops:
            for folder, _, _ in os.walk(top):
                try:
                    pids = (Path(folder) / "cgroup.procs").read_text().split()
                except OSError:
                    continue
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
        deadline = time.monotonic() + 5
        for top in tops:
            for folder, _, _ in sorted(os.walk(top), key=lambda entry: -entry[0].count("/")):
                while True:
                    try:
                        os.rmdir(folder)
                        break
                    except FileNotFoundError:
                        break
                    except OSError:  # busy: a killed process not gone yet
                        if time.monotonic() > deadline:
                            break
                        time.sleep(0.05)

    def __repr__(self) -> str:
        return f"SlurmCluster(base={str(self.base)!r}, node={self.node!r}, ports={self.ctld_port}/{self.slurmd_port})"


def _die_with_parent() -> None:
    """In the daemon's child before exec: SIGTERM when the test process dies (killed, or a
    crash that skips stop()), so that no cluster outlives its session."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _end(process: subprocess.Popen) -> None:
    """SIGTERM, up to STOP_TIMEOUT to exit, then SIGKILL; then whatever is left in its process
    group (slurmctld's slurmscriptd) is killed."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(STOP_TIMEOUT)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def wait_for_state(cluster: SlurmCluster, job_id: str | int, states: str | Collection[str], timeout: float = 30) -> dict[str, str]:
    """Poll ``scontrol show job -o`` until the job's JobState is one of ``states``; its fields."""
    wanted = {states} if isinstance(states, str) else set(states)
    deadline = time.monotonic() + timeout
    fields = None
    while True:
        fields = cluster.job(job_id)
        if fields is not None and fields.get("JobState") in wanted:
            return fields
        if time.monotonic() > deadline:
            state = fields.get("JobState") if fields else "unknown to the controller"
            raise AssertionError(f"job {job_id} is {state}, not {'/'.join(sorted(wanted))}, after {timeout} s: {fields}\n{cluster.logs()}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A cluster with 2 fake GPUs for a test module; skipped, with the reason, where none can start."""
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    cluster = SlurmCluster.start(ngpu=2)
    try:
        yield cluster
    finally:
        cluster.stop()

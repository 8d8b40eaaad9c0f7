"""A real multi-node Slurm 22.05 cluster on this machine, for tests (see shared/notes/slurm-lab.md).

    lab = SlurmLab.start()     # installs packages if missing (apt-get), starts munge, MariaDB,
    ...                        # slurmdbd, slurmctld and 4 slurmd nodes with 4 fake GPUs each
    lab.stop()                 # scancel everything, then stop every daemon by its PID

All files (configs, state, logs, pid files) live under one directory (default /tmp/nereus-slurm-lab);
the daemons read the configuration through SLURM_CONF, so nothing under /etc/slurm is touched.
There is no systemd here: every daemon is started by hand in the foreground as a child of this
process and stopped by its PID, never by name. A stale lab left by a killed run is stopped first
through its pid files. ``LabUnavailable`` says why a lab cannot exist here (not root, no apt).

Several test processes share one lab: ``SlurmLab.acquire()`` starts it or joins a healthy one,
``release()`` stops it when the last user leaves, ``exclusive()`` serialises tests across processes.

Run by hand:  .venv/bin/python tests/slurm/lab.py up|down
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

TEMPLATES = Path(__file__).with_name("templates")
PACKAGES = ("munge", "slurm-client", "slurmctld", "slurmd", "slurmdbd", "mariadb-server")
BINARIES = ("munged", "slurmctld", "slurmd", "slurmdbd", "mariadbd", "sbatch", "squeue", "scontrol")
DEFAULT_ROOT = Path("/tmp/nereus-slurm-lab")
# Ports well away from the usual ones (Slurm 6817-6819, MySQL 3306, nereusd 7501/7502).
PORTS = {"ctld": 26817, "dbd": 26819, "mysql": 23306, "slurmd_first": 26901}


class LabUnavailable(RuntimeError):
    """A Slurm lab cannot run on this machine; the message says why (for pytest.skip)."""


class LabFailed(RuntimeError):
    """The lab could have started but did not; the message points at the log to read."""


def _run(argv: list[str], timeout_s: float = 60.0, check: bool = True, env: dict[str, str] | None = None,
         input_text: str | None = None) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env, input=input_text)
    except subprocess.TimeoutExpired:
        if check:
            raise LabFailed(f"{' '.join(argv)} did not finish within {timeout_s:.0f} s") from None
        return subprocess.CompletedProcess(argv, 124, "", f"timed out after {timeout_s:.0f} s")
    if check and proc.returncode != 0:
        raise LabFailed(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return proc


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.1) -> object:
    """Poll ``predicate`` until it returns something truthy; raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie (PID 1 reaps late here, so kill -0 is not enough)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def ensure_installed(log: Callable[[str], None] = print) -> None:
    """Install the Slurm, munge and MariaDB packages with apt-get, only if a binary is missing."""
    if os.geteuid() != 0:
        raise LabUnavailable("the Slurm lab needs root (it starts munged, slurmctld and slurmd nodes)")
    if all(shutil.which(b, path="/usr/sbin:/usr/bin:/sbin:/bin") for b in BINARIES):
        return
    if shutil.which("apt-get") is None:
        raise LabUnavailable("Slurm is not installed and apt-get is missing (not a Debian-like machine)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # wait for a dpkg lock held by someone else's apt instead of failing at once
    install = ["apt-get", "install", "-y", "-q", "-o", "DPkg::Lock::Timeout=300", "--no-install-recommends",
               *PACKAGES]
    t0 = time.monotonic()
    proc = _run(install, timeout_s=600, check=False, env=env)
    if proc.returncode != 0:  # a fresh machine may have no package lists yet
        _run(["apt-get", "update", "-q", "-o", "DPkg::Lock::Timeout=300"], timeout_s=300, check=False, env=env)
        proc = _run(install, timeout_s=600, check=False, env=env)
    if proc.returncode != 0:
        raise LabUnavailable(f"apt-get cannot install {' '.join(PACKAGES)}: {proc.stderr.strip()[-500:]}")
    log(f"slurm lab: installed {' '.join(PACKAGES)} in {time.monotonic() - t0:.1f} s")


@dataclass
class SlurmLab:
    """A running lab cluster: its directory, its nodes and the environment that reaches it."""

    root: Path = DEFAULT_ROOT
    num_nodes: int = 4
    gpus_per_node: int = 4
    cpus_per_node: int = 8
    partition: str = "gpu"
    urgent_partition: str = "urgent"  # higher PriorityTier: its jobs preempt (cancel) jobs in `gpu`
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    started_s: float = 0.0

    # --- paths and environment ------------------------------------------------------------------
    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(f"node{i}" for i in range(1, self.num_nodes + 1))

    @property
    def env(self) -> dict[str, str]:
        """os.environ plus SLURM_CONF: pass it to every Slurm command and to daemons under test."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def run(self, *argv: str, timeout_s: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command against this lab."""
        return _run(list(argv), timeout_s=timeout_s, check=check, env=self.env)

    # --- life cycle -------------------------------------------------------------------------------
    # Several test processes (pytest-xdist workers, or two engineers' runs) may want the lab at once.
    # They share one cluster: ``acquire`` starts it unless a healthy one runs, and registers the
    # process as a user; ``release`` unregisters and stops the cluster when no live user is left;
    # ``exclusive`` serialises the tests themselves (a test downs nodes and cancels everything).
    @classmethod
    def start(cls, root: Path | str = DEFAULT_ROOT, log: Callable[[str], None] = print, **kw: int) -> SlurmLab:
        """Start a fresh lab (stopping whatever ran there before); see ``acquire`` to share one."""
        lab = cls(root=Path(root), **kw)  # type: ignore[arg-type]
        with lab._flock(".lock"):  # one installer and one starter at a time
            ensure_installed(log)
            lab._fresh_start(log)
        return lab

    @classmethod
    def acquire(cls, root: Path | str = DEFAULT_ROOT, log: Callable[[str], None] = print, **kw: int) -> SlurmLab:
        lab = cls(root=Path(root), **kw)  # type: ignore[arg-type]
        with lab._flock(".lock"):  # one installer and one starter at a time
            ensure_installed(log)
            others = lab._live_users()
            if others and lab.healthy():
                log(f"slurm lab: joined the running lab under {lab.root} (users: {sorted(others)})")
            else:
                lab._fresh_start(log)
            lab._users_dir.mkdir(parents=True, exist_ok=True)
            (lab._users_dir / str(os.getpid())).touch()
        return lab

    def release(self) -> None:
        with self._flock(".lock"):
            (self._users_dir / str(os.getpid())).unlink(missing_ok=True)
            if not self._live_users():
                self.stop()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[SlurmLab]:
        """Hold the lab alone for one test, then cancel every job and bring every node back."""
        with self._flock(".test.lock"):
            try:
                yield self
            finally:
                self.cancel_all()
                self.resume_all_nodes()

    @property
    def _users_dir(self) -> Path:
        return Path(str(self.root) + ".users")

    def _live_users(self) -> set[int]:
        live = set()
        for entry in self._users_dir.glob("*") if self._users_dir.is_dir() else ():
            pid = int(entry.name) if entry.name.isdigit() else -1
            if pid != os.getpid() and pid_alive(pid):
                live.add(pid)
            elif pid != os.getpid():
                entry.unlink(missing_ok=True)  # a user that died without releasing
        return live

    def healthy(self) -> bool:
        return self.conf.exists() and self.run("scontrol", "ping", timeout_s=10, check=False).returncode == 0 \
            and set(self.nodes) <= set(self.node_states())

    def _fresh_start(self, log: Callable[[str], None]) -> None:
        self._stop_stale()
        t0 = time.monotonic()
        try:
            self._write_configs()
            self._start_munge()
            self._start_mariadb()
            self._start_slurmdbd()
            self._start_slurmctld()
            self._start_slurmds()
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - t0
        log(f"slurm lab: {self.num_nodes} nodes up in {self.started_s:.1f} s under {self.root}")

    def stop(self) -> None:
        """scancel every job first (else slurmstepd dies and srun hangs), then stop daemons by PID.

        Works from any process: the PIDs come from the lab's pid files, not only from this process.
        """
        pids = self._pid_files()
        if "slurmctld" in pids and pid_alive(pids["slurmctld"]):
            self.run("scancel", "--full", "--user", "root", timeout_s=10, check=False)
            with contextlib.suppress(TimeoutError):
                wait_for(lambda: not self.active_jobs(), 20, "jobs to end before teardown", 0.2)
        order = [f"slurmd.{n}" for n in reversed(self.nodes)] + ["slurmctld", "slurmdbd", "mariadbd", "munged"]
        for name in order:
            proc = self.procs.pop(name, None)
            pid = proc.pid if proc is not None else pids.get(name)
            if pid is not None:
                _terminate(pid, proc)
        for name in order:  # leave no pid file behind: a later start reads them as a stale lab
            (self.root / "run" / f"{name}.pid").unlink(missing_ok=True)

    def _pid_files(self) -> dict[str, int]:
        out = {}
        for pid_file in (self.root / "run").glob("*.pid") if (self.root / "run").is_dir() else ():
            with contextlib.suppress(ValueError, OSError, IndexError):
                out[pid_file.name[:-len(".pid")]] = int(pid_file.read_text().split()[0])
        return out

    @contextlib.contextmanager
    def _flock(self, suffix: str) -> Iterator[None]:
        self.root.parent.mkdir(parents=True, exist_ok=True)
        with open(str(self.root) + suffix, "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _stop_stale(self) -> None:
        if (self.root / "run").is_dir():
            self.stop()
            for pid in self._pid_files().values():  # anything else that left a pid file (mysqld.pid ...)
                _terminate(pid, None)
        if self.root.exists():
            shutil.rmtree(self.root)

    # --- configuration ----------------------------------------------------------------------------
    def _write_configs(self) -> None:
        host = socket.gethostname().split(".")[0]
        first = PORTS["slurmd_first"]
        for sub in ("etc", "run", "log", "ctld", "spool", "mysql", "gpus", "submitit"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)
        for i in range(self.gpus_per_node):  # fake GPUs: gres.conf File= must exist (Count= alone fails)
            dev = self.root / "gpus" / f"nvidia{i}"
            if not dev.exists():
                dev.symlink_to("/dev/null")
        values = {
            "root": str(self.root), "host": host, "ctld_port": PORTS["ctld"], "dbd_port": PORTS["dbd"],
            "mysql_port": PORTS["mysql"], "nodes": f"node[1-{self.num_nodes}]",
            "slurmd_ports": f"[{first}-{first + self.num_nodes - 1}]", "gpus": self.gpus_per_node,
            "gpu_files": f"{self.root}/gpus/nvidia[0-{self.gpus_per_node - 1}]",
            "cpus": self.cpus_per_node, "partition": self.partition, "urgent": self.urgent_partition,
        }
        for name in ("slurm.conf", "gres.conf", "cgroup.conf", "slurmdbd.conf"):
            text = Template((TEMPLATES / f"{name}.in").read_text()).substitute(values)
            path = self.root / "etc" / name
            path.write_text(text)
        (self.root / "etc" / "slurmdbd.conf").chmod(0o600)  # slurmdbd refuses a readable config

    # --- daemons ----------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], user: str | None = None) -> subprocess.Popen[bytes]:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 (the child keeps it)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=self.env, start_new_session=True, user=user, group=user)
        log.close()
        self.procs[name] = proc
        (self.root / "run" / f"{name}.pid").write_text(f"{proc.pid}\n")
        return proc

    def _expect_running(self, name: str, ready: Callable[[], object], timeout_s: float) -> None:
        proc = self.procs[name]

        def check() -> object:
            if proc.poll() is not None:
                raise LabFailed(f"{name} exited {proc.returncode}; see {self.root}/log/{name}*")
            return ready()

        try:
            wait_for(check, timeout_s, f"{name} to be ready")
        except TimeoutError as exc:
            raise LabFailed(f"{exc}; see {self.root}/log/{name}*") from None

    def _start_munge(self) -> None:
        if not Path("/etc/munge/munge.key").exists():
            _run(["/usr/sbin/mungekey", "--create"], check=False)
        run_dir = Path("/run/munge")
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.chown(run_dir, "munge", "munge")
        socket_path = run_dir / "munge.socket.2"
        if socket_path.exists() and _run(["munge", "-n"], check=False).returncode == 0:
            return  # a munged already serves this machine (not ours: leave it alone)
        self._spawn("munged", ["/usr/sbin/munged", "-F", "--force"], user="munge")
        self._expect_running("munged", lambda: _run(["munge", "-n"], check=False).returncode == 0, 15)

    def _start_mariadb(self) -> None:
        data = self.root / "mysql"
        shutil.chown(data, "mysql", "mysql")
        _run(["mariadb-install-db", "--user=mysql", f"--datadir={data}", "--skip-test-db",
              "--auth-root-authentication-method=socket"], timeout_s=120)
        sock = data / "mysqld.sock"  # in the datadir: mariadbd runs as mysql and cannot write run/
        self._spawn("mariadbd", [
            "/usr/sbin/mariadbd", "--no-defaults", "--user=mysql", f"--datadir={data}", f"--socket={sock}",
            f"--port={PORTS['mysql']}", "--bind-address=127.0.0.1", f"--pid-file={data}/mysqld.pid",
            "--innodb-buffer-pool-size=64M", "--skip-log-bin", "--innodb-flush-log-at-trx-commit=0",
        ])
        self._expect_running("mariadbd", sock.exists, 60)
        sql = ("CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'nereus-lab';"
               "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;")
        wait_for(lambda: _run(["mariadb", f"--socket={sock}", "-u", "root", "-e", sql],
                              check=False).returncode == 0, 30, "MariaDB to accept the slurm user", 0.2)

    def _start_slurmdbd(self) -> None:
        self._spawn("slurmdbd", ["/usr/sbin/slurmdbd", "-D"])
        self._expect_running("slurmdbd", lambda: _port_open(PORTS["dbd"]), 60)

    def _start_slurmctld(self) -> None:
        self._spawn("slurmctld", ["/usr/sbin/slurmctld", "-D", "-i"])
        self._expect_running("slurmctld", lambda: self.run("scontrol", "ping", check=False).returncode == 0
                             and "UP" in self.run("scontrol", "ping", check=False).stdout, 60)

    def _start_slurmds(self) -> None:
        for node in self.nodes:
            self._spawn(f"slurmd.{node}", ["/usr/sbin/slurmd", "-D", "-N", node])
        self._expect_running("slurmctld", lambda: set(self.idle_nodes()) >= set(self.nodes), 60)

    # --- queries tests use ------------------------------------------------------------------------
    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
        return dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)

    def idle_nodes(self) -> list[str]:
        return [n for n, s in self.node_states().items() if s == "idle"]

    def active_jobs(self) -> list[str]:
        out = self.run("squeue", "-h", "-o", "%i %T", check=False).stdout
        return [ln.split()[0] for ln in out.splitlines()
                if ln.split() and ln.split()[1] in ("RUNNING", "PENDING", "CONFIGURING", "COMPLETING",
                                                    "SUSPENDED", "RESIZING", "REQUEUED")]

    def sbatch(self, *args: str, script: str = "#!/bin/sh\nsleep 600\n") -> str:
        """Submit a batch job; returns its id. Its output goes under the lab's root, not the caller's cwd."""
        (self.root / "jobs").mkdir(parents=True, exist_ok=True)
        out = _run(["sbatch", "--parsable", f"--output={self.root}/jobs/slurm-%j.out", *args], env=self.env,
                   input_text=script).stdout
        return out.strip().split(";")[0]

    def job_field(self, job_id: str, key: str) -> str | None:
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False).stdout
        for part in out.split():
            if part.startswith(key + "="):
                return part.split("=", 1)[1]
        return None

    def resume_all_nodes(self) -> None:
        """Bring every node back to service (after a test downed one) and wait until none is down."""
        for node, state in self.node_states().items():
            if state.rstrip("*") not in ("idle", "allocated", "mixed"):
                self.run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
        wait_for(lambda: all(s in ("idle", "allocated", "mixed") for s in self.node_states().values()),
                 30, "nodes to return to service (and respond)", 0.2)

    def cancel_all(self) -> None:
        self.run("scancel", "--full", "--user", "root", check=False)
        wait_for(lambda: not self.active_jobs(), 30, "all jobs to end", 0.2)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _terminate(pid: int, proc: subprocess.Popen[bytes] | None, timeout_s: float = 10.0) -> None:
    """SIGTERM ``pid``, wait until it is gone (a zombie counts as gone), then SIGKILL if needed."""
    if not pid_alive(pid):
        if proc is not None:
            proc.poll()
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: (proc.poll() is not None) if proc is not None else not pid_alive(pid),
                     timeout_s, f"pid {pid} to exit", 0.05)
            return


if __name__ == "__main__":
    if sys.argv[1:] == ["up"]:
        lab = SlurmLab.start()
        for p in lab.procs.values():  # detach: `down` stops them through the pid files
            p.returncode = 0
        print(f"export SLURM_CONF={lab.conf}")
    elif sys.argv[1:] == ["down"]:
        SlurmLab()._stop_stale()
    else:
        sys.exit(__doc__)

"""A real PostgreSQL server for tests: initdb into a temp dir and `postgres` run as the postgres user.

Started on a free port, listening on loopback (+ optional extra addresses, e.g. the test cluster's
bridge), stopped by PID. Skips when the PostgreSQL server binaries are not installed.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from serverproc import free_port


def pg_bindir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"))
    return Path(found[-1]).parent if found else None


@dataclass
class PgServer:
    port: int
    password: str
    root: Path
    proc: subprocess.Popen

    def url(self, host: str = "127.0.0.1") -> str:
        return f"postgresql://agentenv:{self.password}@{host}:{self.port}/agentenv"

    def create_database(self, name: str | None = None) -> str:
        """A new, empty database on this server; returns its URL."""
        name = name or f"t_{secrets.token_hex(6)}"
        subprocess.run([str(pg_bindir() / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "agentenv",
                        name], env={**os.environ, "PGPASSWORD": self.password}, check=True, capture_output=True,
                       timeout=30)
        return self.url().rsplit("/", 1)[0] + "/" + name

    def drop_database(self, url: str) -> None:
        subprocess.run([str(pg_bindir() / "dropdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "agentenv",
                        "--force", url.rsplit("/", 1)[1]], env={**os.environ, "PGPASSWORD": self.password},
                       check=True, capture_output=True, timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # fast shutdown
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)


def start_postgres(listen: tuple[str, ...] = ("127.0.0.1",)) -> PgServer:
    """In a fresh dir under /var/tmp: the postgres user cannot enter pytest's root-only tmp dirs."""
    bindir = pg_bindir()
    if bindir is None:
        raise RuntimeError("PostgreSQL server binaries not found (apt-get install postgresql)")
    pw = pwd.getpwnam("postgres")
    root = Path(tempfile.mkdtemp(prefix="agentenv-pg-", dir="/var/tmp"))
    os.chmod(root, 0o700)
    os.chown(root, pw.pw_uid, pw.pw_gid)
    data = root / "data"
    password = secrets.token_hex(12)
    pwfile = root / "pw"
    pwfile.write_text(password + "\n")
    os.chown(pwfile, pw.pw_uid, pw.pw_gid)

    def as_postgres() -> None:
        os.setgid(pw.pw_gid)
        os.setuid(pw.pw_uid)

    r = subprocess.run([str(bindir / "initdb"), "-D", str(data), "-U", "agentenv", "--pwfile", str(pwfile),
                        "-A", "scram-sha-256", "-E", "UTF8", "--no-sync"], preexec_fn=as_postgres,
                       capture_output=True, text=True, timeout=120, cwd=root)
    if r.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"initdb failed: {r.stdout[-1000:]} {r.stderr[-1000:]}")
    with open(data / "pg_hba.conf", "a") as f:  # the test cluster's nodes connect over its bridge
        for addr in listen:
            if addr != "127.0.0.1":
                f.write(f"host all all {addr.rsplit('.', 1)[0]}.0/24 scram-sha-256\n")
    port = free_port()
    log = open(root / "postgres.log", "wb")
    proc = subprocess.Popen(
        [str(bindir / "postgres"), "-D", str(data), "-p", str(port), "-c", f"listen_addresses={','.join(listen)}",
         "-c", f"unix_socket_directories={root}", "-c", "fsync=off", "-c", "max_connections=200",
         "-c", "shared_buffers=64MB"],
        preexec_fn=as_postgres, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    # pg_hba: allow the extra addresses' networks (test-only bridge) with the password.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"postgres exited: {(root / 'postgres.log').read_text()[-2000:]}")
        r = subprocess.run([str(bindir / "pg_isready"), "-h", "127.0.0.1", "-p", str(port)], capture_output=True)
        if r.returncode == 0:
            break
        time.sleep(0.2)
    else:
        proc.kill()
        raise RuntimeError("postgres did not become ready in 30 s")
    subprocess.run([str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "agentenv", "agentenv"],
                   env={**os.environ, "PGPASSWORD": password}, check=True, capture_output=True, timeout=30)
    return PgServer(port, password, root, proc)

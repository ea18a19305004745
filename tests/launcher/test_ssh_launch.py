"""The ssh launcher for real: two "hosts" (127.0.0.1 and 127.0.0.2) served by a private sshd.

The fixture needs root, `unshare`, `apt-get` and `dpkg-deb` (Debian): it downloads Debian's
openssh-server (and libwrap0) with `apt-get download` and unpacks them into a temporary directory,
installing nothing. sshd runs in its own mount namespace, where a tmpfs over /run gives it its
privilege-separation directory and a bind-mounted copy of /etc/passwd its `sshd` user, so the
machine sees no change. Anything missing: the test is skipped, saying why.
"""

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import SCRIPTS, run_cli

pytestmark = pytest.mark.dist

SSHD_CONFIG = """\
Port {port}
ListenAddress 127.0.0.1
ListenAddress 127.0.0.2
HostKey {d}/host_key
PidFile {d}/sshd.pid
AuthorizedKeysFile {d}/authorized_keys
StrictModes no
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
"""

START_SSHD = """\
set -e
mount --make-rprivate /
mount -t tmpfs -o mode=755 tmpfs /run
mkdir -m 755 /run/sshd
mount --bind {d}/passwd /etc/passwd
exec env LD_LIBRARY_PATH={d}/root/usr/lib/x86_64-linux-gnu {d}/root/usr/sbin/sshd -D -e -f {d}/sshd_config
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    missing = [tool for tool in ("unshare", "apt-get", "dpkg-deb", "ssh", "ssh-keygen") if shutil.which(tool) is None]
    if missing or os.geteuid() != 0:
        pytest.skip(f"a private sshd needs root and {', '.join(missing) or 'these tools'}")
    d = tmp_path_factory.mktemp("sshd")
    try:
        subprocess.run(["apt-get", "download", "openssh-server", "libwrap0"], cwd=d, check=True,
                       capture_output=True, timeout=60)
        for deb in d.glob("*.deb"):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(d / "root")], check=True, capture_output=True, timeout=60)
    except (subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"cannot fetch Debian's openssh-server with apt-get download: {e}")
    for key in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    shutil.copy(d / "user_key.pub", d / "authorized_keys")
    (d / "passwd").write_text(Path("/etc/passwd").read_text() + "sshd:x:74:65534::/run/sshd:/usr/sbin/nologin\n")
    port = _free_port()
    (d / "sshd_config").write_text(SSHD_CONFIG.format(port=port, d=d))
    (d / "start.sh").write_text(START_SSHD.format(d=d))
    log = open(d / "sshd.log", "w")
    proc = subprocess.Popen(["unshare", "-m", "bash", str(d / "start.sh")], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while "Server listening on 127.0.0.2" not in (d / "sshd.log").read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.skip(f"sshd did not start: {(d / 'sshd.log').read_text()[-500:]}")
        time.sleep(0.05)
    yield port, d / "user_key"
    proc.terminate()
    proc.wait(timeout=10)
    log.close()


def test_two_hosts_over_ssh(sshd, tmp_path, home):
    port, key = sshd
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "hostfile").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    (tmp_path / ".lightspeed_env").write_text("FROM_ENV_FILE=over ssh\n")
    ssh_args = f"-i {key} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
    proc = run_cli(["--hostfile", "hostfile", "--launcher", "ssh", "--ssh_port", port, f"--launcher_args={ssh_args}",
                    "--num_procs", "1", "--master_port", _free_port(), SCRIPTS / "allreduce_job.py", "--out", out],
                   tmp_path, home, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for rank in range(2):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        assert seen["sum"] == 1.0 and seen["WORLD_SIZE"] == "2" and seen["RANK"] == str(rank)
        assert (seen["CROSS_RANK"], seen["CROSS_SIZE"], seen["MASTER_ADDR"]) == (str(rank), "2", "127.0.0.1")
        assert seen["FROM_ENV_FILE"] == "over ssh"  # exported from ./.lightspeed_env to the remote shell


def test_ssh_refused_is_one_line_before_anything_starts(sshd, tmp_path, home):
    (tmp_path / "hostfile").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    (tmp_path / "train.py").write_text("")
    proc = run_cli(["--hostfile", "hostfile", "--launcher", "ssh", "--ssh_port", sshd[0], "--num_procs", "1",
                    "--launcher_args=-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o IdentitiesOnly=yes "
                    "-o IdentityFile=/dev/null", "train.py"], tmp_path, home, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("lightspeed: error: host 127.0.0.1 is not reachable by passwordless ssh (")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_failing_rank_on_one_host_stops_the_other_host(sshd, tmp_path, home):
    port, key = sshd
    (tmp_path / "hostfile").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    ssh_args = f"-i {key} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
    start = time.monotonic()
    proc = run_cli(["--hostfile", "hostfile", "--launcher", "ssh", "--ssh_port", port, f"--launcher_args={ssh_args}",
                    "--num_procs", "1", "--master_port", _free_port(), SCRIPTS / "failing_job.py"],
                   tmp_path, home, timeout=90)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "rank 1 fails on purpose" in proc.stderr
    # Node 0's worker waits for rank 1 forever: its agent stops it when the launcher closes its ssh.
    assert "the launcher's connection closed: stopping this node's workers" in proc.stderr
    assert time.monotonic() - start < 30

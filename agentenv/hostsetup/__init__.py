"""`agentenv setup`: install the host packages a server needs, from the copy of the script in the wheel.

The package list lives in one shell script (`host-packages.sh` next to this file), which
`scripts/setup.sh` also sources in a checkout and the container image runs through it, so
`pip install agentenv && agentenv setup` and a clone set a host up the same way.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import click

SCRIPT = Path(__file__).resolve().parent / "host-packages.sh"


def host_packages_command(*, with_test: bool, check: bool) -> list[str]:
    bash = shutil.which("bash") or "/bin/bash"
    return [bash, str(SCRIPT), *(["--test"] if with_test else []), *(["--check"] if check else [])]


@click.command("setup")
@click.option("--test", "with_test", is_flag=True, help="also what the test suite needs (chromium, postgresql, gcc, ...)")
@click.option("--check", is_flag=True, help="install nothing: list missing packages, exit 1 if any")
def setup_command(with_test: bool, check: bool) -> None:
    """Install the host packages (apt, as root): runsc (gVisor), debootstrap, nftables, QEMU, Node.js.

    Already-installed packages are skipped. Then `agentenv doctor` checks the host and
    `agentenv image build` builds the base image.
    """
    if not SCRIPT.is_file():
        click.echo(f"error: {SCRIPT} is missing from this installation", err=True)
        sys.exit(2)
    sys.exit(subprocess.run(host_packages_command(with_test=with_test, check=check)).returncode)

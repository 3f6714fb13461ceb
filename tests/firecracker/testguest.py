"""A purpose-written Firecracker test guest: a freestanding 64-bit ELF built with gcc/ld at test time.

Firecracker loads an ELF kernel's segments and enters it in 64-bit mode with identity-mapped
paging; `guest.S` then counts forever, keeping the counter in its data segment and printing
`n=<counter>` to the 8250 UART (port 0x3f8) after each increment. A snapshot's memory image holds
the counter at its guest-physical address, so a test can read the captured value and check that
every restore continues from exactly there.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("guest.S")
LOAD_ADDRESS = 0x200000          # above Firecracker's 1 MiB minimum for kernel segments
_LINE = re.compile(rb"^n=(\d+)$", re.M)


@dataclass(frozen=True)
class TestGuest:
    elf: Path
    counter_addr: int             # guest-physical address of the 8-byte counter

    def counter_in(self, memory_image: Path) -> int:
        """The counter's value in a full memory image (file offset = guest-physical address)."""
        with open(memory_image, "rb") as f:
            f.seek(self.counter_addr)
            return int.from_bytes(f.read(8), "little")


def tools_missing() -> str | None:
    for tool in ("gcc", "ld", "nm"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (apt-get install gcc binutils)"
    return None


def build(out_dir: Path) -> TestGuest:
    out_dir.mkdir(parents=True, exist_ok=True)
    obj, elf = out_dir / "guest.o", out_dir / "guest.elf"
    subprocess.run(["gcc", "-c", "-o", str(obj), str(SOURCE)], check=True, capture_output=True)
    subprocess.run(["ld", "-nostdlib", "-static", "-e", "_start", f"-Ttext={LOAD_ADDRESS:#x}",
                    "-z", "max-page-size=0x1000", "--build-id=none", "-o", str(elf), str(obj)],
                   check=True, capture_output=True)
    syms = subprocess.run(["nm", str(elf)], check=True, capture_output=True, text=True).stdout
    addr = next(int(line.split()[0], 16) for line in syms.splitlines() if line.endswith(" counter"))
    return TestGuest(elf, addr)


def counters(console: str | bytes) -> list[int]:
    """Every complete `n=<k>` line of a console log, in order."""
    data = console.encode() if isinstance(console, str) else console
    return [int(m) for m in _LINE.findall(data)]

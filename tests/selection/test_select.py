"""Runtime selection rules (agentenv/runtimes/select.py) on host descriptions and probe verdicts.

Host detection reads /proc/cpuinfo, /sys/module and /dev/kvm; here it is fed files describing the
three kinds of host (hardware VT-x/AMD-V, software PVM, no KVM). The ranking and never-downgrade
rules are checked on probe verdicts; the real probes on this host are exercised by the doctor and
API tests.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentenv.config import Settings
from agentenv.runtimes import select


def host(tmp: Path, flags: str, pvm: bool, kvm: bool) -> select.HostVirt:
    (tmp / "cpuinfo").write_text(f"processor\t: 0\nflags\t\t: fpu sse2 {flags} lm\n\n")
    mods = tmp / "module"
    (mods / ("kvm_pvm" if pvm else "kvm")).mkdir(parents=True, exist_ok=True)
    dev = tmp / "kvm"
    if kvm:
        dev.write_bytes(b"")
    return select.detect_virt(tmp / "cpuinfo", mods, dev)


def test_detects_hardware_pvm_and_none(tmp_path):
    a, b, c, d = (tmp_path / x for x in "abcd")
    for p in (a, b, c, d):
        p.mkdir()
    intel = host(a, "vmx ept", pvm=False, kvm=True)
    assert (intel.kind, intel.cpu_flag, intel.hardware) == ("hardware", "vmx", True)
    assert "Intel VT-x" in intel.detail
    amd = host(b, "svm npt", pvm=False, kvm=True)
    assert (amd.kind, amd.cpu_flag) == ("hardware", "svm") and "AMD-V" in amd.detail
    pvm = host(c, "hypervisor", pvm=True, kvm=True)
    assert (pvm.kind, pvm.hardware, pvm.pvm) == ("pvm", False, True)
    assert "PVM" in pvm.detail and "no vmx/svm" in pvm.detail
    none = host(d, "vmx", pvm=False, kvm=False)
    assert none.kind == "none" and "no usable /dev/kvm" in none.detail


def test_this_host_matches_its_cpuinfo():
    virt = select.detect_virt()
    with open("/proc/cpuinfo") as f:
        flags = set(next((line for line in f if line.startswith("flags")), "").split())
    assert virt.hardware == bool(flags & {"vmx", "svm"})
    assert virt.pvm == os.path.exists("/sys/module/kvm_pvm")


def probes(**avail: bool) -> list[select.Probe]:
    strength = {"firecracker": select.STRENGTH_HW_VM, "qemu": select.STRENGTH_EMULATED_VM,
                "gvisor": select.STRENGTH_GVISOR}
    return [select.Probe(n, ok, strength[n], f"{n} {'works' if ok else 'cannot run: reason-' + n}",
                         fix=None if ok else f"fix-{n}") for n, ok in avail.items()]


VIRT = select.HostVirt(True, False, None, True, "pvm host")


async def test_auto_takes_the_strongest_available():
    s = Settings(runtime="auto")
    sel = await select.choose(s, virt=VIRT, probes=probes(firecracker=True, gvisor=True, qemu=True))
    assert sel.runtime == "firecracker"
    sel = await select.choose(s, virt=VIRT, probes=probes(firecracker=False, gvisor=True, qemu=True))
    assert sel.runtime == "gvisor"   # QEMU under TCG ranks below gVisor
    assert "firecracker" in sel.summary and "reason-firecracker" in sel.reason
    sel = await select.choose(s, virt=VIRT, probes=probes(firecracker=False, gvisor=False, qemu=True))
    assert sel.runtime == "qemu"
    with pytest.raises(select.RuntimeUnavailable):
        await select.choose(s, virt=VIRT, probes=probes(firecracker=False, gvisor=False, qemu=False))


async def test_an_explicit_vm_runtime_never_degrades():
    for configured, requested in (("firecracker", None), ("auto", "firecracker"), ("gvisor", "firecracker")):
        with pytest.raises(select.RuntimeUnavailable) as e:
            await select.choose(Settings(runtime=configured), requested, virt=VIRT,
                                probes=probes(firecracker=False, gvisor=True, qemu=True))
        assert e.value.status == 400
        assert "reason-firecracker" in e.value.message and "fix-firecracker" in e.value.message
        assert "no fallback" in e.value.message
    sel = await select.choose(Settings(runtime="auto"), "qemu", virt=VIRT,
                              probes=probes(firecracker=False, gvisor=True, qemu=True))
    assert sel.runtime == "qemu"     # explicitly asked: honoured although gVisor ranks higher


async def test_unknown_runtime_names_are_rejected():
    with pytest.raises(select.RuntimeUnavailable, match="unknown runtime 'xen'"):
        await select.choose(Settings(), "xen", virt=VIRT, probes=probes(gvisor=True))
    with pytest.raises(Exception):
        Settings(runtime="xen")      # the setting is validated at load


def test_probe_guest_is_a_loadable_elf():
    elf = select.probe_elf()
    assert elf[:4] == b"\x7fELF" and elf[4] == 2 and int.from_bytes(elf[18:20], "little") == 0x3E
    assert select.PROBE_MARKER in elf

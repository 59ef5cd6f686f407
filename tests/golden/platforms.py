"""The platform a golden run computes on: what decides the rounding of its floats.

Two machines give the same floats bit for bit only when they run the same kernels in the same order:
the processor (vendor and model family: two processors that both offer AVX2 still round a fused
multiply-add chain differently inside MKL and oneDNN), the instruction set torch dispatches to, the
torch build and the BLAS it links. A platform names all four; the golden fixtures hold the floats
of each platform they were recorded on (tests/golden/runs.py).
"""

from __future__ import annotations

import platform as _platform
import re
from pathlib import Path


def processor() -> str:
    """Vendor, family and model of this machine's processor, as the kernel reports them
    (`GenuineIntel family 6 model 143`, `AuthenticAMD family 25 model 17`, `arm 0x41 part 0xd40`),
    with its marketing name in parentheses where one is given."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        fields: dict[str, str] = {}
        for line in cpuinfo.read_text().splitlines():
            if not line.strip():
                break  # the first processor describes them all
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
        if "vendor_id" in fields:
            name = f" ({fields['model name']})" if fields.get("model name") else ""
            return f"{fields['vendor_id']} family {fields.get('cpu family', '?')} model {fields.get('model', '?')}{name}"
        if "CPU implementer" in fields:
            return f"arm {fields['CPU implementer']} part {fields.get('CPU part', '?')}"
    return f"{_platform.system()} {_platform.machine()} {_platform.processor()}".strip()


def blas() -> str:
    """The BLAS and oneDNN torch links, with their versions, from torch's build configuration."""
    import torch

    shown = torch.__config__.show()
    parts = [f"BLAS {m.group(1)}" for m in [re.search(r"BLAS_INFO=(\w+)", shown)] if m]
    parts += [f"MKL {m.group(1)}" for m in [re.search(r"Math Kernel Library Version ([\d.]+)", shown)] if m]
    parts += [f"oneDNN {m.group(1)}" for m in [re.search(r"MKL-DNN v([\d.]+)", shown)] if m]
    return ", ".join(parts) or "unknown"


def describe() -> dict[str, str]:
    """This process's platform. The instruction set is the one torch dispatches to in this process,
    so call it where the golden runs run (after `PINNED_ISA` is set)."""
    import torch

    return {
        "processor": processor(),
        "machine": _platform.machine(),
        "isa": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "blas": blas(),
    }


def key(described: dict[str, str]) -> str:
    """A platform's name in the fixtures: short, stable and free of spaces
    (`AuthenticAMD-f25-m17_AVX2_torch-2.14.1+cu130_mkl-2024.2`)."""
    cpu = described["processor"].split(" (")[0]
    cpu = re.sub(r" family (\S+) model (\S+)", r"-f\1-m\2", cpu).replace(" ", "-")
    blas_version = re.search(r"MKL ([\d.]+)", described["blas"])
    lib = f"mkl-{blas_version.group(1)}" if blas_version else re.sub(r"\W+", "-", described["blas"]).strip("-").lower()
    return f"{cpu}_{described['isa']}_torch-{described['torch']}_{lib}"

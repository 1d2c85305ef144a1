"""The machine record every benchmark writes into its results JSON: CPU model, cores, L3, torch, load, date, command.

    start = _machine.record()           # at the start of main (load average before the run)
    out["machine"] = _machine.finish(start)   # when writing the JSON (load average after, duration)

``l3_bytes()`` sizes cache-dependent benchmarks from the machine (the cold-cache eviction of cp_balance.py).
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
L3_FALLBACK = 32 << 20  # bytes assumed when the machine does not say


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or lscpu / platform where that is missing)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _size(text: str) -> int:
    text = text.strip().upper().replace("IB", "").replace(" ", "")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * scale[text[-1]]) if text[-1:] in scale else int(text)


def l3_bytes() -> int | None:
    """Size of the L3 (last-level) cache cpu0 sees, from sysfs, else lscpu; None when neither says."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(base.glob("index*")):
        try:
            if (index / "level").read_text().strip() == "3":
                return _size((index / "size").read_text())
        except (OSError, ValueError):
            continue
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        line = next(x for x in out.splitlines() if x.startswith("L3 cache:"))
        return _size(" ".join(line.split(":", 1)[1].split()[:2]))
    except (OSError, StopIteration, ValueError, subprocess.SubprocessError):
        return None


def command() -> str:
    """The command that ran, as typed from the repository root."""
    argv = list(sys.argv)
    try:
        argv[0] = str(Path(argv[0]).resolve().relative_to(ROOT))
    except ValueError:
        pass
    return "python " + shlex.join(argv)


def record() -> dict:
    """Machine, software and command at the start of a run."""
    import torch

    l3 = l3_bytes()
    return dict(cpu=cpu_model(), cores=os.cpu_count(), l3_bytes=l3, l3=f"{l3 >> 20} MB" if l3 else "unknown",
                torch=torch.__version__, python=platform.python_version(),
                load_average_start=[round(x, 2) for x in os.getloadavg()],
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=command(), _t0=time.time())


def finish(start: dict) -> dict:
    """``start`` with the load average at the end and the run's duration added."""
    out = {k: v for k, v in start.items() if k != "_t0"}
    out["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    out["duration_s"] = round(time.time() - start.get("_t0", time.time()), 1)
    return out


def describe(machine: dict | str | None) -> str:
    """One phrase naming the machine of a results JSON, for the text beside its figures."""
    if not isinstance(machine, dict):
        return "an unrecorded machine"
    load = machine.get("load_average_start")
    where = f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, {machine.get('l3', '?')} L3"
    when = f", {machine['date'][:10]}" if machine.get("date") else ""
    loaded = f", load average {load[0]:.1f} at start" if load else ""
    return where + when + loaded

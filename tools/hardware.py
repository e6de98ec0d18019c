"""Where a benchmark ran: one description for every result file in bench/results/."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def host_info() -> dict[str, Any]:
    """Host, CPU, cores, load at the start, Python, and the GPUs nvidia-smi lists."""
    info: dict[str, Any] = {
        "host": platform.node(),
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "load_avg_1m_at_start": os.getloadavg()[0],
        "python": platform.python_version(),
    }
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        info["gpus"] = [line.strip() for line in smi.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        info["gpus"] = []
    return info


def source_commit() -> str:
    """The commit measured: $DELTASERVE_COMMIT (a copy without .git, as on the GPU machine),
    else git's short HEAD here, "+changes" where the checkout differs; "unknown" without both."""
    if named := os.environ.get("DELTASERVE_COMMIT"):
        return named

    def git(*args: str) -> str:
        here = Path(__file__).resolve().parent.parent
        run = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True)
        return run.stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")

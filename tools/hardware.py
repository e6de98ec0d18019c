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


def git_commit() -> str:
    """The commit measured: $DELTASERVE_COMMIT where set (a copied tree's .git can be another
    commit's, as on the GPU machine), else HEAD, "+changes" when tracked files differ."""
    if os.environ.get("DELTASERVE_COMMIT"):
        return os.environ["DELTASERVE_COMMIT"]
    here = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True)
        return out.stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no")
    return (git("rev-parse", "--short", "HEAD") or "unknown") + ("+changes" if dirty else "")

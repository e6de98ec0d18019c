"""deltaserve: a serving engine for Qwen3.5-family models."""

import os
import sys

__version__ = "0.1.0"


def _leave_sys_path() -> None:
    """Take this checkout's root off sys.path: Python puts the working directory there
    (`python -m pytest`, `python -m tools.x` run from the root), and from there our engine/,
    kernels/, http/ and tools/ would be top-level modules hiding real ones (transformers
    imports Hugging Face's `kernels` package). Everything of ours is under `deltaserve.`."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]


_leave_sys_path()

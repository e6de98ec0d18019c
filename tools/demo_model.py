"""The demo checkpoint `deltaserve serve` runs when no MODEL is given: a tiny random model in
the real format, made once under ~/.cache/deltaserve. It lives here, with the maker it uses
(tools/make_model.py), and the CLI (tools/cli.py) hands it to http/serve.py: the serving
layers never import tools."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import deltaserve
from deltaserve.http.serve import DemoCheckpoint

DEMO_PRESET = "tiny"
DEMO_MODEL_NAME = "deltaserve-demo-tiny"


def demo_name() -> str:
    """The demo checkpoint's folder name. It changes with the package version and with the
    demo's chat template: a demo made earlier would otherwise keep serving the template it was
    made with."""
    from deltaserve.tools.tokenizer_files import CHATML_TEMPLATE

    digest = hashlib.sha256(CHATML_TEMPLATE.encode()).hexdigest()[:8]
    return f"demo-{deltaserve.__version__}-{digest}"


def demo_model_dir() -> Path:
    return Path.home() / ".cache" / "deltaserve" / demo_name()


def ensure_demo_model() -> tuple[Path, bool]:
    """The demo checkpoint's folder, made on first use (atomically: written beside, then
    renamed), and whether it was made now."""
    target = demo_model_dir()
    if (target / "config.json").is_file():
        return target, False
    from deltaserve.tools.make_model import make_model

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        make_model(tmp, preset=DEMO_PRESET, dtype="fp32", seed=0)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target, True


def demo_checkpoint() -> DemoCheckpoint:
    """What `serve` needs of the demo: where it is, its name, what it is, how it is made."""
    return DemoCheckpoint(
        path=demo_model_dir(),
        served_name=DEMO_MODEL_NAME,
        description=f"random '{DEMO_PRESET}' weights",
        make=ensure_demo_model,
    )

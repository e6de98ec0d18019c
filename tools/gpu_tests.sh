#!/bin/bash
# The tests' GPU cases in one command, on a machine with CUDA: the files whose cases pick
# CUDA when it is present or run only there (CUDA graphs, fla prefill, sleep-mode memory,
# nothing compiled after start-up). Writes $OUT/gpu_tests.log, gpu_tests.xml (JUnit) and
# gpu_tests.json (counts, failures, commit, hardware).
#
#   OUT=/tmp/out bash tools/gpu_tests.sh [more pytest arguments]   # from the repository root
set -u
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
FILES=(
  tests/test_gpu_path.py tests/test_kernels.py tests/test_moe.py tests/test_skinny_linear.py
  tests/test_prefix_cache.py tests/test_memory_budget.py tests/test_prompt_logprobs.py
  tests/test_sleep_mode.py tests/test_sampler.py tests/test_loader.py tests/test_mtp_graphs.py
)
python3 -m pytest -q -p no:cacheprovider -rfE --junitxml="$OUT/gpu_tests.xml" "${FILES[@]}" "$@" \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -25
python3 - "$OUT" "${FILES[@]}" <<'PY'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
from deltaserve.tools.hardware import host_info, git_commit
out, files = Path(sys.argv[1]), sys.argv[2:]
suite = ET.parse(out / "gpu_tests.xml").getroot().find("testsuite")
failed = [
    f"{case.get('classname')}::{case.get('name')}"
    for case in suite.iter("testcase")
    if case.find("failure") is not None or case.find("error") is not None
]
counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
summary = {
    "command": "bash tools/gpu_tests.sh",
    "commit": git_commit(),
    "hardware": host_info(),
    "files": files,
    "seconds": float(suite.get("time", 0)),
    **counts,
    "failed": failed,
}
(out / "gpu_tests.json").write_text(json.dumps(summary, indent=1) + "\n")
print({k: summary[k] for k in ("passed", "failures", "errors", "skipped", "seconds")})
PY

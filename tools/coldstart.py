"""Cold start of `deltaserve serve`: seconds from launching the process to the first answered
request, the start-up phases the server and its ranks log, and a clean SIGTERM exit.

    python -m tools.coldstart --runs 2 --out bench/results/coldstart.json -- \\
        --model /tmp/m4b --device cuda --dtype bfloat16 --max-num-seqs 64 --max-model-len 8192

Arguments after `--` go to `deltaserve serve` (this tool adds `--port`). The first run of a
fresh machine also compiles Triton kernels and autotunes; later runs find them cached.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from deltaserve.tools.hardware import host_info

# log lines that mark a start-up phase (server and ranks)
PHASES = re.compile(
    r"loading |process up|torch on|profiling step|weights loaded|memory budget"
    r"|CUDA graphs captured|tokenizer loaded|engine ready|ready: serving"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_answer(port: int, deadline: float) -> float | None:
    """Poll a one-token completion until it answers 200; the time it did, or None."""
    body = json.dumps({"prompt": "Hello", "max_tokens": 1}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                if response.status == 200:
                    return time.monotonic()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.05)
    return None


def one_run(serve_args: list[str], timeout_s: float) -> dict:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "deltaserve.tools.cli",
        "serve",
        *serve_args,
        "--port",
        str(port),
    ]
    started = time.monotonic()
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        answered = first_answer(port, started + timeout_s)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, log = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, log = proc.communicate()
    return {
        "command": " ".join(command),
        "seconds_to_first_answer": None if answered is None else answered - started,
        "exit_code": proc.returncode,
        "phases": [line for line in log.splitlines() if PHASES.search(line)],
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, serve_args = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = argparse.ArgumentParser(
        prog="python -m tools.coldstart", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for an answer"
    )
    parser.add_argument("--out", default=None, help="JSON result path")
    args = parser.parse_args(ours)
    report = {
        "tool": " ".join(["python -m tools.coldstart", *argv]),
        "hardware": host_info(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs": [],
    }
    for i in range(args.runs):
        run = one_run(serve_args, args.timeout)
        report["runs"].append(run)
        seconds = run["seconds_to_first_answer"]
        shown = "no answer" if seconds is None else f"{seconds:.2f} s"
        print(f"run {i + 1}: first answer after {shown}, exit code {run['exit_code']}", flush=True)
        for line in run["phases"]:
            print(f"    {line}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    ok = all(
        r["seconds_to_first_answer"] is not None and r["exit_code"] == 0 for r in report["runs"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Routed multi-turn benchmark: `deltaserve serve` replicas behind a real router, one policy at
a time, `tools.bench_serve --multi-turn` through the router.

    python -m tools.bench_routed --model DIR --route sglang-router:round_robin \\
        --route sglang-router:cache_aware --route vllm-router:kv_aware [bench_serve flags]

For each `--route ROUTER:POLICY` it starts `--replicas` fresh servers (prefix caching and KV
events on, so no policy inherits another's saved prefixes), the router on loopback in front of
them (kv_aware is fed the servers' KV events and tokenizes with the checkpoint's tokenizer),
runs the multi-turn workload through it, and reads every server's prefix-cache counters
before and after: the hit rate is the prompt tokens taken from saved prefixes over all prompt
tokens (`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`), what a
cache-aware policy should raise over round robin. Writes one JSON with each policy's hit
rate, mean and p99 TTFT, completed and failed requests, the command and the hardware.
Unknown flags go to bench_serve (`--endpoint`, `--num-conversations`, `--min-turns`, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from deltaserve.tools.hardware import git_commit, host_info

BIN = Path(sys.executable).parent
ROUTERS = ("sglang-router", "vllm-router")
COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
BLOCK_SIZE = 16  # the servers' default --block-size; kv_aware is told the same


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited {proc.returncode} before it was healthy")
        with contextlib.suppress(urllib.error.URLError, OSError):
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def servers(args: argparse.Namespace) -> Iterator[list[tuple[str, int, subprocess.Popen]]]:
    """(url, KV-event port, process) of each replica, healthy."""
    started = []
    try:
        for _ in range(args.replicas):
            port, events = free_port(), free_port()
            kv = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events}"}
            cmd = [
                str(BIN / "deltaserve"),
                "serve",
                args.model,
                "--port",
                str(port),
                "--served-model-name",
                args.served_model_name,
                "--enable-prefix-caching",
                "--kv-events-config",
                json.dumps(kv),
                *shlex.split(args.serve_args),
            ]
            proc = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
            )
            started.append((f"http://127.0.0.1:{port}", events, proc))
        for url, _, proc in started:
            wait_healthy(url, proc, args.startup_timeout_s)
        yield started
    finally:
        for _, _, proc in started:
            stop(proc)


@contextlib.contextmanager
def router(
    args: argparse.Namespace, name: str, policy: str, workers: list[tuple[str, int, Any]]
) -> Iterator[str]:
    port = free_port()
    cmd = [str(BIN / name), *(["launch"] if name == "sglang-router" else [])]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())]
    cmd += ["--worker-urls", *(url for url, _, _ in workers), "--policy", policy]
    if policy == "kv_aware":
        for url, events, _ in workers:
            cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{events}"]
        cmd += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", args.model]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 120)
        yield url
    finally:
        stop(proc)


def counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    totals = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


def run_route(args: argparse.Namespace, route: str, bench_args: list[str]) -> dict[str, Any]:
    name, _, policy = route.partition(":")
    with servers(args) as workers, router(args, name, policy, workers) as url:
        before = [counters(w) for w, _, _ in workers]
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "tools.bench_serve", "--base-url", url, "--multi-turn"]
            cmd += ["--model", args.served_model_name, "--tokenizer", args.model]
            cmd += ["--result-dir", out]
            cmd += ["--result-filename", "run.json", *bench_args]
            done = subprocess.run(cmd, capture_output=True, text=True)
            path = Path(out) / "run.json"
            report = json.loads(path.read_text()) if path.exists() else {}
        after = [counters(w) for w, _, _ in workers]
    queries, hits = (
        sum(a[key] - b[key] for a, b in zip(after, before, strict=True)) for key in COUNTERS
    )
    return {
        "route": route,
        "bench_serve_exit": done.returncode,
        "bench_serve_error": done.stderr.strip().splitlines()[-1:] if done.returncode else [],
        "prefix_cache_queries": int(queries),
        "prefix_cache_hits": int(hits),
        "prefix_cache_hit_rate": hits / queries if queries else None,
        **{
            key: report.get(key)
            for key in ("completed", "failed", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms")
        },
        "conversations_completed": report.get("conversations_completed"),
        "total_input_tokens": report.get("total_input_tokens"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the checkpoint folder every replica serves")
    p.add_argument("--route", action="append", required=True, metavar="ROUTER:POLICY")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--served-model-name", default="routed")
    p.add_argument("--serve-args", default="", help="more `deltaserve serve` flags, one string")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--result-dir", default="bench/results")
    p.add_argument("--result-filename", default=None)
    args, bench_args = p.parse_known_args(argv)
    for route in args.route:
        name, _, policy = route.partition(":")
        if name not in ROUTERS or not policy:
            p.error(f"--route {route!r}: ROUTER:POLICY with ROUTER one of {', '.join(ROUTERS)}")
        if not (BIN / name).exists():
            p.error(f"--route {route!r}: {name} is not installed (pip install -e '.[test]')")
    started = datetime.now(UTC)
    report = {
        "date": started.strftime("%Y%m%d-%H%M%S"),
        "command": "python -m tools.bench_routed "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "commit": git_commit(),
        "hardware": host_info(),
        "replicas": args.replicas,
        "routes": [run_route(args, route, bench_args) for route in args.route],
    }
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / (args.result_filename or f"bench_routed-{report['date']}.json")
    path.write_text(json.dumps(report, indent=1) + "\n")
    for r in report["routes"]:
        rate = r["prefix_cache_hit_rate"]
        print(
            f"{r['route']:28} hit rate {'-' if rate is None else f'{rate:.1%}':>6}  "
            f"mean TTFT {r['mean_ttft_ms'] or 0:8.1f} ms  completed {r['completed']}  "
            f"failed {r['failed']}"
        )
    print(f"wrote {path}")
    return 0 if all(r["bench_serve_exit"] == 0 for r in report["routes"]) else 1


if __name__ == "__main__":
    sys.exit(main())

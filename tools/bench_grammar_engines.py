"""xgrammar and llguidance on our workloads, measured on the CPU: what compiling a constraint
costs on the Qwen3.5 vocabulary (248k tokens) and what a token mask costs along an output,
for the constraints the server takes and for issue 47's hostile ones.

Each (library, case) runs in a child process with a wall-clock limit (`--timeout-s`): a
library that takes past it, or dies, is recorded so, which is part of what is compared. An
output is walked token by token: a valid document's tokens where the case has one, else 36
tokens picked at random from each mask. Times are wall-clock on a shared host; the library's
own threads are held to one (RAYON_NUM_THREADS=1), xgrammar's compiler to max_threads=1.

    pip install xgrammar   # not a dependency of deltaserve; measured only here
    python -m tools.bench_grammar_engines --model DIR --out bench/results/grammar_engines_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from deltaserve.tools.bench_guided import GRAMMAR, REGEX, SCHEMA
from deltaserve.tools.hardware import host_info

DOCUMENT = (
    '{"name": "Bob Smith", "age": 42, "email": "bob@x.com", "tags": ["a", "bc"], '
    '"kind": "person", "active": true}'
)


def _deep(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


CASES: dict[str, tuple[str, str, str | None]] = {  # kind, text, a valid output (None: random)
    "json schema": ("json", json.dumps(SCHEMA), DOCUMENT),
    "json object": ("json", '{"type": "object"}', '{"a": [1, {"b": null}], "c": "hello"}'),
    "regex": ("regex", REGEX, "Hello World 1234, Paris, London."),
    "gbnf": ("gbnf", GRAMMAR, '[{"id": 7, "tags": ["ab", "c"]}, {"id": 12, "tags": ["x"]}]'),
    "lazy regex (attack)": ("regex", r"[\s\S]*[aeiou][\s\S]{300}", None),
    "counted regex (attack)": ("regex", r"(?:a{1000}){399}b0", None),
    "250 nested groups (attack)": ("regex", "(" * 250 + "a" + ")" * 250, None),
    "schema 400 deep (attack)": ("json", json.dumps(_deep(400)), None),
    "10,000 properties (attack)": (
        "json",
        json.dumps(
            {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}}
        ),
        None,
    ),
    "left recursion, 1000 rules (attack)": (
        "gbnf",
        "root ::= r0\n"
        + "".join(f'r{i} ::= r{i + 1} "x" | "y"\n' for i in range(999))
        + 'r999 ::= r0 "x" | "y"\n',
        None,
    ),
}


def measure(library: str, case: str, model: str) -> dict[str, Any]:
    """In the child: compile the case on the model's vocabulary, then walk an output."""
    import numpy as np
    from transformers import PreTrainedTokenizerFast

    from deltaserve.engine.model_config import ModelConfig

    kind, text, document = CASES[case]
    hf = PreTrainedTokenizerFast(tokenizer_file=str(Path(model) / "tokenizer.json"))
    vocab = ModelConfig.from_model_dir(model).vocab_size
    eos = [hf.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if library == "llguidance":
        import llguidance
        import llguidance.numpy

        started = time.perf_counter()
        tokenizer = llguidance.LLTokenizer(
            hf.backend_tokenizer.to_str(), n_vocab=vocab, eos_token=eos
        )
        tokenizer_s = time.perf_counter() - started
        started = time.perf_counter()
        try:
            grammar = (
                llguidance.LLMatcher.grammar_from_json_schema(
                    text, overrides={"whitespace_pattern": r"[ \t\n]{0,20}"}
                )
                if kind == "json"
                else llguidance.LLMatcher.grammar_from_regex(text)
                if kind == "regex"
                else llguidance.grammar_from("gbnf", text)
            )
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            error = matcher.get_error()
        except ValueError as exc:  # a schema it cannot read
            error = f"ValueError: {exc}"
        compile_s = time.perf_counter() - started
        mask = llguidance.numpy.allocate_token_bitmask(1, vocab)

        def fill() -> None:
            llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)

        def take(token: int) -> bool:
            return matcher.consume_token(token) and not matcher.is_error()

        def failure() -> str:
            return matcher.get_error()
    else:
        import xgrammar

        started = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
        compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        tokenizer_s = time.perf_counter() - started
        started = time.perf_counter()
        error = ""
        try:
            compiled = (
                compiler.compile_json_schema(text, any_whitespace=True)
                if kind == "json"
                else compiler.compile_regex(text)
                if kind == "regex"
                else compiler.compile_grammar(text)
            )
            matcher = xgrammar.GrammarMatcher(compiled)
        except Exception as exc:  # its errors, whatever their type
            error = f"{type(exc).__name__}: {exc}"
        compile_s = time.perf_counter() - started
        mask = xgrammar.allocate_token_bitmask(1, vocab)

        def fill() -> None:
            matcher.fill_next_token_bitmask(mask, 0)

        def take(token: int) -> bool:
            return matcher.accept_token(token)

        def failure() -> str:
            return "token refused"

    out: dict[str, Any] = {
        "tokenizer_s": tokenizer_s,
        "compile_ms": 1e3 * compile_s,
        "error": error[:300],
    }
    if not error:
        tokens = hf.encode(document, add_special_tokens=False) if document else None
        rng, times = random.Random(0), []
        for i in range(len(tokens) if tokens else 36):
            started = time.perf_counter()
            fill()
            times.append(time.perf_counter() - started)
            if tokens:
                token = tokens[i]
            else:
                bits = np.unpackbits(np.asarray(mask).view(np.uint8), bitorder="little")[:vocab]
                allowed = [t for t in np.flatnonzero(bits).tolist() if t not in eos]
                if not allowed:
                    break
                token = rng.choice(allowed)
            if not take(token):
                out["ended"] = f"token {i}: {failure()[:200]}"
                break
        out.update(
            tokens=len(times),
            first_mask_ms=1e3 * times[0],
            mean_mask_ms=1e3 * sum(times) / len(times),
            max_mask_ms=1e3 * max(times),
        )
    out["peak_rss_growth_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    return out


def run_case(library: str, case: str, args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        child = subprocess.run(
            [
                sys.executable,
                "-m",
                "tools.bench_grammar_engines",
                "--child",
                library,
                case,
                "--model",
                args.model,
            ],
            capture_output=True,
            text=True,
            timeout=args.timeout_s,
            env={**os.environ, "RAYON_NUM_THREADS": "1"},
        )
    except subprocess.TimeoutExpired:
        return {"outcome": f"killed after {args.timeout_s:g} s"}
    if child.returncode != 0:
        tail = (child.stderr or "").strip().splitlines()[-3:]
        return {"outcome": f"exit {child.returncode}", "stderr_tail": tail}
    result = json.loads(child.stdout.strip().splitlines()[-1])
    result["outcome"] = "refused" if result["error"] else "ran"
    result["wall_s"] = time.perf_counter() - started
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="a folder with tokenizer.json and config.json")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--libraries", default="llguidance,xgrammar")
    p.add_argument("--cases", default="", help="only the cases whose names hold this")
    p.add_argument("--out", type=Path)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(*args.child, args.model)))
        return 0
    import importlib.metadata as metadata

    versions = {}
    for library in args.libraries.split(","):
        try:
            versions[library] = metadata.version(library)
        except metadata.PackageNotFoundError:
            versions[library] = None
    rows = []
    for case in (c for c in CASES if args.cases in c):
        for library in args.libraries.split(","):
            row = {"case": case, "library": library}
            row.update(
                run_case(library, case, args) if versions[library] else {"outcome": "not installed"}
            )
            rows.append(row)
            print(
                f"{case:38s} {library:11s} {row['outcome'][:24]:24s} "
                f"compile {row.get('compile_ms', float('nan')):9.1f} ms  "
                f"mask mean {row.get('mean_mask_ms', float('nan')):7.2f} ms  "
                f"max {row.get('max_mask_ms', float('nan')):8.2f} ms  "
                f"{(row.get('error') or row.get('ended') or '')[:60]}",
                flush=True,
            )
    result = {
        "command": "python -m tools.bench_grammar_engines "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "hardware": host_info(),
        "versions": versions,
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

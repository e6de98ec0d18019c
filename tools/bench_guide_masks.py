"""Rank 0's guided-decoding work on the CPU, measured: reading the vocabulary's bytes, laying
out its trie, and walking it for the mask of each state along a JSON document.

A guided request waits for the mask of every state it reaches that no request of its pattern
reached before ("cold": the walk also makes the DFA rows it meets); a cached mask costs a
lookup. Each state's mask is timed cold, then walked again ("warm walk": the rows made).
CPU time of this process on one thread, so a busy machine does not inflate the figures.

    python -m tools.bench_guide_masks --model DIR --out bench/results/guide_masks_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from deltaserve.engine.json_schema import json_object_regex, schema_regex
from deltaserve.engine.rank.grammar_mask import DEAD, START, Guide
from deltaserve.engine.rank.token_bytes import read_token_bytes
from deltaserve.engine.rank.token_trie import TokenTrie
from deltaserve.tools.bench_guided import SCHEMA
from deltaserve.tools.hardware import host_info

DOCUMENTS = {  # pattern, and a document it matches whose every prefix's state is walked
    "schema": (
        schema_regex(SCHEMA),
        '{"name": "Bob Smith", "age": 42, "email": "bob@x.com", '
        '"tags": ["a", "bc"], "kind": "person", "active": true}',
    ),
    "json_object": (
        json_object_regex(),
        '{"a": [1, {"b": null}], "c": "hello world", "d": -2.5e3}',
    ),
}


def _cpu_ms(work: Any) -> tuple[Any, float]:
    start = time.process_time()
    out = work()
    return out, 1e3 * (time.process_time() - start)


def walk_document(trie: TokenTrie, pattern: str, text: str) -> dict[str, Any]:
    guide = Guide(pattern, trie)
    state, cold, warm, allowed = START, [], [], []
    for ch in text:
        mask, ms = _cpu_ms(lambda s=state: guide.allowed_tokens(s))
        cold.append(ms)
        warm.append(_cpu_ms(lambda s=state: guide.allowed_tokens(s))[1])
        allowed.append(int(mask.sum()))
        state = guide.automaton.step(state, ch.encode())
        if state == DEAD:
            raise RuntimeError(f"the document leaves the pattern at {ch!r}")
    return {
        "states_walked": len(cold),
        "dfa_states_made": guide.automaton.num_states,
        "cold_ms_total": sum(cold),
        "cold_ms_mean": statistics.mean(cold),
        "cold_ms_max": max(cold),
        "warm_walk_ms_mean": statistics.mean(warm),
        "warm_walk_ms_max": max(warm),
        "allowed_tokens_mean": statistics.mean(allowed),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a folder with tokenizer.json")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    token_bytes, read_ms = _cpu_ms(lambda: read_token_bytes(args.model))
    trie, trie_ms = _cpu_ms(lambda: TokenTrie(token_bytes))
    result: dict[str, Any] = {
        "command": "python -m tools.bench_guide_masks "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "hardware": host_info(),
        "torch": torch.__version__,
        "threads": 1,
        "vocabulary": {
            "tokens": sum(1 for b in token_bytes if b),
            "trie_nodes": trie.num_nodes,
            "read_ms": read_ms,
            "trie_ms": trie_ms,
        },
        "documents": {name: walk_document(trie, *doc) for name, doc in DOCUMENTS.items()},
    }
    print(
        f"vocabulary: {result['vocabulary']['tokens']} tokens read in {read_ms:.0f} ms, trie of {trie.num_nodes} nodes in {trie_ms:.0f} ms"
    )
    print(
        f"{'document':<12} {'states':>6} {'cold total':>10} {'cold mean':>9} {'cold max':>8} {'warm walk':>9}"
    )
    for name, d in result["documents"].items():
        print(
            f"{name:<12} {d['states_walked']:>6} {d['cold_ms_total']:>8.0f}ms {d['cold_ms_mean']:>7.1f}ms "
            f"{d['cold_ms_max']:>6.1f}ms {d['warm_walk_ms_mean']:>7.1f}ms"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

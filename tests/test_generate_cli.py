"""`deltaserve generate --json`: the shape other checks and users rely on."""

from __future__ import annotations

import json
import subprocess
import sys

from transformers import AutoTokenizer


def test_generate_json_lines(tiny_model_dir):
    cmd = [sys.executable, "-m", "deltaserve.tools.cli", "generate", "--model", str(tiny_model_dir),
           "--prompt", "The capital of France is", "--max-tokens", "6", "--ignore-eos",
           "--logprobs", "3", "--json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 6
    for row in rows:
        assert set(row) == {"token_id", "text", "logprob", "top_logprobs"}
        assert len(row["top_logprobs"]) == 3
        logprobs = [lp for _, lp in row["top_logprobs"]]
        assert logprobs == sorted(logprobs, reverse=True)
        # greedy: the chosen token is the best alternative
        assert row["top_logprobs"][0][0] == row["token_id"]
        assert abs(row["top_logprobs"][0][1] - row["logprob"]) < 1e-6
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = [row["token_id"] for row in rows]
    assert "".join(row["text"] for row in rows) == tokenizer.decode(ids)


def test_generate_refuses_out_of_vocab_ids(tiny_model_dir):
    cmd = [sys.executable, "-m", "deltaserve.tools.cli", "generate", "--model", str(tiny_model_dir),
           "--prompt-ids", "1,999999999", "--max-tokens", "2"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "out of the vocabulary" in result.stderr and "999999999" in result.stderr

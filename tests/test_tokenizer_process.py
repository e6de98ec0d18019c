"""The tokenizer in a fresh interpreter: what only a new process shows (transformers' lazy
imports), run as subprocesses. Kept apart from tests/test_http_tokenize.py, whose tests share
one event loop."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def test_tokenizers_load_side_by_side_in_a_fresh_process(tiny_model_dir):
    """The engine loads the loop's tokenizer and the worker's at once, in two threads. In a
    process that has not imported transformers yet, its lazy module failed one of them
    ("cannot import name 'AutoTokenizer'"), and the first large prompt paid a second load
    (1.4 s, measured on the H200 host). Only a fresh interpreter shows it."""
    script = textwrap.dedent(f"""
        import threading
        from deltaserve.engine.tokenizer import load_tokenizer
        errors = []
        ready = threading.Barrier(4)
        def load():
            ready.wait()
            try:
                load_tokenizer({str(tiny_model_dir)!r})
            except Exception as exc:
                errors.append(repr(exc))
        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(errors)
    """)
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    for run in runs:  # a race: several fresh processes, each about one in four before the fix
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err[-2000:]
        assert out.strip().splitlines()[-1] == "[]"


def test_serving_process_does_not_import_torch(tiny_model_dir):
    """The server process tokenizes and templates without torch, whose import (2-4 s) would sit
    on the start-up's critical path beside the ranks'; transformers' AutoTokenizer pulls it in.
    (transformers before 5.24 imports torch in its tokenizer module itself: skipped there.)"""
    script = textwrap.dedent(f"""
        import sys
        import transformers.tokenization_utils_tokenizers
        if "torch" in sys.modules:
            print("transformers", transformers.__version__, "imports torch itself")
            sys.exit(0)
        import deltaserve.http.serve, deltaserve.engine.async_engine
        from deltaserve.engine.tokenizer import load_tokenizer
        tok = load_tokenizer({str(tiny_model_dir)!r})
        text = tok.apply_chat_template([{{"role": "user", "content": "hi"}}], tokenize=False,
                                       add_generation_prompt=True)
        print(type(tok).__name__, len(tok.encode(text)) > 3, tok.decode(tok.encode("hello world")))
        print(sorted(m for m in ("torch", "triton") if m in sys.modules))
    """)
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    if lines[-1].endswith("imports torch itself"):
        pytest.skip(lines[-1])
    assert lines[-2] == "TokenizersBackend True hello world"
    assert lines[-1] == "[]"

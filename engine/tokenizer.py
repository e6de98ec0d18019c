"""Loading the model folder's tokenizer and its end-of-sequence ids; the worker thread that
tokenizes large inputs off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from deltaserve.engine.rank.model_config import ModelConfig

T = TypeVar("T")

# Texts up to this many characters are tokenized on the event loop (a few ms at most);
# larger ones in the TokenizerWorker (an 8 MiB prompt takes seconds).
INLINE_TOKENIZE_CHARS = 4096


# transformers' lazy module is not thread-safe on first import: two threads loading at once
# (the engine's loop tokenizer and the worker's) made one fail with "cannot import name
# 'AutoTokenizer'", and the first large prompt then paid a second load.
_LOAD_LOCK = threading.Lock()


def load_tokenizer(model_dir: str | Path) -> Any:
    """The folder's HF fast tokenizer (tokenizer.json); a slow one is refused."""
    path = Path(model_dir)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in model folder {model_dir}")
    with _LOAD_LOCK:
        tokenizer = tokenizer_class(path).from_pretrained(str(path))
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"the tokenizer in {model_dir} is not a fast (tokenizers) tokenizer")
    return tokenizer


def tokenizer_class(path: Path) -> Any:
    """transformers' generic fast tokenizer when the folder names it (Qwen3.5's do), imported
    from its own module; else AutoTokenizer. AutoTokenizer imports transformers' model
    configuration and with it torch: 2-4 s of the server's start on the critical path, in a
    process that otherwise never imports torch."""
    config = path / "tokenizer_config.json"
    if config.is_file():
        with open(config) as f:
            named = json.load(f).get("tokenizer_class")
        if named == "TokenizersBackend":
            with contextlib.suppress(ImportError):
                from transformers.tokenization_utils_tokenizers import TokenizersBackend

                return TokenizersBackend
    from transformers import AutoTokenizer

    return AutoTokenizer


def eos_token_ids(model_dir: str | Path, model_config: ModelConfig) -> frozenset[int]:
    """Ids that end generation (unless ignore_eos): generation_config.json's eos_token_id
    (as vLLM adds them to the stop ids) together with the model config's."""
    ids = set(model_config.eos_token_ids)
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            ids.update(int(i) for i in (eos if isinstance(eos, list) else [eos]))
    return frozenset(ids)


class TokenizerWorker:
    """One dedicated daemon thread for tokenizer work too large for the event loop.

    It uses its own tokenizer instance, made by `factory` in the thread as it starts, so
    nothing it does can collide with the loop's instance (the detokenizer, small prompts):
    a HF fast tokenizer's Rust object refuses a mutable borrow ("Already borrowed") while
    another thread is inside `encode`, and transformers may reconfigure it per call. The
    Rust encoder releases the GIL, so the loop runs meanwhile. Jobs run one at a time in
    order; a job whose caller went away (its await cancelled) before it started is skipped.
    """

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory = factory
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._made = threading.Event()  # its tokenizer made (or the attempt failed)

    def start(self) -> None:
        """Start the thread, which makes its tokenizer at once (idempotent). The engine calls
        this at start-up: made at the first large prompt instead, its loading (about a second
        for Qwen's tokenizer) delayed that prompt by as much."""
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._serve, name="deltaserve-tokenizer", daemon=True)
            self._thread.start()

    async def wait_made(self) -> None:
        """Until the started thread has made its tokenizer (or failed to). The engine waits
        for it before it serves: a load running beside the first requests holds the GIL for
        long stretches and delayed the first answer by seconds."""
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._made.wait)

    async def run(self, fn: Callable[[Any], T]) -> T:
        """`fn(tokenizer)` in the worker thread; its result, or its exception raised here."""
        if self._closed:
            raise RuntimeError("the tokenizer worker is closed")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.start()
        self._jobs.put((loop, future, fn))
        return await future

    def close(self) -> None:
        """Let the thread end after the job it is running (idempotent)."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)

    def _serve(self) -> None:
        tokenizer = None
        with contextlib.suppress(Exception):  # a failure here is raised to the first job instead
            tokenizer = self._factory()
        self._made.set()
        while (job := self._jobs.get()) is not None:
            loop, future, fn = job
            if future.cancelled():
                continue
            result, error = None, None
            try:
                if tokenizer is None:
                    tokenizer = self._factory()
                result = fn(tokenizer)
            except Exception as exc:  # the caller's to handle
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(_resolve, future, result, error)


def _resolve(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)

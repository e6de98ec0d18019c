"""Loading the model folder's tokenizer (with its chat template), its end-of-sequence ids and
its recommended sampling settings; a --chat-template that replaces the model's; the worker
thread that tokenizes large inputs off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from deltaserve.engine.model_config import (
    ConfigError,
    ModelConfig,
    read_json_object,
    to_number,
    token_ids,
)
from deltaserve.engine.sampling_params import SamplingParams

T = TypeVar("T")
log = logging.getLogger("deltaserve.engine")

# Texts up to this many characters are tokenized on the event loop (a few ms at most);
# larger ones in the TokenizerWorker (an 8 MiB prompt takes seconds).
INLINE_TOKENIZE_CHARS = 4096


# transformers' lazy module is not thread-safe on first import: two threads loading at once
# (once the engine's loop tokenizer and the worker's; now two engines in one process) made one
# fail with "cannot import name 'AutoTokenizer'".
_LOAD_LOCK = threading.Lock()


def load_tokenizer(model_dir: str | Path) -> Any:
    """The folder's HF fast tokenizer (tokenizer.json); a slow one is refused."""
    path = Path(model_dir)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in model folder {model_dir}")
    started = time.monotonic()
    with _LOAD_LOCK:
        try:
            tokenizer = tokenizer_class(path).from_pretrained(str(path))
        except Exception as e:  # a malformed tokenizer.json fails as KeyError, TypeError, ...
            raise ValueError(
                f"cannot load the tokenizer in {model_dir}: {type(e).__name__}: {e}"
            ) from e
    log.info("tokenizer loaded in %.1f s", time.monotonic() - started)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"the tokenizer in {model_dir} is not a fast (tokenizers) tokenizer")
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = processor_chat_template(path)
    return tokenizer


def processor_chat_template(path: Path) -> str | None:
    """The template in the folder's chat_template.json (the processor's file, {"chat_template":
    ...}, as VLM releases ship it), which transformers' tokenizer does not read but vLLM chats
    with (it tries the processor's template first). Used only where the tokenizer has none: a
    fine-tune edits tokenizer_config.json's and may leave the release's file stale. None if
    absent or unreadable (said in the log)."""
    file = path / "chat_template.json"
    if not file.is_file():
        return None
    try:
        template = read_json_object(file).get("chat_template")
    except ConfigError as e:  # not JSON, not an object
        log.warning("not used as the chat template: %s", e)
        return None
    if not isinstance(template, str) or not template:
        log.warning("%s has no chat_template string: not used", file)
        return None
    return template


# What tells vLLM that a --chat-template value which opens no file is the template itself
# (vllm/renderers/chat_utils/chat_template.py); a value without any is a mistyped path.
_TEMPLATE_CHARS = "{}\n"


def load_chat_template(value: str) -> str:
    """`--chat-template`'s template, read as vLLM reads the flag: the text of the file it
    names, else the value itself when it holds '{', '}' or a newline (a template given
    inline). A ValueError, at start, for a value that looks like a path but opens no file
    (a typo must not be served as a one-line template), for an empty template and for one
    that does not compile."""
    try:
        with open(value, encoding="utf-8") as f:
            template, source = f.read(), f"--chat-template {value!r}"
    except UnicodeDecodeError as e:  # a ValueError: before the next clause
        raise ValueError(f"--chat-template {value!r} is not UTF-8 text: {e}") from None
    except (OSError, ValueError) as e:  # no such file, a folder, a name too long or with NUL
        if not any(c in value for c in _TEMPLATE_CHARS):
            raise ValueError(
                f"--chat-template {value!r} looks like a file path, but it cannot be opened "
                f"({getattr(e, 'strerror', None) or e}); a template given inline has '{{', '}}' "
                "or a newline"
            ) from None
        template, source = value, "--chat-template (given inline)"
    check_chat_template(template, source)
    log.info("chat template from %s: it replaces the model's", source)
    return template


def check_chat_template(template: str, source: str = "chat_template") -> None:
    """Compile `template` as apply_chat_template will, in transformers' own environment (its
    sandbox, its {% generation %} tag, loop controls), so that a syntax error or an unknown
    filter is a ValueError naming `source` and the line at start, not a 400 on every chat."""
    if not isinstance(template, str) or not template.strip():
        raise ValueError(f"{source}: the chat template is empty")
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except TemplateError as e:
        line = f" on line {e.lineno}" if getattr(e, "lineno", None) else ""
        raise ValueError(
            f"{source}: the chat template is not valid Jinja{line}: {e.message}"
        ) from None


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
    path, raw = _generation_config(model_dir)
    try:
        return frozenset(model_config.eos_token_ids) | frozenset(
            token_ids(raw.get("eos_token_id"), "eos_token_id")
        )
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def _generation_config(model_dir: str | Path) -> tuple[Path, dict]:
    """generation_config.json's path and its object ({} without the file)."""
    path = Path(model_dir) / "generation_config.json"
    return path, read_json_object(path) if path.is_file() else {}


# transformers' GenerationConfig defaults of the settings vLLM takes from generation_config.json
# (its --generation-config auto): a value equal to its default is not a setting (to_diff_dict)
_GENERATION_SAMPLING = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "min_p": None,
    "repetition_penalty": 1.0,
}


def generation_sampling_defaults(model_dir: str | Path) -> dict[str, float | int]:
    """The sampling settings generation_config.json recommends (temperature, top_p, top_k,
    min_p, repetition_penalty), as vLLM makes them a request's defaults; {} without the
    file. A value no request could take is a ConfigError naming the file and the key."""
    path, raw = _generation_config(model_dir)
    out: dict[str, float | int] = {}
    try:
        for key, hf_default in _GENERATION_SAMPLING.items():
            value = raw.get(key)
            if value is not None and value != hf_default:
                out[key] = to_number(value, key, int if key == "top_k" else float)
        SamplingParams(max_tokens=1, **out)  # its ValueError names the key and the range
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None
    return out


class TokenizerWorker:
    """One dedicated daemon thread that loads the tokenizer and then does the tokenizer work
    too large for the event loop.

    The loop uses the same instance (the detokenizer, small prompts). That is safe: the Rust
    tokenizer takes only shared borrows in encode and decode, and transformers reconfigures
    it only when a call asks for truncation, padding or split special tokens, which
    deltaserve never does (older tokenizers refused such a reconfiguration while another
    thread was inside encode: "Already borrowed").
    A second instance cost its load again: ~1.2 s of Rust parsing that holds the GIL, on the
    start's critical path or, if loaded later, beside the first requests. The Rust encoder
    lets go of the GIL, so the loop runs meanwhile. Jobs run one at a time in order; a job
    whose caller went away (its await cancelled) before it started is skipped.
    """

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory = factory
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._made = threading.Event()  # set once the factory returned or raised
        self._tokenizer: Any = None
        self._error: BaseException | None = None

    def start(self) -> None:
        """Start the thread, which makes the tokenizer at once (idempotent)."""
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(
                target=self._serve, name="deltaserve-tokenizer", daemon=True
            )
            self._thread.start()

    async def tokenizer(self) -> Any:
        """The tokenizer, once made (starting the thread if need be); the factory's error if
        it failed."""
        self.start()
        await asyncio.get_running_loop().run_in_executor(None, self._made.wait)
        if self._error is not None:
            raise self._error
        return self._tokenizer

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
        try:
            self._tokenizer = self._factory()
        except Exception as exc:  # raised to whoever asks for the tokenizer or runs a job
            self._error = exc
        self._made.set()
        while (job := self._jobs.get()) is not None:
            loop, future, fn = job
            if future.cancelled():
                continue
            result, error = None, self._error
            if error is None:
                try:
                    result = fn(self._tokenizer)
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

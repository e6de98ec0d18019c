"""`deltaserve serve` flags that change what a request gets, served: the config is made from
the command line as `deltaserve serve` makes it (`serve._server_config`), the app runs on one
engine for the module (a second app costs no engine start), the `openai` client asks.

- `--chat-template FILE_OR_TEMPLATE` (vLLM's): chats render with it instead of the model's.
- `--default-chat-template-kwargs JSON` (vLLM's): every chat's template variables; a request's
  chat_template_kwargs win key by key.
- `--seed N` (vLLM's): requests that give no seed draw theirs from a generator seeded with N.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import openai
import pytest
import pytest_asyncio
from serve_helpers import wait_idle

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.http import serve
from deltaserve.http.listen import start_server
from deltaserve.http.server import ServerConfig, build_app

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny-flags"
MESSAGES = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Name a colour."},
]
# Uses two variables the model's own ChatML template does not know: greeting and enable_thinking
TEMPLATE = """{%- for m in messages %}<|im_start|>{{ m.role }} said:
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}
<think>

</think>
{% endif %}{{ greeting | default('') }}{%- endif %}"""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model_dir) -> AsyncIterator[AsyncEngine]:
    engine = await AsyncEngine.start(
        EngineConfig(model=str(tiny_model_dir), max_model_len=256, max_num_seqs=2)
    )
    try:
        yield engine
    finally:
        await engine.shutdown()


@contextlib.asynccontextmanager
async def served(engine: AsyncEngine, config: ServerConfig) -> AsyncIterator[openai.AsyncOpenAI]:
    runner, _ = await start_server(build_app(engine, config), "127.0.0.1", 0)
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{runner.addresses[0][1]}/v1",
        api_key="x",
        max_retries=0,
        timeout=60,
    )
    try:
        yield client
    finally:
        await client.close()
        await runner.cleanup()
        await wait_idle(engine)


def config_from_flags(model_dir, *flags: str) -> ServerConfig:
    return serve._server_config(
        serve.parse_args([str(model_dir), "--served-model-name", MODEL, *flags])
    )


async def chat_and_reference(
    client: openai.AsyncOpenAI, rendered: str, tokenizer, template_kwargs=None
) -> None:
    """The served chat's greedy reply and prompt size are those of `rendered` (transformers'
    rendering) sent as token ids to /v1/completions: the chat's prompt was `rendered`."""
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    greedy = dict(model=MODEL, max_tokens=6, temperature=0)
    chat = await client.chat.completions.create(
        messages=MESSAGES,
        **greedy,
        extra_body={
            "ignore_eos": True,
            **({"chat_template_kwargs": template_kwargs} if template_kwargs else {}),
        },
    )
    ref = await client.completions.create(prompt=ids, **greedy, extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens == len(ids), rendered
    assert chat.choices[0].message.content == ref.choices[0].text


async def test_chat_template_flag_and_default_kwargs(engine, tiny_model_dir, tmp_path):
    """The given template replaces the model's (a file, or the template inline, as vLLM reads
    the flag); the default kwargs reach it, a request's own win key by key. Before, the flags
    were unknown (serve exited 2)."""
    tok = engine.tokenizer
    file = tmp_path / "chat.jinja"
    file.write_text(TEMPLATE)
    defaults = {"greeting": "Sure.", "enable_thinking": False}

    def render(**kwargs) -> str:
        return tok.apply_chat_template(
            MESSAGES, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False, **kwargs
        )

    assert render() != tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert "<think>" in render(**defaults) and "<think>" not in render(greeting="Sure.")
    flags = ["--default-chat-template-kwargs", json.dumps(defaults)]
    inline = config_from_flags(tiny_model_dir, "--chat-template", TEMPLATE, *flags)
    config = config_from_flags(tiny_model_dir, "--chat-template", str(file), *flags)
    assert inline == config and config.chat_template == TEMPLATE
    async with served(engine, config) as client:
        await chat_and_reference(client, render(**defaults), tok)
        # the request's greeting wins; the server's enable_thinking stays
        await chat_and_reference(
            client, render(greeting="No.", enable_thinking=False), tok, {"greeting": "No."}
        )
        await chat_and_reference(
            client, render(greeting="Sure.", enable_thinking=True), tok, {"enable_thinking": True}
        )
    # without the flags: the model's template, no default kwargs
    async with served(engine, config_from_flags(tiny_model_dir)) as client:
        await chat_and_reference(
            client,
            tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
            tok,
        )


async def test_seed_flag_makes_unseeded_requests_repeat(engine, tiny_model_dir):
    """`--seed 7`: two servers started alike answer the same unseeded requests alike (the
    engine drew a random seed for each); a request's own seed still wins."""
    sampled = dict(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=6,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    runs = []
    for _ in range(2):
        async with served(engine, config_from_flags(tiny_model_dir, "--seed", "7")) as client:
            runs.append(
                [(await client.completions.create(**sampled)).choices[0].text for _ in range(2)]
            )
            own = (await client.completions.create(seed=123, **sampled)).choices[0].text
    assert runs[0] == runs[1], runs
    assert runs[0][0] != runs[0][1], "the second request must draw a new seed"
    async with served(engine, config_from_flags(tiny_model_dir)) as client:
        assert (await client.completions.create(seed=123, **sampled)).choices[0].text == own

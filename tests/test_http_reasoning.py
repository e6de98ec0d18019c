"""Reasoning output (`--reasoning-parser qwen3|deepseek_r1`): chat messages carry the model's
thinking as `reasoning`, its answer as `content`, streamed or not.

The parser is tested on crafted texts (the three cases of Qwen3.5's template: both tags in the
output, only the closing one, none; every text cut into chunks at every position), the chat
formatter on crafted token events through the real detokenizer, and the server end to end on
what the random model really produces, with a chat template written for the test that opens
a think block in the prompt unless `enable_thinking` is false.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import aiohttp
import openai
import pytest
from serve_helpers import in_process_server
from test_http_tool_parsers import assert_linear, code

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.events import FinishedEvent, TokenEvent
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.engine.tokenizer import load_tokenizer
from deltaserve.http import serve
from deltaserve.http.errors import ApiError
from deltaserve.http.listen import start_server
from deltaserve.http.protocol import parse_chat_request
from deltaserve.http.reasoning import END_THINK, THINK, ReasoningParser, ReasoningSplitter
from deltaserve.http.responses import ChatFormatter, ChoiceState, TokenStrings, usage
from deltaserve.http.server import ServerConfig, build_app
from deltaserve.http.tool_formats import TOOL_CALL

MODEL = "tiny-think"
THINK_ID, END_THINK_ID = 9001, 9002  # the parser's tag ids in the unit tests


def expected_split(
    text: str, starts_in_reasoning: bool, ends_at_tool_call: bool = False
) -> tuple[str, str]:
    """The rule, written plainly: outside a block only a leading <think> opens one; the first
    </think> closes it; <think> tags inside it are dropped; the rest is content as written.
    With `ends_at_tool_call` (qwen3), a <tool_call> before that </think> followed, past
    whitespace, by "<function" and a whitespace or "=" closes it too, and is content."""
    if not starts_in_reasoning:
        if not text.startswith(THINK):
            return "", text
        text = text[len(THINK) :]
    block_end = text.find(END_THINK) if END_THINK in text else len(text)
    for match in re.finditer(TOOL_CALL, text[:block_end] if ends_at_tool_call else ""):
        if re.match(r"<function[\s=]", text[match.end() :].lstrip()):
            return text[: match.start()].replace(THINK, ""), text[match.start() :]
    head, _, tail = text.partition(END_THINK)
    return head.replace(THINK, ""), tail


def expected_reasoning_tokens(
    ids: list[int], starts_in_reasoning: bool, think_id: int, end_think_id: int
) -> int:
    """The same rule on token ids: the tokens inside the block, the tags not counted."""
    if not starts_in_reasoning:
        if not ids or ids[0] != think_id:
            return 0
        ids = ids[1:]
    block = ids[: ids.index(end_think_id)] if end_think_id in ids else ids
    return sum(t != think_id for t in block)


def split_chunks(
    chunks: list[str], starts_in_reasoning: bool, ends_at_tool_call: bool = False
) -> tuple[list[str], list[str]]:
    """Each chunk fed in turn, then the flush: the reasoning and content deltas."""
    splitter = ReasoningSplitter(
        starts_in_reasoning, THINK_ID, END_THINK_ID, ends_at_tool_call=ends_at_tool_call
    )
    parts = [splitter.feed(c) for c in chunks] + [splitter.flush()]
    return [p.reasoning for p in parts], [p.content for p in parts]


CASES = [
    # Qwen3 with a template that lets the model open the block: both tags in the output
    (False, "<think>\nplan: 2+2\n</think>\n\nIt is 4."),
    # Qwen3.5, thinking on: the prompt opened the block, the output holds only </think>
    (True, "plan: 2+2\n</think>\n\nIt is 4."),
    # Qwen3.5, enable_thinking false: the prompt closed an empty block, no tag in the output
    (False, "It is 4 <b>."),
    # thinking cut short (max_tokens): no tag, all reasoning
    (True, "still <thinking> about 2+2"),
    # a <think> that does not open the output, a lookalike tag, tags after the block: content
    (False, "Use <think>x</think> tags"),
    (False, "<thinking>no</think>"),
    (True, "a<think>b</think>c <think>d</think></think>"),
    # the output ends inside what could be a tag
    (True, "abc</thi"),
    (False, "<thi"),
    (False, ""),
    (True, "思考する</think>答え"),
]


# qwen3 only: Qwen3.5 may call a tool without closing its thinking (vLLM's qwen3 parser)
CALL = "<tool_call>\n<function=search>\n<parameter=q>\nx\n</parameter>\n</function>\n</tool_call>"
TOOL_CALL_CASES = [
    (True, "Let me search.\n" + CALL),  # the thinking left open: the call ends it
    (True, "a <tool_call> is how I call.\n<tool_call>  \n\t<function name=x>"),  # a mention first
    (True, "x<tool_call><function=f></think>after"),  # a call before a </think>: content
    (True, "x</think><tool_call>\n<function=f>"),  # closed first: as without tools
    (True, "<tool_call>\n<functions>"),  # "<function" must end at a space or "="
    (True, "cut off at <tool_call>\n<functi"),  # the output ends undecided: thinking
    (False, "<think>plan<tool_call>\n<function=f>"),  # a block the output opened
    (False, "answer <tool_call>\n<function=f>"),  # outside a block: content anyway
    (True, "a<think>b<tool_call>\n\n<function=f>"),
]


@pytest.mark.parametrize(
    "starts_in_reasoning, text, ends_at_tool_call",
    [(*case, False) for case in CASES + TOOL_CALL_CASES]
    + [(*case, True) for case in CASES + TOOL_CALL_CASES],
)
def test_streamed_parts_add_up_to_the_whole_texts_parts(
    starts_in_reasoning, text, ends_at_tool_call
):
    """Cut into two or three chunks at every position, and one character a chunk: the deltas
    add up to the split of the whole text, and that is the rule's."""
    whole = expected_split(text, starts_in_reasoning, ends_at_tool_call)
    reasoning, content = split_chunks([text], starts_in_reasoning, ends_at_tool_call)
    assert ("".join(reasoning), "".join(content)) == whole
    cuts = [(i,) for i in range(len(text) + 1)] + list(
        itertools.combinations(range(len(text) + 1), 2)
    )
    for cut in [*cuts, tuple(range(len(text) + 1))]:
        bounds = (0, *cut, len(text))
        chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
        reasoning, content = split_chunks(chunks, starts_in_reasoning, ends_at_tool_call)
        assert ("".join(reasoning), "".join(content)) == whole, chunks


def test_text_is_sent_at_once_and_a_split_tag_held_back_only_while_undecided():
    """Reasoning without a '<' goes out in its own delta; '</th' waits for the next delta and
    never appears in either part."""
    splitter = ReasoningSplitter(True, THINK_ID, END_THINK_ID)
    assert splitter.feed("plan ") == ("plan ", "")
    assert splitter.feed("it</th") == ("it", "")
    assert splitter.feed("ink>\n\nIt") == ("", "\n\nIt")
    assert splitter.feed(" is 4 </th") == ("", " is 4 </th")  # after the block: as written
    assert splitter.flush() == ("", "")
    outside = ReasoningSplitter(False, THINK_ID, END_THINK_ID)
    assert outside.feed("<") == ("", "")
    assert outside.feed("b>") == ("", "<b>")
    not_a_tag = ReasoningSplitter(True, THINK_ID, END_THINK_ID)
    assert not_a_tag.feed("a </") == ("a ", "")
    assert not_a_tag.feed("b>") == ("</b>", "")


def test_reasoning_tokens_are_counted_by_the_tags_ids():
    """As vLLM counts them: the tokens inside the block, the tags not included."""

    def count(starts_in_reasoning: bool, ids: list[int]) -> int:
        splitter = ReasoningSplitter(starts_in_reasoning, THINK_ID, END_THINK_ID)
        for token_id in ids:
            splitter.feed("", token_id)
        return splitter.reasoning_tokens

    assert count(True, [1, 2, END_THINK_ID, 3]) == 2
    assert count(True, [1, THINK_ID, 2]) == 2
    assert count(False, [THINK_ID, 1, 2, END_THINK_ID, 3, THINK_ID, 4]) == 2
    assert count(False, [1, THINK_ID, 2, END_THINK_ID]) == 0


@pytest.mark.parametrize(
    "name, prompt, inside",
    [
        ("qwen3", [5, THINK_ID, 6], True),  # Qwen3.5, thinking on: `<think>\n` ends the prompt
        ("qwen3", [5, THINK_ID, 6, END_THINK_ID, 7], False),  # enable_thinking false
        ("qwen3", [5, 6], False),  # no block in the prompt: the model may open one
        ("qwen3", [THINK_ID, 1, END_THINK_ID, 5, THINK_ID, 6], True),  # history before it
        ("deepseek_r1", [5, 6], True),  # R1 may leave out its <think>
        ("deepseek_r1", [5, THINK_ID, 6, END_THINK_ID], False),
        ("deepseek_r1", [END_THINK_ID, 5, THINK_ID], True),
    ],
)
def test_where_the_output_starts_is_read_from_the_prompt(name, prompt, inside):
    assert ReasoningParser(name, THINK_ID, END_THINK_ID).starts_in_reasoning(prompt) is inside


def test_parser_names_are_checked_at_start(tiny_model_dir, capsys):
    """vLLM's names; any other is refused by the flags (exit 2, before any weight loads) and by
    the config; a tokenizer without the tags is refused when the server is built."""
    args = serve.parse_args([str(tiny_model_dir), "--reasoning-parser", "qwen3"])
    assert serve._server_config(args).reasoning_parser == "qwen3"
    assert serve._server_config(serve.parse_args([str(tiny_model_dir)])).reasoning_parser is None
    with pytest.raises(SystemExit) as info:
        serve.serve_main([str(tiny_model_dir), "--reasoning-parser", "granite"])
    assert info.value.code == 2
    assert "--reasoning-parser: invalid choice: 'granite'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3"):
        ServerConfig(MODEL, reasoning_parser="granite")

    class NoTags:  # a tokenizer's vocabulary without the tags
        @staticmethod
        def get_vocab() -> dict[str, int]:
            return {"<think>": 5}

    with pytest.raises(ValueError, match="tokenizer has no </think> token"):
        ReasoningParser.for_tokenizer("qwen3", NoTags)


def test_an_assistants_reasoning_sent_back_reaches_the_template():
    """As vLLM takes history: `reasoning` (or its older name `reasoning_content`) on an
    assistant message, handed to the template under both names; refused on other roles and
    when not a string. It was refused as an unknown message field."""
    for key in ("reasoning", "reasoning_content"):
        reply = {"role": "assistant", "content": None, key: "2+2 is 4", "refusal": None}
        req = parse_chat_request({"messages": [{"role": "user", "content": "2+2?"}, reply]})
        assert req.messages[1] == {
            "role": "assistant",
            "content": "",
            "reasoning": "2+2 is 4",
            "reasoning_content": "2+2 is 4",
        }
    with pytest.raises(ApiError, match=r"messages\[0\]\.reasoning"):
        parse_chat_request({"messages": [{"role": "user", "content": "a", "reasoning": "b"}]})
    with pytest.raises(ApiError, match="reasoning must be a string"):
        parse_chat_request({"messages": [{"role": "assistant", "content": "a", "reasoning": 3}]})
    assert parse_chat_request({"messages": [{"role": "user", "content": "a"}]}).include_reasoning
    req = parse_chat_request(
        {"messages": [{"role": "user", "content": "a"}], "include_reasoning": False}
    )
    assert req.include_reasoning is False


def test_only_qwen3_ends_the_thinking_at_a_call():
    """As vLLM's parsers: qwen3 sends the call as content (for the tool-call parser, which
    would never see it in the reasoning); deepseek_r1 keeps it in the thinking."""
    thought = "Let me search.\n"
    for name, expected in [("qwen3", (thought, CALL)), ("deepseek_r1", (thought + CALL, ""))]:
        splitter = ReasoningParser(name, THINK_ID, END_THINK_ID).splitter(True)
        parts = [splitter.feed(c) for c in (thought + "<tool_", "call>\n", "<function=", CALL[22:])]
        parts.append(splitter.flush())
        assert ("".join(p.reasoning for p in parts), "".join(p.content for p in parts)) == expected
    assert expected_split(thought + CALL, True, ends_at_tool_call=True) == (thought, CALL)


def test_held_after_a_tool_call_only_while_undecided():
    """A <tool_call> in the thinking waits for what follows it: whitespace keeps it waiting,
    "<function=" sends it as content, anything else sends it on as thinking."""
    splitter = ReasoningSplitter(True, THINK_ID, END_THINK_ID, ends_at_tool_call=True)
    assert splitter.feed("I call <tool_call>") == ("I call ", "")
    assert splitter.feed(" \n") == ("", "")
    assert splitter.feed("<funct") == ("", "")
    assert splitter.feed("ion=f>") == ("", "<tool_call> \n<function=f>")
    assert splitter.feed("</think>") == ("", "</think>")
    mention = ReasoningSplitter(True, THINK_ID, END_THINK_ID, ends_at_tool_call=True)
    assert mention.feed("a <tool_call>\n") == ("a ", "")
    assert mention.feed("tags</th") == ("<tool_call>\ntags", "")


def test_reasoning_tokens_stop_at_the_call():
    """The tokens from the call's <tool_call> token on are the call's, though the text that
    decides it comes tokens later (a detokenizer holds text back); a <tool_call> that is not
    a call is thinking."""
    tool_call_id = 9003
    tokens = [
        ("plan", 5),
        (" <tool_call>", tool_call_id),
        (" x", 6),
        ("\n", 7),
        ("<tool_call>", tool_call_id),
        ("\n", 8),
        ("<function=f>", 10),
        ("\n", 11),
    ]
    text = "".join(text for text, _ in tokens)
    cases = [("qwen3", 4, text.partition("\n")[0] + "\n"), ("deepseek_r1", 8, text)]
    for name, reasoning_tokens, reasoning in cases:
        splitter = ReasoningParser(name, THINK_ID, END_THINK_ID, tool_call_id).splitter(True)
        late = [""] * 3 + [text for text, _ in tokens]  # each text three tokens late
        parts = [splitter.feed(late[i], token_id) for i, (_, token_id) in enumerate(tokens)]
        parts += [splitter.feed(text) for text in late[len(tokens) :]] + [splitter.flush()]
        assert "".join(p.reasoning for p in parts) == reasoning
        assert "".join(p.content for p in parts) == text[len(reasoning) :]
        assert splitter.reasoning_tokens == reasoning_tokens, name


def test_a_delta_costs_its_length_not_the_text_before_it():
    """Long thinking with tags in it, a <tool_call> mentioned and whitespace after it (held
    until what follows says it is no call), then the answer, in 4-character deltas."""

    def thinking(n: int) -> str:
        mentions = code(n).replace("return", "<tool_call> return")
        return mentions + "<tool_call>" + " \n" * 40 * n + "so</think>" + code(n)

    assert_linear(
        lambda: ReasoningParser("qwen3", THINK_ID, END_THINK_ID).splitter(True).feed, thinking
    )


# ---- the chat formatter, on crafted token events ---------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def both_ways(tokenizer, parser: ReasoningParser, prompt_text: str, output_text: str):
    """The formatter's two modes on the same token events, detokenized by the engine's own
    detokenizer, here holding back 9 characters (as for a stop string of 10) so that the text
    deltas cut the tags: the prompt's and output's ids, the streamed chunks, the whole
    response's body, and the streaming formatter."""
    prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
    ids = tokenizer.encode(output_text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=("@" * 10,))
    events = [TokenEvent(0, t, detok.add(t), -0.5, [(t, -0.5)]) for t in ids]
    finished = FinishedEvent(0, "length", len(prompt), len(ids), detok.flush())
    strings = TokenStrings(tokenizer)

    def formatter() -> ChatFormatter:
        return ChatFormatter(
            "chatcmpl-1", MODEL, strings, True, reasoning=parser, prompt_ids=prompt
        )

    streaming, streamed = formatter(), ChoiceState()
    chunks = [streaming.token(0, ev, streamed) for ev in events] + [
        streaming.finish(0, finished, streamed)
    ]
    whole, state = formatter(), ChoiceState()
    for ev in events:
        whole.token(0, ev, state)
    whole.finish(0, finished, state)
    state.finish_reason = "length"
    return prompt, ids, chunks, whole.response([state], usage(len(prompt), len(ids))), streaming


@pytest.mark.parametrize(
    "prompt_text, output_text",
    [
        ("<|im_start|>assistant\n<think>\n", "Let me add 2 and 2.\n</think>\n\nIt is 4."),
        ("<|im_start|>assistant\n", "<think>Let me add 2 and 2.</think>It is 4."),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "It is 4."),
    ],
)
def test_chat_deltas_add_up_to_the_message(tokenizer, prompt_text, output_text):
    """The formatter's two modes (`both_ways`): streamed parts add up to the message, no delta
    holds a piece of a tag, one logprobs entry per token, and usage counts the tokens before
    </think>."""
    parser = ReasoningParser.for_tokenizer("qwen3", tokenizer)
    prompt, ids, chunks, body, streaming = both_ways(tokenizer, parser, prompt_text, output_text)
    strings = TokenStrings(tokenizer)
    message = body["choices"][0]["message"]
    reasoning, content = expected_split(output_text, parser.starts_in_reasoning(prompt))
    assert message == {
        "role": "assistant",
        "content": content or None,
        "reasoning": reasoning or None,
    }
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning", "") for d in deltas) == reasoning
    assert "".join(d.get("content", "") for d in deltas) == content
    assert not any("<" in text for d in deltas for text in d.values()), deltas
    entries = [c["choices"][0]["logprobs"]["content"] for c in chunks[:-1]]
    assert [len(e) for e in entries] == [1] * len(ids)
    assert [e[0]["token"] for e in entries] == [strings.text(t) for t in ids]
    inside = parser.starts_in_reasoning(prompt)
    reasoning_tokens = expected_reasoning_tokens(ids, inside, parser.think_id, parser.end_think_id)
    assert (reasoning_tokens > 0) == (END_THINK in output_text)
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": reasoning_tokens}
    assert streaming.usage_chunk(usage(len(prompt), len(ids)))["usage"] == body["usage"]


def test_a_call_in_open_thinking_through_the_formatter(tokenizer):
    """qwen3 with the model's tokenizer (its <tool_call> token) and text held back by the
    detokenizer: the thinking Qwen3.5 leaves open before a call is the reasoning, the call is
    the content (for the tool-call parser: tests/test_http_tools.py), streamed or not, and the
    reasoning tokens stop at the call's <tool_call>."""
    parser = ReasoningParser.for_tokenizer("qwen3", tokenizer)
    assert parser.tool_call_id == tokenizer.get_vocab()[TOOL_CALL]
    thought = "Let me search.\n"
    _, ids, chunks, body, streaming = both_ways(
        tokenizer, parser, "<|im_start|>assistant\n<think>\n", thought + CALL
    )
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": CALL, "reasoning": thought}
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning", "") for d in deltas) == thought
    assert "".join(d.get("content", "") for d in deltas) == CALL
    reasoning_tokens = ids.index(parser.tool_call_id)
    assert 0 < reasoning_tokens < len(ids)
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": reasoning_tokens}
    assert streaming.usage_chunk(usage(1, len(ids)))["usage"]["completion_tokens_details"] == {
        "reasoning_tokens": reasoning_tokens
    }


# ---- the server end to end -----------------------------------------------------------------

# Written for this test: Qwen3.5's way of thinking (the generation prompt opens the block, or
# holds an empty one when enable_thinking is false) and of replaying an assistant's reasoning.
THINKING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' and message['reasoning_content'] is defined -%}"
    "{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
MAX_TOKENS = 12


def thinking_model(tiny_model_dir: Path, folder: Path) -> Path:
    """The tiny checkpoint with THINKING_TEMPLATE as its tokenizer's chat template."""
    folder.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.name != "tokenizer_config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


async def test_reasoning_end_to_end(tiny_model_dir, tmp_path):
    """With --reasoning-parser qwen3, on what the random model generates greedily: message
    and stream agree, and reasoning + content are the raw text of the same request (the
    engine's, and /v1/completions', which the parser leaves alone). Thinking on: all reasoning
    up to a </think>; enable_thinking false: all content; include_reasoning false: none; an
    assistant's reasoning sent back is rendered. Without the flag, nothing changes."""
    folder = thinking_model(tiny_model_dir, tmp_path / "model")
    config = EngineConfig(model=str(folder), max_model_len=512, max_num_seqs=2)
    async with in_process_server(config, ServerConfig(MODEL, reasoning_parser="qwen3")) as s:
        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
        tok = s.engine.tokenizer
        parser = ReasoningParser.for_tokenizer("qwen3", tok)
        base = dict(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
        no_eos = {"ignore_eos": True}

        async def raw(template_kwargs: dict) -> tuple[list[int], str, list[int]]:
            """The prompt, and the greedy output's text and ids, from the engine itself."""
            text = tok.apply_chat_template(
                MESSAGES, add_generation_prompt=True, tokenize=False, **template_kwargs
            )
            prompt = tok.encode(text, add_special_tokens=False)
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
            events = [ev async for ev in s.engine.generate(prompt, params)]
            completion = await client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            out_text = "".join(ev.text for ev in events)
            assert out_text and completion.choices[0].text == out_text
            return prompt, out_text, [ev.token_id for ev in events if isinstance(ev, TokenEvent)]

        for template_kwargs in ({}, {"enable_thinking": False}):
            prompt, out_text, out_ids = await raw(template_kwargs)
            starts_in_reasoning = not template_kwargs
            assert parser.starts_in_reasoning(prompt) is starts_in_reasoning
            reasoning, content = expected_split(out_text, starts_in_reasoning)
            body = {**base, "extra_body": {**no_eos, "chat_template_kwargs": template_kwargs}}
            r = await client.chat.completions.create(**body, logprobs=True)
            message = r.choices[0].message
            assert (message.reasoning, message.content) == (reasoning or None, content or None)
            assert len(r.choices[0].logprobs.content) == MAX_TOKENS
            reasoning_tokens = expected_reasoning_tokens(
                out_ids, starts_in_reasoning, parser.think_id, parser.end_think_id
            )
            assert r.usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
            stream = await client.chat.completions.create(
                **body, logprobs=True, stream=True, stream_options={"include_usage": True}
            )
            chunks = [c async for c in stream]
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == reasoning
            assert "".join(d.content or "" for d in deltas) == content
            assert (
                sum(
                    len(c.choices[0].logprobs.content)
                    for c in chunks
                    if c.choices and c.choices[0].logprobs
                )
                == MAX_TOKENS
            )
            assert chunks[-1].usage == r.usage

        # include_reasoning false: the reasoning left out, streamed or not
        prompt, out_text, _ = await raw({})
        hidden = {**no_eos, "include_reasoning": False}
        r = await client.chat.completions.create(**base, extra_body=hidden)
        content = expected_split(out_text, True)[1]
        assert (r.choices[0].message.reasoning, r.choices[0].message.content) == (
            None,
            content or None,
        )
        stream = await client.chat.completions.create(**base, stream=True, extra_body=hidden)
        assert not any(
            getattr(c.choices[0].delta, "reasoning", None) for c in [c async for c in stream]
        )
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(**base, logprobs=True, extra_body=hidden)
        assert info.value.body["param"] == "include_reasoning"

        # a choice while thinking is on would land in the reasoning: refused; with it off, honoured
        choice = {"structured_outputs": {"choice": ["yes", "no"]}}
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(**base, extra_body=choice)
        assert (
            info.value.body["param"] == "structured_outputs.choice"
            and "enable_thinking" in info.value.body["message"]
        )
        off = {**choice, "chat_template_kwargs": {"enable_thinking": False}}
        r = await client.chat.completions.create(**base, extra_body=off)
        assert (r.choices[0].message.content, r.choices[0].message.reasoning) in (
            ("yes", None),
            ("no", None),
        )

        # the reply sent back as history (the SDK's model_dump carries `reasoning`): rendered
        reply = (
            (await client.chat.completions.create(**base, extra_body=no_eos))
            .choices[0]
            .message.model_dump()
        )
        reasoning, content = expected_split(out_text, True)
        assert (reply["reasoning"], reply["content"]) == (reasoning or None, content or None)
        history = [*MESSAGES, reply, {"role": "user", "content": "Sure?"}]
        r = await client.chat.completions.create(**{**base, "messages": history, "max_tokens": 1})
        rendered = [
            *MESSAGES,
            {"role": "assistant", "content": content, "reasoning_content": reasoning},
            {"role": "user", "content": "Sure?"},
        ]
        text = tok.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
        assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
        await client.close()

        # Without the flag (a second app on the same engine): the text as generated, in content
        runner, _ = await start_server(build_app(s.engine, ServerConfig(MODEL)), "127.0.0.1", 0)
        try:
            url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions"
            plain = {
                "model": MODEL,
                "messages": MESSAGES,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            }
            async with aiohttp.ClientSession() as http:
                async with http.post(url, json=plain) as resp:
                    body = await resp.json()
                assert body["choices"][0]["message"] == {"role": "assistant", "content": out_text}
                assert "completion_tokens_details" not in body["usage"]
                async with http.post(url, json={**plain, "include_reasoning": False}) as resp:
                    assert resp.status == 400
                    assert (await resp.json())["error"]["param"] == "include_reasoning"
        finally:
            await runner.cleanup()

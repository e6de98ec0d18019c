"""The model's generation_config.json sampling settings are the server's defaults, as in
`vllm serve` (its --generation-config auto): a request that leaves temperature, top_p, top_k,
min_p or repetition_penalty out (or null) samples as the model's authors recommend; a value
the request gives wins; `--generation-config vllm` ignores the file.

Before, they were ignored: a Qwen3.5 release's recommended top_k/top_p/temperature applied
under vLLM but not here, so the same client code sampled from the whole vocabulary at
temperature 1.0.
"""

from __future__ import annotations

import json

import aiohttp
from serve_helpers import in_process_server

from deltaserve.engine.config import EngineConfig
from deltaserve.http import serve
from deltaserve.http.server import ServerConfig
from deltaserve.http.state import ServerState

MODEL = "tiny-gen"
PROMPT = "The quick brown fox jumps over the lazy dog."


async def _post(url: str, path: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        data = await r.json()
        assert r.status == 200, data
        return data


async def _text(url: str, body: dict) -> str:
    return (await _post(url, "/v1/completions", body))["choices"][0]["text"]


async def test_generation_config_sampling_is_the_default(tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.name != "generation_config.json":
            (folder / f.name).symlink_to(f)
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    # top_k 1 is argmax: the defaults' effect shows as the greedy text; top_p 1.0 is
    # transformers' own default, which vLLM does not apply as a setting
    gen.update(do_sample=True, temperature=0.7, top_k=1, top_p=1.0)
    (folder / "generation_config.json").write_text(json.dumps(gen))
    config = EngineConfig(model=str(folder), max_model_len=256, max_num_seqs=2)
    async with in_process_server(config, ServerConfig(MODEL)) as s:
        base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "seed": 1, "ignore_eos": True}
        greedy = await _text(s.url, {**base, "temperature": 0})
        assert await _text(s.url, base) == greedy
        nulls = {**base, "top_k": None, "temperature": None}  # null: the default, as vLLM reads it
        assert await _text(s.url, nulls) == greedy
        # the request's own top_k wins: sampled at the file's temperature
        assert await _text(s.url, {**base, "top_k": 0}) != greedy
        chat = {
            "model": MODEL,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 12,
            "seed": 1,
            "ignore_eos": True,
        }
        chat_greedy = await _post(s.url, "/v1/chat/completions", {**chat, "temperature": 0})
        chat_default = await _post(s.url, "/v1/chat/completions", chat)
        assert chat_default["choices"][0]["message"] == chat_greedy["choices"][0]["message"]
        defaults = ServerState(s.engine, ServerConfig(MODEL)).sampling_defaults
        assert defaults == {"temperature": 0.7, "top_k": 1}
        ignored = ServerState(s.engine, ServerConfig(MODEL, generation_config="vllm"))
        assert ignored.sampling_defaults == {}
    args = serve.parse_args([str(folder), "--generation-config", "vllm"])
    assert serve._server_config(args).generation_config == "vllm"
    assert serve._server_config(serve.parse_args([str(folder)])).generation_config == "auto"

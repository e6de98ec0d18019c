"""The bodies the routers forward for a client's plain request: their request structs
serialized with every non-optional field at its default (sglang-router 0.3.2's chat and
completion structs; vllm-router 0.1.17's, the same plus include_reasoning)."""

SGLANG_ROUTER_CHAT = {
    "messages": [{"role": "user", "content": "hi"}],
    "model": "m",
    "logprobs": False,
    "max_completion_tokens": 8,
    "stream": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
SGLANG_ROUTER_COMPLETION = {
    "model": "m",
    "prompt": "x",
    "max_tokens": 8,
    "stream": False,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}
VLLM_ROUTER_CHAT = {**SGLANG_ROUTER_CHAT, "include_reasoning": True}
VLLM_ROUTER_COMPLETION = {**SGLANG_ROUTER_COMPLETION, "include_reasoning": True}

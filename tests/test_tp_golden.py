"""Tensor parallelism on the CPU (gloo): every layer sharded, golden against HF at TP=2 and
TP=4, greedy tokens identical to TP=1, each rank holding only its shard of the state."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen3_5ForCausalLM

from deltaserve.engine.rank.executor import Executor, ExecutorConfig
from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem
from deltaserve.tools.golden import compare_logprobs

DECODE_STEPS = 8


def run_rank(
    rank: int, world: int, model_dir: str, init_file: str, ids: list[int], out: str, extra: dict
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        ex = Executor(
            ExecutorConfig(
                model_dir, rank=rank, tp_size=world, max_num_seqs=2, num_kv_blocks=64, **extra
            )
        )
        spec = SamplingSpec(seed=0, num_logprobs=8)
        first = StepItem(1, 0, ids, False, NewRequest(len(ids) + DECODE_STEPS + 1, spec))
        prefill = ex.forward([first], every_position=True)
        tokens, step_logprobs = [], []
        # rank 0 picks each greedy token and broadcasts it, so every rank feeds the same one
        next_token = torch.tensor([int(prefill[-1].argmax()) if rank == 0 else 0])
        dist.broadcast(next_token, src=0)
        for step in range(DECODE_STEPS):
            token = int(next_token)
            tokens.append(token)
            item = StepItem(1, len(ids) + step, [token], True)
            logits = ex.forward([item])
            if rank == 0:
                step_logprobs.append(logits[0].log_softmax(-1))
                next_token = torch.tensor([int(logits[0].argmax())])
            dist.broadcast(next_token, src=0)
        snap = ex.snapshot()
        if rank == 0:
            torch.save(
                {"prefill": prefill, "decode": torch.stack(step_logprobs), "tokens": tokens}, out
            )
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump({"state_heads": snap.state_heads, "kv_heads": snap.kv_heads}, f)
    finally:
        dist.destroy_process_group()


def run_tp(world: int, model_dir, tmp_path, ids: list[int], **extra) -> dict:
    """`extra`: more ExecutorConfig fields for every rank."""
    out = str(tmp_path / f"tp{world}.pt")
    init = str(tmp_path / f"init{world}")
    mp.start_processes(
        run_rank,
        args=(world, str(model_dir), init, ids, out, extra),
        nprocs=world,
        start_method="spawn",
    )
    result = torch.load(out)
    result["ranks"] = []
    for r in range(world):
        with open(f"{out}.rank{r}.json") as f:
            result["ranks"].append(json.load(f))
    return result


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    gen = random.Random(99)
    return [gen.randrange(248044) for _ in range(130)]


@pytest.fixture(scope="module")
def tp1(tiny_model_dir, tmp_path_factory, prompt):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run_tp(1, tiny_model_dir, tmp_path_factory.mktemp("tp1"), prompt)


@pytest.mark.parametrize("world", [2, 4])
def test_tp_matches_hf_and_tp1(world, tiny_model_dir, tmp_path, prompt, tp1):
    result = run_tp(world, tiny_model_dir, tmp_path, prompt)
    assert result["tokens"] == tp1["tokens"], "greedy tokens differ from TP=1"

    hf = Qwen3_5ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    sequence = prompt + result["tokens"]
    with torch.inference_mode():
        reference = hf(torch.tensor([sequence])).logits[0].float()
    n = len(prompt)
    for what, ours, ref in (
        ("prefill", result["prefill"], reference[:n]),
        ("decode", result["decode"], reference[n : n + DECODE_STEPS]),
    ):
        report = compare_logprobs(ours, ref)
        print(f"TP={world} {what}: {json.dumps(report.as_dict())}")
        assert report.argmax_mismatches == 0 and report.max_abs_diff <= 1e-3, report

    config = hf.config
    for rank_state in result["ranks"]:
        assert rank_state["state_heads"] == config.linear_num_value_heads // world
        assert rank_state["kv_heads"] == config.num_key_value_heads // world

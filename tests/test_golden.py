"""Golden gates: our CPU model (fp32) against HF transformers' Qwen3_5ForCausalLM.

Bound at every position: max |logprob difference| over our top-8 tokens <= 1e-3 and the same
argmax. Prompts cross the 64-token DeltaNet chunk; chunked prefill, mixed batches and decode
go through the same executor the rank processes run.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import Qwen3_5ForCausalLM

from deltaserve.engine.rank.executor import Executor, ExecutorConfig
from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem
from deltaserve.tools.golden import compare_logprobs

BOUND = 1e-3
GREEDY = SamplingSpec(seed=0, num_logprobs=8)


def assert_golden(ours: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    report = compare_logprobs(ours, reference)
    print(f"{what}: {json.dumps(report.as_dict())}")
    assert report.argmax_mismatches == 0, f"{what}: argmax differs from HF ({report})"
    assert report.max_abs_diff <= BOUND, f"{what}: logprobs differ from HF by {report.max_abs_diff}"


def first_item(request_id: int, ids: list[int], reserve: int, sample: bool = True) -> StepItem:
    return StepItem(request_id, 0, ids, sample, NewRequest(reserve, GREEDY))


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return Qwen3_5ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def executor(tiny_model_dir):
    return Executor(
        ExecutorConfig(str(tiny_model_dir), max_num_seqs=8, num_kv_blocks=1024, block_size=16)
    )


@pytest.fixture
def prompts(executor):
    gen = random.Random(1234)
    vocab = 248044  # ordinary tokens of the real vocabulary

    def make(length: int) -> list[int]:
        return [gen.randrange(vocab) for _ in range(length)]

    return make


def hf_logits(hf_model, ids: list[int], keep: int = 0) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids]), logits_to_keep=keep).logits[0].float()


@pytest.mark.parametrize("length", [1, 63, 64, 65, 200])
def test_prefill_logits_match_hf(executor, hf_model, prompts, length):
    ids = prompts(length)
    ours = executor.forward([first_item(1, ids, length + 1)], every_position=True)
    executor.drop([1])
    assert_golden(ours, hf_logits(hf_model, ids), f"prefill {length}")


def test_chunked_prefill_equals_whole(executor, hf_model, prompts):
    """A prompt prefilled in chunks split at arbitrary points equals one whole prefill."""
    ids = prompts(200)
    reference = hf_logits(hf_model, ids)
    gen = random.Random(7)
    for trial in range(3):
        cuts = sorted({0, 200, *gen.sample(range(1, 200), 1 + trial * 2)})
        parts = []
        for begin, end in zip(cuts[:-1], cuts[1:], strict=True):
            new = NewRequest(201, GREEDY) if begin == 0 else None
            parts.append(
                executor.forward([StepItem(2, begin, ids[begin:end], end == 200, new)], True)
            )
        executor.drop([2])
        assert_golden(torch.cat(parts), reference, f"chunks at {cuts}")


def test_greedy_decode_with_logprobs(executor, hf_model, prompts):
    """32 greedy steps through run_step (sampler included): tokens and logprobs match HF."""
    ids = prompts(70)
    [sample] = executor.run_step([first_item(3, ids, 70 + 32)])
    sequence = list(ids)
    for _ in range(32):
        reference = hf_logits(hf_model, sequence, keep=1)[0].log_softmax(-1)
        assert sample.token_id == int(reference.argmax())
        assert abs(sample.logprob - float(reference[sample.token_id])) <= BOUND
        assert len(sample.top_logprobs) == 8
        for token_id, logprob in sample.top_logprobs:
            assert abs(logprob - float(reference[token_id])) <= BOUND
        assert [t for t, _ in sample.top_logprobs] == reference.topk(8).indices.tolist()
        sequence.append(sample.token_id)
        if len(sequence) == 70 + 32:
            break
        [sample] = executor.run_step([StepItem(3, len(sequence) - 1, [sample.token_id], True)])
    executor.drop([3])


def test_mixed_forward_equals_each_alone(executor, prompts):
    """Four requests of different lengths, prefill chunks and decode tokens in one forward,
    give the logits each gives alone."""
    lengths = [5, 70, 130, 1]
    ids = [prompts(n) for n in lengths]
    extra = [prompts(3) for _ in lengths]  # tokens fed after the prompts, one per step

    def run_alone(k: int) -> list[torch.Tensor]:
        rid = 100 + k
        out = [executor.forward([first_item(rid, ids[k], lengths[k] + 3)], True)]
        for j, token in enumerate(extra[k]):
            out.append(executor.forward([StepItem(rid, lengths[k] + j, [token], True)], True))
        executor.drop([rid])
        return out

    alone = [run_alone(k) for k in range(4)]

    # Step 1: requests 0 and 1 prefill whole, request 2 its first 50 tokens.
    # Step 2 (mixed): 0 and 1 decode, 2 finishes its prompt, 3 prefills.
    # Steps 3, 4: everyone decodes.
    def rows(logits: torch.Tensor, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
        return [logits[a:b] for a, b in spans]

    step1 = executor.forward(
        [
            first_item(0, ids[0], 8),
            first_item(1, ids[1], 73),
            first_item(2, ids[2][:50], 133, False),
        ],
        True,
    )
    r0, r1, r2a = rows(step1, [(0, 5), (5, 75), (75, 125)])
    step2 = executor.forward(
        [
            StepItem(0, 5, [extra[0][0]], True),
            StepItem(2, 50, ids[2][50:], True),
            StepItem(1, 70, [extra[1][0]], True),
            first_item(3, ids[3], 4),
        ],
        True,
    )
    d0, r2b, d1, r3 = rows(step2, [(0, 1), (1, 81), (81, 82), (82, 83)])
    together = {0: [r0, d0], 1: [r1, d1], 2: [torch.cat([r2a, r2b])], 3: [r3]}
    fed = {0: 1, 1: 1, 2: 0, 3: 0}  # extra tokens each request has been fed so far
    for _ in range(2):
        items = [StepItem(k, lengths[k] + fed[k], [extra[k][fed[k]]], True) for k in range(4)]
        step = executor.forward(items, True)
        for k in range(4):
            together[k].append(step[k : k + 1])
            fed[k] += 1
    executor.drop([0, 1, 2, 3])
    for k in range(4):
        got = torch.cat(together[k])
        want = torch.cat(alone[k])[: got.shape[0]]
        diff = (got.log_softmax(-1) - want.log_softmax(-1)).abs().max().item()
        assert diff <= BOUND, f"request {k} differs in a mixed batch by {diff}"


def test_long_prompt(executor, hf_model, prompts):
    """A prompt of 4,097 tokens, prefilled in chunks of up to 1024 with a last chunk of 64
    whose every position is compared."""
    ids = prompts(4097)
    cuts = [0, 1024, 2048, 3072, 4033, 4097]
    for begin, end in zip(cuts[:-1], cuts[1:], strict=True):
        new = NewRequest(4097, GREEDY) if begin == 0 else None
        logits = executor.forward([StepItem(4, begin, ids[begin:end], end == 4097, new)], True)
    executor.drop([4])
    assert_golden(logits, hf_logits(hf_model, ids, keep=64), "prompt 4097 (last 64)")

"""The mixture-of-experts models (Qwen3.5-35B-A3B's family): the routed-experts kernel against
its reference, our model against HF's Qwen3_5MoeForCausalLM at TP=1 and TP=2, both checkpoint
layouts of the experts, and the engine serving one."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from engine_helpers import collect, engine_config, ids_of
from kernel_checks import DTYPES, assert_close, needs_cuda
from safetensors.torch import load_file, save_file
from test_gpu_path import _assert_steps_match, _run_steps, interpreter_only
from test_tp_golden import DECODE_STEPS, run_tp

from deltaserve.engine.checkpoint_files import CheckpointError
from deltaserve.kernels.moe import (
    GEMV_PAIRS,
    experts_reference,
    group_pairs,
    route,
    route_reference,
)
from deltaserve.tools.golden import compare_logprobs
from deltaserve.tools.make_model import hf_causal_lm

# HF's reference runs on the CPU in fp32, on GPU machines too: transformers (>= 5.25) sends CPU
# inputs to its torch path even with fla installed, whose CUDA kernels compute chunks in tf32
# (enough to flip a near-tied expert: 0.11 nat off on an H100). Our side runs on the CPU here.
BOUND = 1e-3


def assert_golden(report, bound: float = BOUND) -> None:
    assert report.argmax_mismatches == 0 and report.max_abs_diff <= bound, report


@pytest.fixture(scope="module")
def hf_moe(tiny_moe_model_dir):
    model = hf_causal_lm(tiny_moe_model_dir).from_pretrained(
        tiny_moe_model_dir, dtype=torch.float32
    )
    return model.eval()


@pytest.mark.parametrize(
    "tokens,top_k,experts,block_m", [(1, 8, 256, 16), (37, 2, 6, 16), (300, 4, 16, 64)]
)
def test_group_pairs_places_every_pair_once_by_expert(tokens, top_k, experts, block_m):
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    pairs, block_expert = group_pairs(ids, experts, block_m)
    assert pairs.numel() == block_expert.numel() * block_m
    placed = pairs[pairs >= 0].long()
    assert sorted(placed.tolist()) == list(range(tokens * top_k)), "a pair missing or placed twice"
    blocks = pairs.view(-1, block_m)
    for b, expert in enumerate(block_expert.tolist()):
        members = blocks[b][blocks[b] >= 0].long()
        if expert < 0:
            assert members.numel() == 0, f"unused block {b} holds pairs"
            continue
        assert members.numel() > 0 and (ids.view(-1)[members] == expert).all(), (
            f"block {b} mixes experts"
        )
        assert (members.diff() > 0).all(), "an expert's pairs out of token order"


EXPERT_SHAPES = [  # (tokens, experts, top_k, hidden, inter): <= GEMV_PAIRS pairs, then grouped ones
    (1, 6, 2, 40, 24),
    (9, 5, 3, 72, 40),
    (90, 7, 3, 48, 40),
    pytest.param(1, 256, 8, 2048, 512, marks=needs_cuda),  # Qwen3.5-35B-A3B: decode, batch 1
    pytest.param(16, 256, 8, 2048, 512, marks=needs_cuda),  # batch 16
    pytest.param(64, 256, 8, 2048, 512, marks=needs_cuda),  # batch 64
    pytest.param(700, 256, 8, 2048, 512, marks=needs_cuda),  # a prompt chunk
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,num_experts,top_k,hidden,inter", EXPERT_SHAPES)
def test_experts_kernel_matches_reference(
    kernels, device, dtype, tokens, num_experts, top_k, hidden, inter
):
    from deltaserve.kernels.moe import experts_and_shared, experts_triton

    assert (tokens * top_k > GEMV_PAIRS) == (tokens >= 64), "a shape meant for the other kernel"
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, device=device) / inter**0.5).to(dtype)
    weights, ids = route_reference(torch.randn(tokens, num_experts, device=device), top_k, dtype)
    want = experts_reference(x, gate_up, down, weights, ids)
    got = experts_triton(x, gate_up, down, weights, ids)
    assert_close(got, want, dtype, f"experts {tokens}x{num_experts}/{top_k}")
    if tokens * top_k <= GEMV_PAIRS:  # the decode path: the shared expert's down product added in
        shared_h = torch.randn(tokens, inter + 8, device=device).to(dtype)
        shared_down = (torch.randn(hidden, inter + 8, device=device) / inter**0.5).to(dtype)
        gate = torch.randn(tokens, 1, device=device).to(dtype)
        shared = torch.sigmoid(gate) * torch.nn.functional.linear(shared_h, shared_down)
        got = experts_and_shared(x, gate_up, down, weights, ids, dtype, shared_h, shared_down, gate)
        assert got.dtype == dtype
        assert_close(
            got.float(), (want + shared.float()).to(dtype).float(), dtype, "experts + shared"
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,num_experts,top_k", [(5, 6, 2), (3, 256, 8), (40, 256, 8)])
def test_route_kernel_matches_reference(
    kernels, device, dtype, tokens, num_experts, top_k, monkeypatch
):
    """The router's top k, best first, and their renormalised weights rounded to the model dtype.
    bf16 logits tie often: where they do, either expert is a right pick (as torch.topk's)."""
    from deltaserve.kernels import triton_compat

    monkeypatch.setattr(triton_compat, "GPU_PATH_ON_CPU", True)
    logits = torch.randn(tokens, num_experts, device=device).to(dtype)
    _, want_ids = route_reference(logits, top_k, dtype)
    weights, ids = route(logits, top_k, dtype)
    probs = torch.softmax(logits.float(), dim=-1)
    chosen = probs.gather(1, ids)
    assert ids.unique(dim=1).shape == ids.shape, "an expert chosen twice"
    assert torch.allclose(chosen, probs.gather(1, want_ids), rtol=1e-6, atol=0), (
        "not the top k, best first"
    )
    # bf16: one unit in the last place (the interpreter truncates where the GPU rounds)
    rtol = 1e-6 if dtype == torch.float32 else 8e-3
    assert torch.allclose(
        weights, (chosen / chosen.sum(1, keepdim=True)).to(dtype).float(), rtol=rtol, atol=0
    )
    # a graph's padding row may hold anything: its experts must still exist
    logits[0] = float("nan")
    assert (route(logits, top_k, dtype)[1][0] < num_experts).all()


def test_tp_matches_hf_and_tp1(tiny_moe_model_dir, tmp_path, hf_moe):
    """Our model against HF's in fp32 over a 130-token prompt (past the 64-token DeltaNet
    chunk) and greedy decode steps, at TP=1 and TP=2 (each expert's rows split)."""
    prompt = [random.Random(5).randrange(248044) for _ in range(130)]
    runs = {world: run_tp(world, tiny_moe_model_dir, tmp_path, prompt) for world in (1, 2)}
    assert runs[2]["tokens"] == runs[1]["tokens"], "greedy tokens differ between TP=1 and TP=2"
    with torch.inference_mode():
        reference = hf_moe(torch.tensor([prompt + runs[1]["tokens"]])).logits[0].float().cpu()
    n = len(prompt)
    for world, result in runs.items():
        for what, ours, ref in (
            ("prefill", result["prefill"], reference[:n]),
            ("decode", result["decode"], reference[n : n + DECODE_STEPS]),
        ):
            report = compare_logprobs(ours, ref)
            print(f"TP={world} {what}: {json.dumps(report.as_dict())}")
            assert_golden(report)


def _stacked_copy(model_dir, out_dir):
    """The checkpoint with each layer's experts stacked as transformers' modules hold them
    (`mlp.experts.gate_up_proj` [E, 2 I, H], `mlp.experts.down_proj` [E, H, I])."""
    shutil.copytree(model_dir, out_dir)
    tensors = load_file(out_dir / "model.safetensors")
    num = json.loads((out_dir / "config.json").read_text())["num_experts"]
    for prefix in sorted({name.split(".experts.")[0] for name in tensors if ".experts." in name}):
        pick = lambda e, m, prefix=prefix: tensors.pop(f"{prefix}.experts.{e}.{m}_proj.weight")  # noqa: E731
        tensors[f"{prefix}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([pick(e, "gate"), pick(e, "up")]) for e in range(num)]
        )
        tensors[f"{prefix}.experts.down_proj"] = torch.stack([pick(e, "down") for e in range(num)])
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


def test_stacked_experts_load_as_released_ones(tiny_moe_model_dir, tmp_path):
    """Stacked expert tensors give the same logits as the released per-expert ones; a
    checkpoint missing one expert's projection is refused naming it."""
    from deltaserve.engine.rank.executor import Executor, ExecutorConfig
    from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem

    ids = [random.Random(3).randrange(248044) for _ in range(20)]

    def logits(model_dir):
        ex = Executor(ExecutorConfig(str(model_dir), max_num_seqs=2, num_kv_blocks=16))
        return ex.forward(
            [StepItem(1, 0, ids, True, NewRequest(30, SamplingSpec(seed=0)))], every_position=True
        )

    stacked = _stacked_copy(tiny_moe_model_dir, tmp_path / "stacked")
    assert torch.equal(logits(stacked), logits(tiny_moe_model_dir))
    broken = tmp_path / "broken"
    shutil.copytree(tiny_moe_model_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r"lacks tensors: model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"
    ):
        logits(broken)


async def test_engine_serves_hf_greedy_tokens(tiny_moe_model_dir, hf_moe):
    """AsyncEngine (real rank processes) on the MoE checkpoint: HF's greedy continuation."""
    from deltaserve.engine.async_engine import AsyncEngine
    from deltaserve.engine.sampling_params import SamplingParams

    prompt = [random.Random(8).randrange(248044) for _ in range(70)]
    expected = hf_moe.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    expected = expected[0, 70:].tolist()
    engine = await AsyncEngine.start(engine_config(tiny_moe_model_dir))
    try:
        tokens, finished = await collect(
            engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        )
    finally:
        await engine.shutdown()
    assert ids_of(tokens) == expected and finished.reason == "length"


@needs_cuda
def test_cuda_graphs_match_cpu(tiny_moe_model_dir, monkeypatch):
    """On CUDA (the expert kernels, routing inside the decode graphs) the MoE model's mixed
    steps give the CPU's log-probabilities, and graph replays the eager steps'. The DeltaNet
    prefill by the torch reference, not fla, whose tf32 chunks move router logits enough to
    flip a near-tied expert (0.09 off on an H100)."""
    from deltaserve.kernels import gated_delta

    monkeypatch.setattr(gated_delta, "fla_chunk_kernel", lambda: None)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # the conv reference: full fp32
    model_dir = str(tiny_moe_model_dir)
    cpu, _ = _run_steps(model_dir, "cpu")
    eager, _ = _run_steps(model_dir, "cuda")
    _assert_steps_match(eager, cpu, 2e-3, "cuda vs cpu (moe)")
    graphs, _ = _run_steps(model_dir, "cuda", graphs=True)
    _assert_steps_match(graphs, eager, 1e-4, "graphs vs eager (moe)")


def _short_steps(vocab: int = 240000):
    """A prompt (12 tokens: 24 pairs, per-pair GEMVs), one beside a decode past GEMV_PAIRS
    (140 tokens: grouped products), then two decode steps of both."""
    from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem

    gen = torch.Generator().manual_seed(2)
    spec = SamplingSpec(seed=0)
    yield [
        StepItem(
            1, 0, torch.randint(0, vocab, (12,), generator=gen).tolist(), True, NewRequest(60, spec)
        )
    ]
    yield [
        StepItem(
            2,
            0,
            torch.randint(0, vocab, (140,), generator=gen).tolist(),
            True,
            NewRequest(160, spec),
        ),
        StepItem(1, 12, [5], True, None),
    ]
    yield [StepItem(1, 13, [6], True, None), StepItem(2, 140, [7], True, None)]


@interpreter_only
def test_gpu_path_under_interpreter_matches_cpu(kernels, tiny_moe_model_dir, monkeypatch):
    """The MoE layer's GPU path (the router kernel, per-pair and grouped expert products, the
    shared expert summed in), run on CPU tensors by Triton's interpreter, gives the CPU path's
    log-probabilities (on a GPU, test_cuda_graphs_match_cpu covers it for real)."""
    from deltaserve.kernels import triton_compat

    cpu, _ = _run_steps(str(tiny_moe_model_dir), "cpu", steps=_short_steps)
    monkeypatch.setattr(triton_compat, "GPU_PATH_ON_CPU", True)
    gpu_path, _ = _run_steps(str(tiny_moe_model_dir), "cpu", steps=_short_steps)
    _assert_steps_match(gpu_path, cpu, 2e-3, "GPU path under the interpreter vs cpu (moe)")


def _logits_of(model_dir, ids: list[int]) -> torch.Tensor:
    from deltaserve.engine.rank.executor import Executor, ExecutorConfig
    from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem

    ex = Executor(ExecutorConfig(str(model_dir), max_num_seqs=2, num_kv_blocks=16))
    return ex.forward(
        [StepItem(1, 0, ids, True, NewRequest(40, SamplingSpec(seed=0)))], every_position=True
    )


RELEASE_IDS = [random.Random(1).randrange(248044) for _ in range(30)]


def test_released_vlm_layout_loads(tiny_moe_model_dir, tmp_path):
    """The MoE release's vision-language layout (`model.language_model.*`, vision and MTP
    tensors skipped, sharded) gives the text-only checkpoint's logits."""
    from deltaserve.tools.make_model import make_model

    vlm = make_model(
        tmp_path / "vlm", preset="tiny-moe", dtype="fp32", seed=0, vlm_names=True, shard_size="2MB"
    )
    assert json.loads((vlm / "config.json").read_text())["model_type"] == "qwen3_5_moe"
    assert torch.equal(_logits_of(vlm, RELEASE_IDS), _logits_of(tiny_moe_model_dir, RELEASE_IDS))


def test_fp8_release_matches_hf(tmp_path):
    """An FP8 release (each expert's projections FP8 with block scales, widened as they load)
    gives HF's logits on the same files."""
    from deltaserve.tools.make_model import make_model

    fp8 = make_model(tmp_path / "fp8", preset="tiny-moe", dtype="fp8", seed=0, fp8_block=16)
    hf = hf_causal_lm(fp8).from_pretrained(fp8, dtype=torch.float32).eval()
    with torch.inference_mode():
        reference = hf(torch.tensor([RELEASE_IDS])).logits[0].float().cpu()
    assert_golden(compare_logprobs(_logits_of(fp8, RELEASE_IDS), reference), BOUND)


def test_moe_config_is_read_and_checked(tiny_moe_model_dir):
    """An MoE config.json reads HF's MoE defaults for keys it leaves out, and one we cannot
    serve is refused naming the key: more experts a token than there are, a TP size that does
    not split the experts' rows."""
    from deltaserve.engine.model_config import ConfigError, ModelConfig

    raw = json.loads((tiny_moe_model_dir / "config.json").read_text())
    config = ModelConfig.from_dict(raw)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
        8,
        2,
        32,
    )
    bare = ModelConfig.from_dict({"model_type": "qwen3_5_moe_text"})  # Qwen3.5-35B-A3B's shape
    assert (
        bare.num_experts,
        bare.num_experts_per_tok,
        bare.hidden_size,
        bare.num_hidden_layers,
    ) == (256, 8, 2048, 40)
    with pytest.raises(ConfigError, match="num_experts_per_tok 9 is more than num_experts 8"):
        ModelConfig.from_dict({**raw, "num_experts_per_tok": 9})
    with pytest.raises(
        ValueError, match="size 4 does not divide shared_expert_intermediate_size=50"
    ):
        ModelConfig.from_dict({**raw, "shared_expert_intermediate_size": 50}).check_tp_size(4)

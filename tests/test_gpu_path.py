"""The GPU model path (the Triton kernels wired into the layers, per-step StepMeta, CUDA
graphs) against the CPU path, over mixed steps through one executor: under Triton's
interpreter on the CPU (the graphs' static buffers run eagerly there), for real on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels import CUDA, needs_cuda, skip_without_fla


def _steps(vocab: int = 240000):
    """Mixed steps: chunked prefill across the 64-token chunk, prefill beside decodes, decodes;
    the last decodes without tokens (as pipelined steps send them: each slot's last sample).
    Two prompts ask for prompt logprobs: request 1's first chunk (2 alternatives) in a
    prompt-only step, request 4 (1 alternative) beside decodes."""
    from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem

    gen = torch.Generator().manual_seed(11)
    ids = {
        r: torch.randint(0, vocab, (n,), generator=gen).tolist()
        for r, n in [(1, 90), (2, 5), (3, 1), (4, 20)]
    }
    spec = SamplingSpec(seed=0)
    yield [
        StepItem(
            1,
            0,
            ids[1][:70],
            False,
            NewRequest(200, spec),
            prompt_logprobs=2,
            next_token=ids[1][70],
        ),
        StepItem(2, 0, ids[2], True, NewRequest(200, spec)),
    ]
    yield [
        StepItem(1, 70, ids[1][70:], True, None),
        StepItem(2, 5, [7], True, None),
        StepItem(3, 0, ids[3], True, NewRequest(200, spec)),
    ]
    for t in range(6):
        given = t < 3
        step = [
            StepItem(2, 6 + t, [8 + t] * given, True, None),
            StepItem(1, 90 + t, [9 + t] * given, True, None),
            StepItem(3, 1 + t, [10 + t] * given, True, None),
        ]
        # a new prompt beside decodes (with graphs: a prompt graph's replay beside a decode graph's)
        if t == 1:
            step.insert(1, StepItem(4, 0, ids[4], True, NewRequest(200, spec), prompt_logprobs=1))
        elif t > 1:
            step.append(StepItem(4, 20 + t - 2, [11 + t] * given, True, None))
        yield step


def _prefix_steps(vocab: int = 240000):
    """Prefix caching: a prompt saved where it ends (40 tokens: 2.5 blocks), then two prompts
    that start from it (chunks of 20 and 3 tokens; the ranks copy its partial block for each)
    beside a fresh one, then one of them chunked on from there."""
    from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem

    gen = torch.Generator().manual_seed(5)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()  # noqa: E731
    spec = SamplingSpec(seed=0)
    yield [StepItem(1, 0, ids(40), True, NewRequest(100, spec), save=0)]
    yield [
        StepItem(2, 40, ids(20), False, NewRequest(100, spec, prefix=0)),
        StepItem(3, 40, ids(3), True, NewRequest(100, spec, prefix=0)),
        StepItem(4, 0, ids(30), True, NewRequest(100, spec)),
    ]
    yield [StepItem(2, 60, ids(9), True, None)]


def _run_steps(
    model_dir: str,
    device: str,
    graphs: bool = False,
    dtype: str = "float32",
    prompt_graph_tokens: int = 2048,
    steps=_steps,
    prefix_states: int = 0,
    **cache_fields: object,  # ExecutorConfig's cache dtypes
) -> tuple[list[torch.Tensor], int]:
    """Logits of every step of `_steps` through one executor, each with the step's prompt
    logprobs as an attribute, and how many of its steps ran prompts through a prompt graph:
    eagerly, or with graphs, where single-token items replay a decode graph beside a forward
    of the chunks (a prompt graph's where they fit one). Each step samples (greedy), so that
    items without tokens have a last sample to read."""
    from deltaserve.engine.rank.executor import Executor, ExecutorConfig
    from deltaserve.kernels.triton_compat import gpu_path

    config = ExecutorConfig(
        model_dir,
        device=device,
        dtype=dtype,
        max_num_seqs=4,
        num_kv_blocks=64,
        enforce_eager=not graphs,
        prompt_graph_tokens=prompt_graph_tokens,
        prefix_cache_states=prefix_states,
        **cache_fields,
    )
    ex = Executor(config)
    assert (ex.graphs is not None) == (graphs and gpu_path(ex.cache.kv))
    logits = []
    for items in steps():
        step = ex.launch_step(items)
        ex.launch_sampling(step)
        ex.finish_step(step)
        logits.append(step.logits.float().cpu())
        logits[-1].prompt_logprobs = step.prompt_logprobs
    return logits, 0 if ex.prompt_graphs is None else ex.prompt_graphs.replays


def _assert_steps_match(
    got: list[torch.Tensor],
    want: list[torch.Tensor],
    bound: float,
    what: str,
    prompt_bound: float | None = None,
) -> None:
    """Each step's logits within `bound` (top-8 logprobs, same argmax), and its prompt
    logprobs within `prompt_bound` (default `bound`): they are many more positions."""
    from deltaserve.tools.golden import compare_logprobs

    for step, (ours, reference) in enumerate(zip(got, want, strict=True)):
        report = compare_logprobs(ours, reference)
        print(f"{what}, step {step}: {report.as_dict()}")
        assert report.argmax_mismatches == 0, f"{what}: step {step} argmax differs ({report})"
        assert report.max_abs_diff <= bound, (
            f"{what}: step {step} top-8 logprobs differ by {report.max_abs_diff}"
        )
        _assert_prompt_logprobs_match(
            ours.prompt_logprobs,
            reference.prompt_logprobs,
            prompt_bound or bound,
            f"{what}, step {step}",
        )


def _assert_prompt_logprobs_match(got: dict, want: dict, bound: float, what: str) -> None:
    """The same requests' prompt logprobs, each within `bound`, and their alternatives', best
    first; ranks within 5%, and an alternative's token may differ only where `bound` makes
    logits tie."""
    assert got.keys() == want.keys(), (
        f"{what}: prompt logprobs of {sorted(got)}, expected {sorted(want)}"
    )
    for request, reference in sorted(want.items()):
        ours = got[request]
        rows = len(reference.logprobs)
        assert rows > 0 and len(ours.logprobs) == len(ours.ranks) == len(ours.top_logprobs) == rows
        # a prompt token's logprob is far in the tail (-40 on random weights): errors scale with it
        assert ours.logprobs == pytest.approx(reference.logprobs, rel=bound / 20, abs=bound), (
            f"{what}: {request}"
        )
        # a random token's rank is ~10^5 of 240k logits, packed densely: rounding moves it some
        ranks = zip(ours.ranks, reference.ranks, strict=True)
        assert all(abs(a - b) <= 2 + b // 20 for a, b in ranks), f"{what}: request {request} ranks"
        for row, (top, ref_top) in enumerate(
            zip(ours.top_logprobs, reference.top_logprobs, strict=True)
        ):
            values = [lp for _, lp in ref_top]
            assert len(top) == len(ref_top) > 0
            assert [lp for _, lp in top] == pytest.approx(values, abs=bound), (
                f"{what}: {request}/{row}"
            )
            # an alternative's token is the reference's where its neighbours are clearly apart (the
            # last one's next, not listed, may be as close: its token is not compared)
            for i, ((token, _), (ref_token, _)) in enumerate(
                zip(top[:-1], ref_top[:-1], strict=True)
            ):
                clear = all(abs(values[i] - v) > 2 * bound for j, v in enumerate(values) if j != i)
                assert token == ref_token or not clear, (
                    f"{what}: request {request} row {row} alternative {i}"
                )


interpreter_only = pytest.mark.skipif(
    CUDA, reason="the GPU runs this path for real in test_cuda_executor_matches_cpu"
)


@interpreter_only
def test_gpu_path_under_interpreter_matches_cpu(kernels, tiny_model_dir, monkeypatch):
    """The layers' GPU code path (per-step StepMeta and packed prefill indices, Triton decode
    kernels, fused norms, SDPA prefill), run on CPU tensors by Triton's interpreter, gives
    the CPU path's log-probabilities over mixed steps. (CUDA graphs and fla need a GPU.)"""
    from deltaserve.kernels import triton_compat

    model_dir = str(tiny_model_dir)
    cpu, _ = _run_steps(model_dir, "cpu")
    monkeypatch.setattr(triton_compat, "GPU_PATH_ON_CPU", True)
    _assert_steps_match(
        _run_steps(model_dir, "cpu")[0], cpu, 2e-3, "GPU path under the interpreter vs cpu"
    )


@interpreter_only
def test_graph_buffers_under_interpreter_match_cpu(kernels, tiny_model_dir, monkeypatch):
    """The graphs' static buffers, run eagerly (nothing is captured off CUDA), mixed steps
    split: the first step's two prompts (75 tokens, bucket 80) and the new one beside decodes
    (20 tokens, bucket 32) through a prompt graph's padded buffers, the decodes through the
    decode graphs' (a separate test from the one above: each is minutes under the interpreter)."""
    from deltaserve.kernels import triton_compat

    model_dir = str(tiny_model_dir)
    cpu, _ = _run_steps(model_dir, "cpu")
    monkeypatch.setattr(triton_compat, "GPU_PATH_ON_CPU", True)
    graphs, prompt_replays = _run_steps(model_dir, "cpu", graphs=True, prompt_graph_tokens=80)
    assert prompt_replays == 2, f"{prompt_replays} steps ran their prompts through a prompt graph"
    _assert_steps_match(graphs, cpu, 2e-3, "graph buffers vs cpu")


@needs_cuda
@pytest.mark.parametrize("prefill", ["reference", "fla"])
def test_cuda_executor_matches_cpu(tiny_model_dir, monkeypatch, prefill):
    """The tiny model on CUDA (Triton decode kernels; DeltaNet prefill by the torch reference
    or by fla's chunked kernel) gives the CPU's log-probabilities over mixed steps (chunked
    prefill, prefill beside decodes, decodes); CUDA-graph replays give the eager CUDA ones."""
    from deltaserve.kernels import gated_delta

    if prefill == "reference":
        monkeypatch.setattr(gated_delta, "fla_chunk_kernel", lambda: None)
    else:
        skip_without_fla(gated_delta)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # the conv reference: full fp32
    model_dir = str(tiny_model_dir)
    cpu, _ = _run_steps(model_dir, "cpu")
    eager, _ = _run_steps(model_dir, "cuda")
    # fla computes its chunks with tf32 products: a looser bound than plain fp32; over the 69
    # prompt positions' alternatives one was 0.16 off on an H100
    bound, prompt_bound = (2e-3, None) if prefill == "reference" else (5e-2, 0.25)
    _assert_steps_match(eager, cpu, bound, f"cuda ({prefill} prefill) vs cpu", prompt_bound)
    graphs, prompt_replays = _run_steps(model_dir, "cuda", graphs=True)
    assert prompt_replays == 0, "fp32 prompts (no flash) must run eagerly, not in a prompt graph"
    _assert_steps_match(graphs, eager, 1e-4, "graphs (mixed steps split) vs eager")


@needs_cuda
def test_prompt_graphs_match_eager(kernels, tiny_model_dir):
    """bf16 with fla: prompts replayed from a prompt graph (padded buffers; fla's chunked
    kernels and flash's varlen attention captured) give the logits of the same steps with
    their prompts run eagerly, decodes after them included."""
    skip_without_fla(kernels["gated_delta"])
    model_dir = str(tiny_model_dir)
    eager, none = _run_steps(
        model_dir, "cuda", graphs=True, dtype="bfloat16", prompt_graph_tokens=0
    )
    graphs, prompt_replays = _run_steps(model_dir, "cuda", graphs=True, dtype="bfloat16")
    assert (none, prompt_replays) == (0, 2), (
        f"prompt-graph steps: {none} without, {prompt_replays} with"
    )
    _assert_steps_match(graphs, eager, 2e-2, "prompt graphs vs eager prompts (bf16)")


def test_prompt_graphs_start_from_saved_prefixes(kernels, tiny_model_dir, monkeypatch):
    """With prefix caching, prompt graphs take chunks that follow cached positions (a saved
    prefix's, or their own earlier chunk's): their logits are the eager steps' (the CPU's under
    the interpreter, where the graphs' padded buffers run eagerly; bf16 with fla on CUDA)."""
    model_dir = str(tiny_model_dir)
    if CUDA:
        skip_without_fla(kernels["gated_delta"])
        eager, _ = _run_steps(
            model_dir, "cuda", True, "bfloat16", 0, _prefix_steps, prefix_states=1
        )
        graphs, replays = _run_steps(
            model_dir, "cuda", True, "bfloat16", steps=_prefix_steps, prefix_states=1
        )
        bound = 2e-2
    else:
        from deltaserve.kernels import triton_compat

        eager, _ = _run_steps(model_dir, "cpu", steps=_prefix_steps, prefix_states=1)
        monkeypatch.setattr(triton_compat, "GPU_PATH_ON_CPU", True)
        graphs, replays = _run_steps(
            model_dir, "cpu", True, prompt_graph_tokens=80, steps=_prefix_steps, prefix_states=1
        )
        bound = 2e-3
    assert replays == 3, f"{replays} of 3 steps ran through a prompt graph"
    _assert_steps_match(graphs, eager, bound, "prompt graphs from saved prefixes vs eager")


LATE_COMPILES = """
import logging, sys, torch
from deltaserve.engine.rank.executor import Executor, ExecutorConfig
from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem
from deltaserve.kernels.triton_compat import report_late_compiles

config = ExecutorConfig(sys.argv[1], device="cuda", dtype="bfloat16", max_num_seqs=8,
                        num_kv_blocks=None, max_model_len=512, max_num_batched_tokens=256,
                        prompt_graph_tokens=64, gpu_memory_utilization=0.05)
ex = Executor(config)
late = []
class Keep(logging.Handler):
    def emit(self, record):
        late.append(record.getMessage())
log = logging.getLogger("late")
log.addHandler(Keep())
report_late_compiles(log, 0)
gen = torch.Generator().manual_seed(0)
spec = SamplingSpec(temperature=0.8, top_p=0.9, seed=1)
ids = lambda n: torch.randint(0, 1000, (n,), generator=gen).tolist()
held, pending, rid = {}, {}, 0  # request -> positions held; -> the rest of a chunked prompt
# 1 to 5 new prompts a step (eager past the 64-token prompt graphs; the first of a long one
# chunked, its rest in the next step; the last of several asks for prompt logprobs) beside
# the decodes of every request held
for count, length in [(1, 100), (2, 37), (3, 70), (5, 21), (4, 130), (1, 9), (2, 64)]:
    while len(held) + count > 8:
        old = next(iter(held))
        ex.drop([old])
        del held[old]
        pending.pop(old, None)
    items = [StepItem(r, n, pending.pop(r, []), True, None) for r, n in held.items()]
    for j in range(count):
        rid += 1
        tokens = ids(length)
        if j == 0 and length > 64:
            items.append(StepItem(rid, 0, tokens[:64], False, NewRequest(400, spec)))
            pending[rid] = tokens[64:]
        else:
            # the last of several new prompts: prompt logprobs
            asks = 1 if j == count - 1 > 0 else -1
            new = NewRequest(400, spec)
            items.append(StepItem(rid, 0, tokens, True, new, prompt_logprobs=asks))
    ex.run_step(items)
    for item in items:
        held[item.request_id] = item.start + (len(item.token_ids) or 1)
print("LATE", len(late))
for line in late:
    print(line)
from deltaserve.kernels.activation import silu_and_mul_triton
# fp16: a dtype the model never ran
silu_and_mul_triton(torch.ones(3, 8, dtype=torch.float16, device="cuda"))
print("CONTROL", sum("_silu_and_mul_kernel" in line for line in late))
"""


# Tiny widths with every projection into the residual 256 deep, so that at 2-64 rows their K
# splits as the published models' do (`decode_config`): decode's norms then add partial sums,
# and the prompt steps' norms (cuBLAS, no split) are a kernel no decode graph warms.
SPLIT_K_SHAPES = dict(hidden_size=128, intermediate_size=256, linear_value_head_dim=32, head_dim=32)


@needs_cuda
@pytest.mark.parametrize("shapes", ["tiny", "split_k"])
def test_serving_steps_compile_nothing_after_start_up(kernels, tiny_model_dir, tmp_path, shapes):
    """After start-up (profile, warm-up, graph capture) steps shaped as serving makes them
    (1 to 5 prompts, eager and chunked, beside 1 to 8 decodes, sampled) use no Triton
    specialization that start-up did not: on a machine with an empty Triton cache each one
    would be compiled while its request waits (seconds of time to first token). On the 4B a
    prompt's norms were (their row count specialized:
    bench/results/decode_h200_4b_at_cace8ac.json)."""
    import subprocess
    import sys

    from deltaserve.tools.make_model import make_model

    skip_without_fla(kernels["gated_delta"])
    model_dir = (
        tiny_model_dir if shapes == "tiny" else make_model(tmp_path, overrides=SPLIT_K_SHAPES)
    )
    done = subprocess.run(
        [sys.executable, "-c", LATE_COMPILES, str(model_dir)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LATE 0" in done.stdout, done.stdout[-3000:]
    assert "CONTROL 1" in done.stdout, (
        f"the control's compile was not reported: {done.stdout[-3000:]}"
    )

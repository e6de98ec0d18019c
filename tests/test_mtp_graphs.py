"""CUDA graphs of a model with an MTP head (engine/rank/cudagraph.py, prompt_graphs.py,
draft_graphs.py): prompts and plain decode steps replay their graphs with the head's catch-up
inside, a draft loop replays a draft graph, against the CPU's eager path; under Triton's
interpreter on the CPU (the graphs' static buffers run eagerly there), for real on CUDA.

One executor is driven as the scheduler drives it: prompts, decode steps without drafts (the
adaptive switch off), steps that propose, verify steps of k + 1 rows beside plain decodes,
requests drafting different k in one step. Greedy output and every draft must be the eager
path's, and greedy output that of the same requests without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from test_kernels import CUDA, needs_cuda, skip_without_fla

from deltaserve.engine.rank.executor import Executor
from deltaserve.engine.speculative_config import SpeculativeConfig
from deltaserve.ipc.messages import ExecutorConfig, NewRequest, SamplingSpec, StepItem
from deltaserve.kernels.triton_compat import gpu_path
from deltaserve.tools.make_model import make_model

MAX_DRAFTS = 2
# each request's drafts asked for at each step, the first its prompt's (0: a plain decode);
# request 3 never drafts; a step's verify spans (the drafts of the step before) are of one k
# (a verify graph's) or of two (eager)
SCHEDULE = {
    1: [0, 0, 2, 2, 2, 0, 2, 2],
    2: [0, 0, 1, 2, 0, 2, 2, 1],
    3: [0, 0, 0, 0, 0, 0, 0, 0],
}
PROMPT_LENGTHS = {1: 20, 2: 7, 3: 33}


@pytest.fixture(scope="module", params=["random", "agree"])
def mtp_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny, fp32, with an MTP head: "random", whose drafts hang on every input it reads (the
    saved hidden states and its own keys, which the catch-up writes) and are rejected; and
    make_model's "agree", whose drafts (reading no hidden state) are often accepted, so that
    the rollback keeps 1 to k + 1 positions."""
    head = request.param
    return make_model(tmp_path_factory.mktemp(head), preset="tiny", dtype="fp32", mtp=head)


@dataclass
class Stream:
    """One request as the scheduler sees it: positions run, its last token, pending drafts."""

    start: int = 0
    last: int = -1
    drafts: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    proposed: list[list[int]] = field(default_factory=list)  # every step's drafts
    verified: list[tuple[int, int]] = field(default_factory=list)  # (accepted, of drafts)


def _executor(model_dir: Path, device: str, graphs: bool, speculate: bool, dtype: str) -> Executor:
    spec = SpeculativeConfig(num_speculative_tokens=MAX_DRAFTS) if speculate else None
    config = ExecutorConfig(
        str(model_dir),
        device=device,
        dtype=dtype,
        max_num_seqs=4,
        num_kv_blocks=64,
        enforce_eager=not graphs,
        speculative_config=spec,
    )
    ex = Executor(config)
    assert (ex.graphs is not None) == (graphs and gpu_path(ex.cache.kv))
    return ex


def _drive(ex: Executor, speculate: bool) -> dict[int, Stream]:
    """The schedule through `ex` (without `speculate`, every step a plain decode), greedy;
    each request's emitted tokens and drafts."""
    gen = torch.Generator().manual_seed(3)
    streams = {rid: Stream() for rid in SCHEDULE}
    spec = SamplingSpec(seed=0)
    steps = len(next(iter(SCHEDULE.values())))
    for step in range(steps + 1):
        items = []
        for rid, stream in streams.items():
            propose = SCHEDULE[rid][step] if speculate and step < steps else 0
            if step == 0:
                prompt = torch.randint(0, 200_000, (PROMPT_LENGTHS[rid],), generator=gen).tolist()
                items.append(StepItem(rid, 0, prompt, True, NewRequest(200, spec), propose=propose))
                continue
            # a plain decode reads its last sample on the device every other step (pipelined)
            given = [stream.last] if stream.drafts or step % 2 else []
            tokens = given + stream.drafts
            items.append(
                StepItem(
                    rid,
                    stream.start,
                    tokens,
                    True,
                    num_drafts=len(stream.drafts),
                    propose=propose,
                )
            )
        launched = ex.launch_step(items)
        ex.launch_sampling(launched)
        samples = ex.finish_step(launched)
        outcomes = launched.speculative
        for item, sample in zip(items, samples, strict=True):
            stream = streams[item.request_id]
            outcome = outcomes.get(item.request_id)
            accepted = 0 if outcome is None else outcome.accepted
            if item.num_drafts:
                stream.verified.append((accepted, item.num_drafts))
            stream.emitted += [*stream.drafts[:accepted], sample.token_id]
            stream.start = item.start + (len(item.token_ids) or 1) - item.num_drafts + accepted
            stream.last = sample.token_id
            stream.drafts = [] if outcome is None else list(outcome.drafts)
            stream.proposed.append(stream.drafts)
    return streams


def _assert_same_streams(got: dict[int, Stream], want: dict[int, Stream], what: str) -> None:
    for rid in SCHEDULE:
        assert got[rid].emitted == want[rid].emitted, f"{what}: request {rid}'s tokens"
        assert got[rid].proposed == want[rid].proposed, f"{what}: request {rid}'s drafts"


def _assert_graphs_ran(ex: Executor, prompt_replays: int) -> None:
    """Every step after the prompts replayed a decode graph (each holds single-token items),
    every step that proposed a draft graph, every step whose verify spans are all of one k a
    verify graph and its rollback, the prompts `prompt_replays` prompt graphs."""
    steps = len(next(iter(SCHEDULE.values())))
    drafting = sum(any(SCHEDULE[rid][s] for rid in SCHEDULE) for s in range(steps))
    verifying = 0
    for s in range(1, steps + 1):
        drafts = {SCHEDULE[rid][s - 1] for rid in SCHEDULE} - {0}
        verifying += len(drafts) == 1
    prompts = 0 if ex.prompt_graphs is None else ex.prompt_graphs.replays
    replays = (
        prompts,
        ex.graphs.replays,
        ex.speculator.graphs.replays,
        ex.verify_graphs.replays,
    )
    assert replays == (prompt_replays, steps, drafting, 2 * verifying), (
        f"(prompt, decode, draft, verify and rollback) graph replays: {replays}"
    )


def _assert_emitted_as_without_speculation(streams: dict[int, Stream], plain: dict) -> None:
    """Greedy output with MTP is output without it, token for token (as far as both ran)."""
    for rid in SCHEDULE:
        ours, reference = streams[rid].emitted, plain[rid].emitted
        common = min(len(ours), len(reference))
        assert common > len(SCHEDULE[rid]) // 2
        assert ours[:common] == reference[:common], f"request {rid}: MTP output parted"


interpreter_only = pytest.mark.skipif(
    CUDA, reason="the GPU runs the graphs for real in test_mtp_graphs_on_cuda_match_eager"
)


@interpreter_only
def test_mtp_graph_buffers_under_interpreter_match_cpu(kernels, mtp_model_dir, monkeypatch):
    """The graphs' static buffers with an MTP head (run eagerly: nothing is captured off
    CUDA) give the CPU path's tokens and drafts: the catch-up in the prompt and decode graphs
    fills the head's keys and saved hidden states as the eager forward does, and the draft
    graph's loop drafts what the eager loop drafts."""
    from deltaserve.kernels import triton_compat

    cpu = _drive(_executor(mtp_model_dir, "cpu", False, True, "float32"), True)
    plain = _drive(_executor(mtp_model_dir, "cpu", False, False, "float32"), False)
    _assert_emitted_as_without_speculation(cpu, plain)
    verified = [v for stream in cpu.values() for v in stream.verified]
    assert any(a < n for a, n in verified)
    if "agree" in mtp_model_dir.name:
        assert any(0 < a for a, _ in verified), verified
    monkeypatch.setattr(triton_compat, "GPU_PATH_ON_CPU", True)
    ex = _executor(mtp_model_dir, "cpu", True, True, "float32")
    _assert_same_streams(_drive(ex, True), cpu, "graph buffers vs cpu")
    _assert_graphs_ran(ex, 1)


@needs_cuda
def test_mtp_graphs_on_cuda_match_eager(mtp_model_dir):
    """On CUDA the captured graphs (decode with the head's catch-up, draft) give the eager
    CUDA path's tokens and drafts, and greedy output equals output without speculation (fp32:
    prompts run eagerly, prompt graphs need flash's dtypes)."""
    eager = _drive(_executor(mtp_model_dir, "cuda", False, True, "float32"), True)
    ex = _executor(mtp_model_dir, "cuda", True, True, "float32")
    _assert_same_streams(_drive(ex, True), eager, "cuda graphs vs eager")
    _assert_graphs_ran(ex, 0)
    plain = _drive(_executor(mtp_model_dir, "cuda", True, False, "float32"), False)
    _assert_emitted_as_without_speculation(eager, plain)


def _after_prompts(ex: Executor) -> list[torch.Tensor]:
    """The schedule's prompts in one step through `ex`; then each request's saved hidden
    state and the head's keys of its prompt positions (the catch-up's)."""
    gen = torch.Generator().manual_seed(3)
    spec = SamplingSpec(seed=0)
    items = [
        StepItem(
            rid,
            0,
            torch.randint(0, 200_000, (n,), generator=gen).tolist(),
            True,
            NewRequest(200, spec),
        )
        for rid, n in PROMPT_LENGTHS.items()
    ]
    ex.run_step(items)
    keys = ex.cache.kv[ex.model.mtp.kv_layer, 0]
    out = []
    for rid, n in PROMPT_LENGTHS.items():
        req = ex.requests[rid]
        rows = [req.kv_row(p, ex.cache.block_size) for p in range(n - 1)]
        out += [ex.cache.hidden[req.slot].float().cpu(), keys[rows].float().cpu()]
    return out


@needs_cuda
def test_mtp_prompt_graphs_on_cuda_run_the_catch_up(kernels, mtp_model_dir):
    """bf16 prompts replay a prompt graph with the head's catch-up inside: the saved hidden
    states and the head's keys of the prompts are the eager path's (bf16 rounding apart)."""
    skip_without_fla(kernels["gated_delta"])
    eager = _after_prompts(_executor(mtp_model_dir, "cuda", False, True, "bfloat16"))
    ex = _executor(mtp_model_dir, "cuda", True, True, "bfloat16")
    graphs = _after_prompts(ex)
    assert ex.prompt_graphs.replays == 1
    for ours, reference in zip(graphs, eager, strict=True):
        assert reference.abs().amax() > 0
        torch.testing.assert_close(ours, reference, atol=3e-2, rtol=3e-2)

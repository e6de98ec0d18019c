"""The scheduler's speculation policy (engine/speculation.py), without processes or tensors:
the adaptive switch by batch size and by measured acceptance, the max_tokens room, and the
benchmark-only forcing."""

from __future__ import annotations

import pytest

from deltaserve.engine.metrics import EngineMetrics
from deltaserve.engine.planner import PlannedChunk
from deltaserve.engine.request import Request
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.engine.speculation import PROBE_STEPS, Speculation
from deltaserve.engine.speculative_config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig
from deltaserve.ipc.messages import SpecOutcome

K = 3


def decoding_request(max_tokens: int = 100, outputs: int = 4) -> Request:
    """A running request that has sampled `outputs` tokens, its state covering all but the
    last (as between two decode steps)."""
    request = Request(7, 0, (1, 2, 3), SamplingParams(max_tokens=max_tokens), 0, 0.0)
    request.admit()
    request.advance(3)
    for token in range(outputs):
        request.append_token(10 + token, 0.0)
        if token < outputs - 1:
            request.advance(1)
    return request


def verify_once(spec: Speculation, request: Request, accepted: int) -> None:
    """One step that verifies the request's drafts with `accepted` of them taken."""
    spec.choose(1)
    drafts = spec.num_drafts(request)
    chunk = PlannedChunk(request.request_id, request.num_computed, 1 + drafts, True, True)
    spec.item_fields(request, chunk)
    taken = min(accepted, chunk.num_tokens - 1)
    outcome = SpecOutcome(taken, [0.0] * taken, [], [20, 21, 22])
    spec.outcome(request, outcome, EngineMetrics())


def test_no_drafts_at_or_above_the_batch_threshold():
    spec = Speculation(SpeculativeConfig(num_speculative_tokens=K, disable_by_batch_size=4))
    assert [spec.choose(n) for n in (1, 3, 4, 64)] == [K, K, 0, 0]
    assert SpeculativeConfig().off_at_batch == DEFAULT_DISABLE_BY_BATCH_SIZE
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpeculativeConfig(disable_by_batch_size=0)


def test_positions_that_are_rarely_accepted_stop_being_drafted_and_are_probed_again():
    spec = Speculation(SpeculativeConfig(num_speculative_tokens=K))
    request = decoding_request()
    spec.outcome(request, SpecOutcome(0, [], [], [20, 21, 22]), EngineMetrics())  # first drafts
    for _ in range(40):
        verify_once(spec, request, accepted=0)
    assert spec.choose(1) == 0  # nothing pays now
    chosen = [spec.choose(1) for _ in range(2 * PROBE_STEPS)]
    assert chosen.count(1) == 2 and set(chosen) == {0, 1}  # one probe in PROBE_STEPS
    for _ in range(3 * PROBE_STEPS):  # probes that are accepted bring the drafts back
        verify_once(spec, request, accepted=K)
    assert spec.choose(1) >= 1


def test_drafts_fit_what_max_tokens_leaves():
    spec = Speculation(SpeculativeConfig(num_speculative_tokens=K))
    request = decoding_request(max_tokens=6, outputs=4)  # 2 tokens left: 1 draft + the sample
    spec.outcome(request, SpecOutcome(0, [], [], [20, 21, 22]), EngineMetrics())
    spec.choose(1)
    assert spec.num_drafts(request) == 1


def test_forcing_is_for_benchmarks_and_replaces_the_drafts():
    spec = Speculation(SpeculativeConfig(num_speculative_tokens=K, disable_by_batch_size=2))
    seen = []
    spec.force(2, lambda request, index, drafts: seen.append(index) or [index] * len(drafts))
    assert spec.choose(64) == 2
    request = decoding_request()
    spec.outcome(request, SpecOutcome(0, [], [], [20, 21]), EngineMetrics())
    assert seen == [5] and spec._drafts[request.request_id] == [5, 5]
    with pytest.raises(ValueError, match="num_drafts"):
        spec.force(K + 1)
    spec.force(None)
    assert spec.choose(64) == 0

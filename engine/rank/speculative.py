"""Speculative decoding on a rank: verify drafts, roll the DeltaNet state forward to the last
accepted position, draft the next ones with the MTP head (engine/rank/mtp.py).

A verify item (`StepItem.num_drafts` = k) runs its last sample and k drafts at positions
n .. n + k in one target forward. Rank 0 samples every one of the k + 1 rows exactly as the
sampler would sample that output token without speculation, after the drafts before it
(`Sampler.launch_speculative`: the same seed per output index, the penalties, bad words,
min_tokens and the grammar's mask after them), and keeps the rows while each sample equals
the next draft. Drafts are the head's argmax (a one-point draft distribution), for which this
is the standard rule: a draft d is taken with probability p(d), a rejection samples from p
without d, renormalised; the emitted tokens are those the target would have sampled without
speculation, token for token (greedy: its argmax), whatever the drafts were.

Rollback. The verify's DeltaNet layers read their slots' states but write no recurrent state
(`SeqSpan.verify`) and leave their inputs here (`VerifyStash`); once the accepted count a is
known, every rank rolls each slot forward over the a + 1 accepted positions from those inputs
(`_roll_forward`: one chunked DeltaNet call and a gather of conv columns per layer) and puts
back the conv window the layers overwrote. Weighed by bytes moved (not yet measured) against
keeping every position's state: on the GPU the recurrent state dominates a step's bytes at batch,
and this reads each state twice and writes it once (3 states), where keeping k + 1 states
writes k + 1 and the next step reads one (k + 2). Rejected KV rows (the target's and the
head's) are at or past the next step's first position, which writes them before any read.

At TP > 1 rank 0 broadcasts each item's accepted count and next token on the device; every
rank runs the same roll-forward and head steps on its shard.

Draft vocabulary (`draft_vocab_size`). A draft's argmax needs the lm_head's rows of every id it
may pick: over the whole vocabulary that is the largest read of a draft step (248k rows, 1.27
GB at the 4B's shapes). The head may draft among the first N ids only: BPE vocabularies such as
Qwen's are ordered by merge rank, so the low ids are the frequent tokens (FR-Spec's idea,
SGLang's `--speculative-token-map`, with the map being the first N ids). The rows are a view of
the lm_head's, sharded as it is (`VocabParallelEmbedding.argmax`): each rank reads its shard's
rows below N (a rank above N none), and the ranks all-gather one (best logit, id) pair per row,
so every rank has the picks without a broadcast and without the full logits gathered on rank 0.
No copy, so nothing for the memory budget to count, and nothing to go stale when the weights
are reloaded or slept. Exactness does not depend on N: the verify keeps the target's tokens
whatever was drafted; N only moves acceptance.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deltaserve.engine.rank.batch import SeqSpan
from deltaserve.engine.rank.mtp import draft_batch
from deltaserve.engine.rank.parallel import broadcast
from deltaserve.engine.rank.transfer import to_device
from deltaserve.ipc.messages import Sample, SpecOutcome, StepItem
from deltaserve.kernels.causal_conv1d import span_blocks
from deltaserve.kernels.gated_delta import CHUNK_SIZE, gated_delta_prefill

if TYPE_CHECKING:
    from deltaserve.engine.rank.cache import StateCache
    from deltaserve.engine.rank.draft_graphs import DraftGraphs
    from deltaserve.engine.rank.qwen3_5 import Qwen3_5ForCausalLM
    from deltaserve.engine.rank.sampler import Sampler
    from deltaserve.engine.rank.verify_graphs import VerifyGraphs


@dataclass(eq=False, slots=True)
class VerifyStash:
    """What a step's verify spans leave for the rollback: each DeltaNet layer's inputs of the
    step's rows (pre-conv qkv, post-conv qkv, a, b; `keep`), the spans' conv windows from
    before the step (every linear layer: [layers, spans, channels, width - 1]) and the step's
    final hidden states; `request_ids` the spans' requests, in order."""

    request_ids: list[int]
    spans: list[SeqSpan]
    windows: torch.Tensor | None  # None: a verify graph's step, whose own buffers hold it all
    layers: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    hidden: torch.Tensor | None = None
    graphs: VerifyGraphs | None = None  # the verify graphs that ran the step's forward

    def keep(
        self, layer: int, qkv: torch.Tensor, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor
    ) -> None:
        self.layers[layer] = (qkv, mixed, a, b)

    def keep_hidden(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


@dataclass(slots=True)
class SpecResult:
    """Rank 0's samples of a speculative step (one per sampled item: its last emitted token),
    the outcome of each item that verified or proposed, and the requests that failed."""

    samples: list[Sample]
    outcomes: dict[int, SpecOutcome]
    failed: dict[int, str]


@dataclass(frozen=True, slots=True)
class Drafting:
    """One request's head steps after a step: from `position` (its last accepted one, whose
    next token is `token`), `steps` of them."""

    request_id: int
    slot: int
    position: int
    token: int
    steps: int
    blocks: list[int]
    block_table: torch.Tensor

    def kv_row(self, step: int, block_size: int) -> int:
        """The paged-cache row of the head's keys at draft step `step` (its position + step)."""
        position = self.position + step
        return self.blocks[position // block_size] * block_size + position % block_size


def speculates(items: list[StepItem]) -> bool:
    """Whether a step verifies or drafts (else it samples as without speculation)."""
    return any(item.num_drafts or item.propose for item in items)


def positions_run(item: StepItem) -> int:
    """Positions the item runs: its tokens, or one (its request's last sample)."""
    return len(item.token_ids) or 1


class Speculator:
    """Speculative decoding's work on one rank around the executor's forward: `begin` before
    it, `sample` after it (every rank; rank 0 holds the sampler)."""

    def __init__(
        self,
        model: Qwen3_5ForCausalLM,
        cache: StateCache,
        sampler: Sampler | None,
        device: torch.device,
        draft_vocab: int,
    ) -> None:
        """`draft_vocab`: the head drafts among the first this many token ids."""
        self.model = model
        self.draft_vocab = draft_vocab
        self.cache = cache
        self.sampler = sampler
        self.device = device
        self.stash: VerifyStash | None = None  # the step's, between the forward and `sample`
        self.graphs: DraftGraphs | None = None  # the executor's, once captured
        self.deltanets = [layer.linear_attn for layer in model.model.layers if layer.is_linear]

    def begin(
        self, items: list[StepItem], spans: list[SeqSpan], graphs: VerifyGraphs | None = None
    ) -> VerifyStash | None:
        """Before a step's forward (`spans` its items' in order): a stash for its verify
        spans, holding their conv windows, which the forward overwrites; or, where `graphs`
        run the forward, naming them (they keep the stash and roll the spans forward)."""
        verify = [
            (item.request_id, span) for item, span in zip(items, spans, strict=True) if span.verify
        ]
        if not verify:
            self.stash = None
            return None
        windows = None
        if graphs is None:
            slots = to_device([span.slot for _, span in verify], torch.int64, self.device)
            windows = self.cache.conv[:, slots].clone()
        self.stash = VerifyStash(
            [rid for rid, _ in verify], [span for _, span in verify], windows, graphs=graphs
        )
        return self.stash

    def sample(
        self, items: list[StepItem], logits: torch.Tensor | None, held: dict
    ) -> SpecResult | None:
        """After the forward of a step that `speculates`: verify (rank 0), roll the verify
        spans forward, draft. `held` maps request ids to the executor's LiveRequests, whose
        positions this sets to the accepted ones. Returns rank 0's results (None elsewhere)."""
        sampled = [item for item in items if item.sample]
        result = None
        table = [[0, 0]] * len(sampled)  # each item's (accepted drafts, next token)
        if self.sampler is not None:
            result, table = self._verify(sampled, logits)
        if sampled:
            shared = broadcast(to_device(table, torch.int64, self.device))
            table = shared.tolist()
        if self.stash is not None:
            counts = {
                item.request_id: accepted
                for item, (accepted, _) in zip(sampled, table, strict=True)
            }
            self._roll_forward([counts[rid] for rid in self.stash.request_ids])
        drafting = []
        for item, (accepted, token) in zip(sampled, table, strict=True):
            req = held[item.request_id]
            req.num_tokens = item.start + positions_run(item) - item.num_drafts + accepted
            req.sampled_through = req.num_tokens
            if item.propose and (result is None or item.request_id not in result.failed):
                # head rows at num_tokens - 1 on: within its blocks (the scheduler grew them)
                capacity = len(req.blocks) * self.cache.block_size
                steps = min(item.propose, capacity - req.num_tokens + 1)
                drafting.append(
                    Drafting(
                        item.request_id,
                        req.slot,
                        req.num_tokens - 1,
                        token,
                        steps,
                        req.blocks,
                        req.block_table,
                    )
                )
        if sampled:
            slots = [held[item.request_id].slot for item in sampled]
            self.cache.last_tokens[to_device(slots, torch.int64, self.device)] = to_device(
                [token for _, token in table], torch.int64, self.device
            )
        drafts = self._draft(drafting)
        self.stash = None
        if result is not None:
            for rid, outcome in result.outcomes.items():
                result.outcomes[rid] = SpecOutcome(
                    outcome.accepted, outcome.logprobs, outcome.top_logprobs, drafts.get(rid, [])
                )
        return result

    def _verify(
        self, sampled: list[StepItem], logits: torch.Tensor
    ) -> tuple[SpecResult, list[list[int]]]:
        """Rank 0: each item's rows sampled (`Sampler.launch_speculative`), its drafts kept
        while they equal the samples; the emitted tokens recorded in the sampler's state."""
        drafts = [list(item.token_ids[len(item.token_ids) - item.num_drafts :]) for item in sampled]
        ids = [item.request_id for item in sampled]
        launch = self.sampler.launch_speculative(ids, drafts, logits)
        rows = self.sampler.finish_rows(launch)
        samples, outcomes, table = [], {}, []
        first = 0
        for item, wanted in zip(sampled, drafts, strict=True):
            mine = rows[first : first + len(wanted) + 1]
            first += len(wanted) + 1
            accepted = 0
            while accepted < len(wanted) and mine[accepted].token_id == wanted[accepted]:
                accepted += 1
            emitted = mine[: accepted + 1]
            if item.request_id not in launch.failed:
                for sample in emitted:
                    self.sampler.record(item.request_id, sample.token_id)
            samples.append(emitted[-1])
            table.append([accepted, emitted[-1].token_id])
            if item.num_drafts or item.propose:
                taken = emitted[:-1]
                outcomes[item.request_id] = SpecOutcome(
                    accepted,
                    [s.logprob for s in taken],
                    [s.top_logprobs for s in taken] if emitted[-1].top_logprobs else [],
                    [],
                )
        return SpecResult(samples, outcomes, launch.failed), table

    def _roll_forward(self, accepted: list[int]) -> None:
        """Each verify span's DeltaNet state from before the step (the recurrent state, which
        the verify did not write, and the stashed conv window) over its `accepted` + 1 first
        positions, from the inputs its layers stashed."""
        stash, cache = self.stash, self.cache
        if stash.graphs is not None:
            stash.graphs.roll_forward(accepted)
            return
        spans = stash.spans
        lengths = [n + 1 for n in accepted]
        rows = [span.offset + i for span, n in zip(spans, lengths, strict=True) for i in range(n)]
        row_index = to_device(rows, torch.int64, self.device)
        slots = to_device([span.slot for span in spans], torch.int64, self.device)
        bounds = to_device([0, *itertools.accumulate(lengths)], torch.int32, self.device)
        chunks = to_device(span_blocks(lengths, CHUNK_SIZE), torch.int32, self.device)
        # the new window's column c is column lengths[i] + c of [old window | inputs]
        width = cache.conv.shape[-1]
        longest = max(lengths)
        columns = to_device(
            [[n + c for c in range(width)] for n in lengths], torch.int64, self.device
        )
        inputs_at = to_device(
            [
                [span.offset + min(i, n - 1) for i in range(longest)]
                for span, n in zip(spans, lengths, strict=True)
            ],
            torch.int64,
            self.device,
        )
        for deltanet in self.deltanets:
            layer = deltanet.cache_layer
            qkv, mixed, a, b = stash.layers[layer]
            inputs = (
                qkv[inputs_at].transpose(1, 2).to(cache.conv.dtype)
            )  # [spans, channels, longest]
            window = torch.cat((stash.windows[layer], inputs), dim=-1)
            cache.conv[layer, slots] = window.gather(
                -1, columns[:, None, :].expand(-1, window.shape[1], -1)
            )
            gated_delta_prefill(
                mixed[row_index],
                a[row_index],
                b[row_index],
                deltanet.A_log,
                deltanet.dt_bias,
                cache.recurrent[layer],
                slots.to(torch.int32),
                bounds,
                chunks.reshape(-1, 2),
                deltanet.num_k_heads,
            )
        rows_at = [span.offset + n - 1 for span, n in zip(spans, lengths, strict=True)]
        cache.hidden[slots] = stash.hidden[to_device(rows_at, torch.int64, self.device)]

    def _draft(self, drafting: list[Drafting]) -> dict[int, list[int]]:
        """The MTP head's steps: each request's first from the target's hidden state at its
        last accepted position and its next token, each next one from the head's own output
        and draft; the argmax drafts (among the first `draft_vocab` ids) by request id, read
        to the host once after the last step (every rank has them: no broadcast)."""
        if not drafting:
            return {}
        longest = max(d.steps for d in drafting)
        widest = max(len(d.blocks) for d in drafting)
        if self.graphs is not None and self.graphs.can_run(len(drafting), longest, widest):
            table = self._replay_drafts(drafting, longest).tolist()
        else:
            table = self._run_drafts(drafting, longest).tolist()
        return {d.request_id: table[i][: d.steps] for i, d in enumerate(drafting)}

    def _replay_drafts(self, drafting: list[Drafting], longest: int) -> torch.Tensor:
        """The head's `longest` steps in a draft graph's replay: a request past its own steps
        runs on at its first step's context, writing no keys (its picks are not read)."""
        bs = self.cache.block_size
        positions, kv_rows, seq_lens = [], [], []
        for step in range(longest):
            positions.append([d.position + step for d in drafting])
            kv_rows.append([d.kv_row(step, bs) if step < d.steps else -1 for d in drafting])
            seq_lens.append([d.position + 1 + (step if step < d.steps else 0) for d in drafting])
        return self.graphs.run(
            [d.token for d in drafting], [d.slot for d in drafting], positions, kv_rows, seq_lens
        )

    def _run_drafts(self, drafting: list[Drafting], longest: int) -> torch.Tensor:
        """The head's steps eagerly, each over the requests still drafting: picks [rows,
        longest] (zeros past a request's steps)."""
        mtp, cache, bs = self.model.mtp, self.cache, self.cache.block_size
        slots = to_device([d.slot for d in drafting], torch.int64, self.device)
        tokens = to_device([d.token for d in drafting], torch.int64, self.device)
        hidden = cache.hidden[slots]
        picks = torch.zeros((len(drafting), longest), dtype=torch.int64, device=self.device)
        for step in range(longest):
            active = [i for i, d in enumerate(drafting) if d.steps > step]
            rows = to_device(active, torch.int64, self.device)
            spans, positions, kv_rows = [], [], []
            for row, i in enumerate(active):
                d = drafting[i]
                position = d.position + step
                spans.append(SeqSpan(row, 1, position, d.slot, d.block_table, d.blocks))
                positions.append(position)
                kv_rows.append(d.kv_row(step, bs))
            batch = draft_batch(spans, positions, kv_rows, self.device)
            x = mtp.fuse(self.model.model.embed_tokens(tokens[rows]), hidden[rows])
            g = mtp(x, batch, cache)
            picked = self.model.output_embedding.argmax(g, self.draft_vocab)
            tokens[rows] = picked
            hidden[rows] = g
            picks[rows, step] = picked
        return picks

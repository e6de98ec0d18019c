"""Batched token sampling on rank 0.

The order of operations follows vLLM v1 (`vllm/v1/sample/sampler.py`, `ops/penalties.py`,
`ops/topk_topp_sampler.py`, `logits_processor` min-p), written anew:
  raw logprobs (log_softmax of the untouched logits, vLLM's default "raw_logprobs")
  -> allowed_token_ids: every other token at -inf; bad_words: a sequence's last token at -inf
     where the output so far ends with the rest (`barred`; vLLM's apply_bad_words)
  -> min_tokens: EOS and stop ids at -inf until min_tokens tokens were sampled
  -> guided decoding: every token that cannot continue the output towards a match of the
     request's grammar at -inf (llguidance's mask, engine/rank/grammar_mask.py; its EOS ids
     stay where the output is a match); a request past its bounds fails alone
  -> logit_bias added
  -> a thinking budget spent: </think> the only token (`SamplingSpec.think_budget`)
  -> penalties (repetition on prompt+output tokens, then frequency and presence on output tokens)
  -> greedy rows: argmax
  -> random rows: temperature -> min-p -> top-k -> top-p -> exponential race.
The race (`argmax(probs / q)`, q ~ Exp(1)) draws q from a per-request `torch.Generator`
re-seeded for every token from (seed, output index), over the candidates best first with tied
logits in token-id order (`best_first`), so a request's tokens depend on its own logits and
seed only, never on its batch companions. The masks and the bias (vLLM's Sampler
`apply_logits_processors`, and its MinTokens and LogitBias logits processors,
`vllm/v1/sample/logits_processor/builtin.py`) touch only their own rows, and the rank counts
each request's samples (and keeps its last output tokens for bad words) itself, so they keep
that true; a batch where no request uses them or penalties reads the logits once, unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from deltaserve.engine.guided.masks import apply_masks
from deltaserve.engine.rank.grammar_mask import GuideMatchers
from deltaserve.engine.rank.transfer import to_device
from deltaserve.ipc.messages import Sample, SamplingSpec
from deltaserve.kernels.logit_stats import logsumexp_argmax

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def token_seed(seed: int, index: int) -> int:
    """The generator seed for output token `index` of a request seeded with `seed`."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ index) >> 1  # 63 bits


def _has_penalties(spec: SamplingSpec) -> bool:
    return (
        spec.repetition_penalty != 1.0
        or spec.presence_penalty != 0.0
        or spec.frequency_penalty != 0.0
    )


@dataclass(slots=True)
class _RequestState:
    """One request's sampling state. History is kept only when penalties are on, sparsely
    (a penalty touches only the tokens seen), so no per-request vocab-sized tensor exists.
    `always_adjusts`: penalties, a bias or allowed_token_ids change its logits at every token
    (the min_tokens and bad-word masks only where `barred` finds tokens)."""

    spec: SamplingSpec
    has_penalties: bool
    always_adjusts: bool
    max_token_id: int  # the largest id its masks and bias touch (-1: none)
    num_sampled: int = 0
    seen: set[int] = field(default_factory=set)  # prompt and output tokens (repetition)
    output_counts: dict[int, int] = field(default_factory=dict)  # output occurrences
    generator: torch.Generator | None = None
    # the last output tokens a bad word's prefix spans
    recent: list[int] = field(default_factory=list)
    allowed: torch.Tensor | None = None  # allowed_token_ids on the device, sent up once
    guided: bool = False  # its matcher is in the sampler's GuideMatchers
    thinking: bool = False  # inside the think block its budget counts (till think_end_id)
    # a speculative row's state (`advanced`): the drafts its output is taken to end with,
    # which its grammar's matcher takes before its mask
    drafts: tuple[int, ...] = ()

    def advanced(self, drafts: tuple[int, ...]) -> _RequestState:
        """A copy whose output so far ends with `drafts` (speculative decoding's later rows),
        with a generator of its own."""
        state = dataclasses.replace(
            self,
            seen=set(self.seen),
            output_counts=dict(self.output_counts),
            recent=list(self.recent),
            generator=None,
            drafts=drafts,
        )
        for token in drafts:
            state.count(token)
        return state

    def count(self, token: int) -> None:
        """A token sampled for it: its next seed index, thinking budget, bad words' recent
        tokens and penalties' history move on (its matcher is the sampler's: `Sampler._count`)."""
        if self.thinking and token == self.spec.think_end_id:
            self.thinking = False
        self.num_sampled += 1
        if self.spec.bad_words:  # as many last tokens as the longest prefix needs
            self.recent.append(token)
            del self.recent[: max(0, len(self.recent) - max(map(len, self.spec.bad_words)) + 1)]
        if self.has_penalties:
            self.seen.add(token)
            self.output_counts[token] = self.output_counts.get(token, 0) + 1

    def thinking_spent(self) -> bool:
        """Its thinking budget is used up: </think> must come next."""
        return self.thinking and self.num_sampled >= self.spec.think_budget

    def barred(self) -> list[int]:
        """The tokens masked for its next sample: EOS and stop ids before min_tokens, and each
        bad word's last token where the output so far ends with the rest of it."""
        spec, recent = self.spec, self.recent
        out = list(spec.stop_token_ids) if self.num_sampled < spec.min_tokens else []
        for word in spec.bad_words:
            prefix = len(word) - 1
            if prefix <= len(recent) and (prefix == 0 or recent[-prefix:] == list(word[:-1])):
                out.append(word[-1])
        return out

    def allowed_index(self, device: torch.device) -> torch.Tensor:
        if self.allowed is None:
            self.allowed = to_device(list(self.spec.allowed_token_ids), torch.int64, device)
        return self.allowed


@dataclass(slots=True)
class SampleLaunch:
    """A step's samples, queued on the device: `tokens` there, and `host` [n, 2 + 2k] float64
    (token, logprob, k alternatives' ids, their logprobs) once `done` has fired."""

    request_ids: list[int]
    states: list[_RequestState]
    tokens: torch.Tensor
    host: torch.Tensor
    done: torch.cuda.Event | None  # None: the host tensor is already filled (CPU)
    failed: dict[int, str] = field(default_factory=dict)  # requests past their own bounds

    def ready(self) -> bool:
        return self.done is None or self.done.query()


@dataclass(frozen=True, slots=True)
class _BiasRows:
    """The biases of one batch layout, on the device: `index` into the flattened [n, vocab]
    logits (row * vocab + token id) and `values`. Kept while the layout lasts (a run of
    decode steps over the same requests), so a step with biased rows sends nothing up."""

    layout: tuple  # (vocab, device, (row, request id) of every biased row)
    index: torch.Tensor
    values: torch.Tensor


class Sampler:
    """`guide_tokenizer(end_ids)` makes llguidance's tokenizer of the vocabulary
    (GuideMatchers), the first time a guided request comes; without it guided requests are
    refused."""

    def __init__(self, guide_tokenizer: Callable[[tuple[int, ...]], object] | None = None) -> None:
        self._requests: dict[int, _RequestState] = {}
        self._in_flight = False  # a launch not yet finished
        self._bias_rows: _BiasRows | None = None
        self._guides = None if guide_tokenizer is None else GuideMatchers(guide_tokenizer)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._requests

    def add(self, request_id: int, spec: SamplingSpec, output_ids: Sequence[int] = ()) -> None:
        """Hold a request; `output_ids` it sampled before a preemption count as sampled here
        (its next seed index, penalties, bad words, guided state, thinking budget)."""
        if request_id in self._requests:
            raise ValueError(f"sampler already holds request {request_id}")
        ids = [
            *spec.stop_token_ids,
            *(t for t, _ in spec.logit_bias),
            *spec.allowed_token_ids,
            *(t for word in spec.bad_words for t in word),
            *spec.guide_end_ids,
            *([spec.think_end_id] if spec.think_budget >= 0 else []),
        ]
        if any(t < 0 for t in ids) or not all(spec.bad_words):
            raise ValueError(
                f"request {request_id}: negative token id in {ids}, or an empty bad word"
            )
        penalties = _has_penalties(spec)
        guided = bool(spec.guide_grammar)
        if guided:
            if self._guides is None or spec.guide_limits is None:
                raise ValueError(
                    f"request {request_id}: guided decoding needs the vocabulary's tokenizer "
                    "and the grammar's limits"
                )
            self._guides.add(request_id, spec.guide_grammar, spec.guide_end_ids, spec.guide_limits)
        adjusts = penalties or bool(spec.logit_bias) or bool(spec.allowed_token_ids) or guided
        state = _RequestState(
            spec,
            penalties,
            adjusts,
            max(ids, default=-1),
            guided=guided,
            thinking=spec.think_budget >= 0,
        )
        for token in output_ids:
            self._count(request_id, state, token)
        self._requests[request_id] = state

    def _count(self, request_id: int, state: _RequestState, token: int) -> None:
        """A token sampled for the request: its matcher takes it (guided), its state counts it."""
        if state.guided:
            self._guides.consume(request_id, token)
        state.count(token)

    def remove(self, request_id: int) -> None:
        """Forget a request; idempotent."""
        if self._requests.pop(request_id, None) is not None and self._guides is not None:
            self._guides.remove(request_id)

    def observe(self, request_id: int, token_ids: list[int], is_prompt: bool) -> None:
        """Record history for penalties: repetition counts prompt+output tokens (as vLLM),
        presence/frequency count output tokens only."""
        state = self._state(request_id)
        if not state.has_penalties:
            return
        state.seen.update(token_ids)
        if not is_prompt:
            for t in token_ids:
                state.output_counts[t] = state.output_counts.get(t, 0) + 1

    def sample(self, request_ids: list[int], logits: torch.Tensor) -> list[Sample]:
        """Sample one token per row of `logits` [n, vocab] (row i for request_ids[i])."""
        return self.finish(self.launch(request_ids, logits))

    def launch(
        self,
        request_ids: list[int],
        logits: torch.Tensor,
        slots: list[int] | None = None,
        last_tokens: torch.Tensor | None = None,
    ) -> SampleLaunch:
        """Queue the sampling of one token per row of `logits` [n, vocab] (row i for
        request_ids[i]) and the copy of the results to the host, without waiting for the
        device: nothing here reads a device value (host-made tensors go up from pinned
        memory), save the rare wide nucleus in `_sample_random`. With `slots`, each token is
        also written to `last_tokens[slots[i]]` on the device. `finish` must come before the
        next launch: the next tokens' seeds and penalties count this one."""
        return self._launch(
            request_ids, [self._state(r) for r in request_ids], logits, slots, last_tokens
        )

    def launch_speculative(
        self, request_ids: list[int], drafts: list[list[int]], logits: torch.Tensor
    ) -> SampleLaunch:
        """Speculative decoding's verify: request i has 1 + len(drafts[i]) rows of `logits`,
        in order, and its row j is sampled as its next output token j would be after
        drafts[i][:j] (seed, penalties, masks and grammar all counting them). `finish_rows`
        reads them; `record` counts the tokens kept."""
        ids, states = [], []
        for request_id, wanted in zip(request_ids, drafts, strict=True):
            state = self._state(request_id)
            for depth in range(len(wanted) + 1):
                ids.append(request_id)
                states.append(state if depth == 0 else state.advanced(tuple(wanted[:depth])))
        return self._launch(ids, states, logits, None, None)

    def _launch(
        self,
        request_ids: list[int],
        states: list[_RequestState],
        logits: torch.Tensor,
        slots: list[int] | None,
        last_tokens: torch.Tensor | None,
    ) -> SampleLaunch:
        if self._in_flight:
            raise RuntimeError("sampler launch before the previous launch was finished")
        if logits.dim() != 2 or logits.shape[0] != len(request_ids):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} does not match {len(request_ids)} requests"
            )
        num_alternatives = max((s.spec.num_logprobs for s in states), default=0)
        if not request_ids:
            return SampleLaunch(
                [], [], torch.empty(0, dtype=torch.int64), torch.empty((0, 2)), None
            )
        logits = logits.float()
        slot_rows = None if slots is None else to_device(slots, torch.int64, logits.device)
        # Raw logprobs without materialising log_softmax: logit - logsumexp(row); one read of
        # the logits on the GPU gives the argmax too, and the greedy samples as `packed` holds
        # them, already in last_tokens.
        log_normaliser, tokens, greedy = logsumexp_argmax(logits, slot_rows, last_tokens)

        work = logits
        barred = {
            i: b
            for i, s in enumerate(states)
            if (s.spec.bad_words or s.num_sampled < s.spec.min_tokens) and (b := s.barred())
        }
        forced = {i: s.spec.think_end_id for i, s in enumerate(states) if s.thinking_spent()}
        adjusted = [
            i for i, s in enumerate(states) if s.always_adjusts or i in barred or i in forced
        ]
        failed: dict[int, str] = {}
        if adjusted:
            work = logits.clone(memory_format=torch.contiguous_format)  # `_adjust` indexes it flat
            self._adjust(work, adjusted, request_ids, states, barred)
            guided = [i for i in adjusted if states[i].guided]
            if guided:  # last: llguidance's masks (filled on the host while the device works)
                ids = [request_ids[i] for i in guided]
                for depth in sorted({len(states[i].drafts) for i in guided}):  # speculative rows
                    rows = [i for i in guided if len(states[i].drafts) == depth]
                    masks = self._guides.masks(
                        [request_ids[i] for i in rows],
                        work.shape[1],
                        [states[i].drafts for i in rows] if depth else None,
                    )
                    apply_masks(work, to_device(rows, torch.int64, work.device), masks)
                failed = self._guides.take_failures(list(dict.fromkeys(ids)))
            for i, token in forced.items():  # the only token left
                work[i].fill_(float("-inf"))[token] = 0.0
            tokens = work.argmax(dim=-1)  # greedy rows keep these
        random_rows = [i for i, s in enumerate(states) if not s.spec.is_greedy]
        if random_rows:
            tokens = tokens.clone()
            drawn = self._sample_random(work, random_rows, [states[i] for i in random_rows])
            tokens[to_device(random_rows, torch.int64, tokens.device)] = drawn

        columns = [greedy]
        if adjusted or random_rows:  # tokens other than the argmax
            token_logprobs = logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - log_normaliser
            columns = [tokens[:, None].double(), token_logprobs[:, None].double()]
            if slot_rows is not None:
                last_tokens[slot_rows] = tokens
        if num_alternatives > 0:
            values, ids = logits.topk(num_alternatives, dim=-1)  # sorted, best first
            columns += [ids.double(), (values - log_normaliser.unsqueeze(1)).double()]
        # token, logprob, alternatives' ids, their logprobs: float64 holds every id and fp32
        # value exactly, so one copy brings the whole step to the host
        packed = columns[0] if len(columns) == 1 else torch.cat(columns, dim=1)
        done = None
        if packed.is_cuda:
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            packed, done = host, torch.cuda.Event()
            done.record()
        self._in_flight = True
        return SampleLaunch(list(request_ids), states, tokens, packed, done, failed)

    def finish(self, launch: SampleLaunch) -> list[Sample]:
        """Wait for a launch's results on the host; count the tokens in each request's state
        (its next seed, its penalties)."""
        samples = self.finish_rows(launch)
        for sample, state in zip(samples, launch.states, strict=True):
            # the launch's state: a pipelined step may have dropped the request since
            self._count(sample.request_id, state, sample.token_id)
        return samples

    def finish_rows(self, launch: SampleLaunch) -> list[Sample]:
        """Wait for a launch's results on the host, one Sample per row, counting nothing
        (speculative rows: `record` then counts those kept)."""
        self._in_flight = False
        if launch.done is not None:
            launch.done.synchronize()
        k_max = (launch.host.shape[1] - 2) // 2
        samples = []
        for row, request_id, state in zip(
            launch.host.tolist(), launch.request_ids, launch.states, strict=True
        ):
            token, k = int(row[0]), state.spec.num_logprobs
            alternatives = [
                (int(t), v)
                for t, v in zip(row[2 : 2 + k], row[2 + k_max : 2 + k_max + k], strict=True)
            ]
            samples.append(Sample(request_id, token, row[1], alternatives))
        return samples

    def record(self, request_id: int, token: int) -> None:
        """A request's output token, in its state (its matcher takes it too)."""
        self._count(request_id, self._state(request_id), token)

    def _adjust(
        self,
        work: torch.Tensor,
        rows: list[int],
        request_ids: list[int],
        states: list[_RequestState],
        barred: dict[int, list[int]],
    ) -> None:
        """In place on `work` [n, vocab], for `rows`: the bias, the penalties, then the masks
        (`barred` tokens by row, allowed_token_ids; each guided row's grammar mask follows).
        vLLM (`Sampler.apply_logits_processors`) masks first, and a masked logit stays -inf
        through its bias and penalties, so masking last gives the same logits (and no penalty's
        clamp to the float range can lift a masked logit off -inf)."""
        vocab, device = work.shape[1], work.device
        for i in rows:
            if states[i].max_token_id >= vocab:
                raise ValueError(
                    f"request {request_ids[i]}: token id {states[i].max_token_id} in its "
                    "stop_token_ids, logit_bias, allowed_token_ids, bad_words or guide_end_ids is "
                    f"outside the vocabulary [0, {vocab})"
                )
        flat = work.view(-1)
        biased = tuple((i, request_ids[i]) for i in rows if states[i].spec.logit_bias)
        if biased:
            layout = (vocab, device, biased)
            if self._bias_rows is None or self._bias_rows.layout != layout:
                bias_of = {i: states[i].spec.logit_bias for i, _ in biased}
                pairs = [(i * vocab + t, b) for i, bias in bias_of.items() for t, b in bias]
                index = to_device([p[0] for p in pairs], torch.int64, device)
                values = to_device([p[1] for p in pairs], work.dtype, device)
                self._bias_rows = _BiasRows(layout, index, values)
            # each (row, token) once, so each logit gets exactly one addition: deterministic
            flat.index_add_(0, self._bias_rows.index, self._bias_rows.values)
        for i in rows:
            if states[i].has_penalties:
                _apply_penalties(work[i], states[i])
        masked = [i * vocab + t for i, tokens in barred.items() for t in tokens]
        if masked:
            flat.index_fill_(0, to_device(masked, torch.int64, device), float("-inf"))
        for i in rows:  # every token but the allowed ones: theirs kept, the rest -inf
            if states[i].spec.allowed_token_ids:
                allowed = states[i].allowed_index(device)
                kept = work[i].index_select(0, allowed)
                work[i].fill_(float("-inf")).index_copy_(0, allowed, kept)

    def _state(self, request_id: int) -> _RequestState:
        state = self._requests.get(request_id)
        if state is None:
            raise ValueError(f"sampler holds no request {request_id}")
        return state

    def _sample_random(
        self, work: torch.Tensor, rows: list[int], states: list[_RequestState]
    ) -> torch.Tensor:
        """The random rows together: temperature, min-p, top-k and top-p are tensor ops over
        all of them at once; only the exponential race's noise is drawn row by row, from each
        request's own generator, so a request's tokens are exactly what `_draw` gives it alone
        (the row-by-row reference kept for the rare nucleus wider than its candidates)."""
        device, vocab = work.device, work.shape[1]
        specs = [s.spec for s in states]
        for state in states:
            if state.generator is None:
                state.generator = torch.Generator(device=device)
            state.generator.manual_seed(token_seed(state.spec.seed, state.num_sampled))
        # each row's candidates: its top-k, the _TOP_P_CANDIDATES best for top-p alone, or the
        # whole vocabulary (in vocabulary order); the noise is drawn over exactly that many, in
        # that order, as `_draw` does
        widths = [
            s.top_k
            if 0 < s.top_k < vocab
            else min(_TOP_P_CANDIDATES, vocab)
            if s.top_p < 1.0
            else vocab
            for s in specs
        ]
        # the rows' knobs in one copy to the device: temperature, log(min_p), top_p, width
        knobs = to_device(
            [
                [s.temperature for s in specs],
                [math.log(s.min_p) if s.min_p > 0.0 else -math.inf for s in specs],
                [s.top_p for s in specs],
                widths,
            ],
            torch.float32,
            device,
        )
        index = {}  # row lists as device tensors, each sent up once (list indexing would sync)

        def at(rows_list: list[int]) -> torch.Tensor:
            key = tuple(rows_list)
            if key not in index:
                index[key] = to_device(rows_list, torch.int64, device)
            return index[key]

        scaled = (work if len(rows) == work.shape[0] else work[at(rows)]) / knobs[0][:, None]
        x = scaled
        if any(s.min_p > 0.0 for s in specs):
            # vLLM MinPLogitsProcessor: prob < min_p * max prob, i.e. x < max x + log(min_p)
            x = x.masked_fill(
                x < x.max(dim=-1, keepdim=True).values + knobs[1][:, None], float("-inf")
            )
        drawn = torch.empty(len(rows), dtype=torch.long, device=device)
        filtered = [0 < s.top_k < vocab or s.top_p < 1.0 for s in specs]
        whole = [j for j, f in enumerate(filtered) if not f]
        if whole:
            rows_x = x if len(whole) == len(rows) else x[at(whole)]
            drawn[at(whole)] = _race(rows_x, None, [vocab] * len(whole), [states[j] for j in whole])
        cut = [j for j, f in enumerate(filtered) if f]
        if cut:
            sub = [specs[j] for j in cut]
            cut_x = x if len(cut) == len(rows) else x[at(cut)]
            cut_knobs = knobs if len(cut) == len(rows) else knobs[:, at(cut)]
            values, ids = best_first(cut_x, max(widths[j] for j in cut))
            col = torch.arange(values.shape[1], device=device)
            values = values.masked_fill(col >= cut_knobs[3][:, None], float("-inf"))
            limited = [0 < s.top_k < vocab for s in sub]
            if any(s.top_p < 1.0 for s in sub):
                # top-p against the top-k's mass when top-k is set, else the whole row's
                norm = values.logsumexp(dim=-1)
                unlimited = [i for i, lim in enumerate(limited) if not lim]
                if unlimited:
                    norm[at(unlimited)] = cut_x[at(unlimited)].logsumexp(dim=-1)
                probs = (values - norm[:, None]).exp()
                mass_before = probs.cumsum(dim=-1) - probs
                values = values.masked_fill(mass_before >= cut_knobs[2][:, None], float("-inf"))
            drawn[at(cut)] = _race(values, ids, [widths[j] for j in cut], [states[j] for j in cut])
            # a nucleus that kept its last candidate may reach past them: `_draw` sorts it all
            open_ended = [i for i, s in enumerate(sub) if s.top_p < 1.0 and not limited[i]]
            if open_ended:
                last = values[at(open_ended), at([widths[cut[i]] - 1 for i in open_ended])]
                for i, inf in zip(open_ended, torch.isinf(last).tolist(), strict=True):  # waits
                    if not inf:  # rare: the row-by-row rule, from the same generator state
                        j, state = cut[i], states[cut[i]]
                        state.generator.manual_seed(token_seed(state.spec.seed, state.num_sampled))
                        drawn[j] = _draw(scaled[j], state.spec, state.generator)
        return drawn


def _race(
    values: torch.Tensor, ids: torch.Tensor | None, widths: list[int], states: list[_RequestState]
) -> torch.Tensor:
    """The exponential race over each row's candidates (`values`, -inf where excluded; token
    ids `ids`, or None when the columns are the vocabulary): argmax(probs / q), q ~ Exp(1)
    drawn from the row's own generator over its first `widths[j]` columns, as `_draw` draws
    it (so a request's token never depends on its batch companions)."""
    noise = torch.ones_like(values)
    for j, (state, width) in enumerate(zip(states, widths, strict=True)):
        noise[j, :width].exponential_(generator=state.generator)
    best = (values.softmax(dim=-1) / noise).argmax(dim=-1)
    return best if ids is None else ids.gather(1, best[:, None])[:, 0]


def best_first(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best logits of each row and their token ids, best first, tied logits in token-id
    order. The noise of a row's race is drawn column by column, so the columns' order must not
    depend on how many candidates its batch fetched: torch.topk orders tied values one way at
    one width and another at the next. (Which of the tokens tied exactly at the k-th place
    topk keeps is still its own choice.)"""
    values, ids = x.topk(k, dim=-1)
    by_id = ids.argsort(dim=-1)
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    by_value = values.argsort(dim=-1, descending=True, stable=True)
    return values.gather(-1, by_value), ids.gather(-1, by_value)


# Top-p first looks for the nucleus among this many best tokens (one topk instead of a sort
# of the whole vocabulary); only a flatter distribution falls back to the full sort.
_TOP_P_CANDIDATES = 1024


def _draw(x: torch.Tensor, spec: SamplingSpec, generator: torch.Generator) -> torch.Tensor:
    """One random token from temperature-scaled logits `x` [vocab]: min-p, top-k, top-p,
    then the exponential race. Top-k and top-p shrink the row to sorted candidates (values
    `x`, token ids `ids`), so the later work is over those, not the whole vocabulary."""
    vocab = x.shape[0]
    ids: torch.Tensor | None = None  # None: x is indexed by token id
    if spec.min_p > 0.0:
        # vLLM MinPLogitsProcessor: prob < min_p * max prob, i.e. x < max x + log(min_p).
        x = x.masked_fill(x < x.max() + math.log(spec.min_p), float("-inf"))
    if 0 < spec.top_k < vocab:
        # NOTE: vLLM keeps every token tied with the k-th; topk keeps exactly k.
        x, ids = best_first(x, spec.top_k)
        if spec.top_p < 1.0:
            x = _top_p_sorted(x, x.logsumexp(dim=0), spec.top_p)
    elif spec.top_p < 1.0:
        log_normaliser = x.logsumexp(dim=0)
        candidates, ids = best_first(x, min(_TOP_P_CANDIDATES, vocab))
        kept = _top_p_sorted(candidates, log_normaliser, spec.top_p)
        if candidates.shape[0] < vocab and not bool(torch.isinf(kept[-1])):
            # The last candidate is inside the nucleus, which may reach further: sort all.
            # ties in id order, as best_first
            candidates, ids = x.sort(descending=True, stable=True)
            kept = _top_p_sorted(candidates, log_normaliser, spec.top_p)
        x = kept
    probs = torch.softmax(x, dim=-1)
    q = torch.empty_like(probs).exponential_(generator=generator)
    best = (probs / q).argmax()
    return best if ids is None else ids[best]


def _top_p_sorted(x: torch.Tensor, log_normaliser: torch.Tensor, p: float) -> torch.Tensor:
    """Top-p over logits sorted best first, probabilities taken against `log_normaliser`.
    vLLM's apply_top_k_top_p drops a token when the ascending cumulative probability up to
    it is <= 1 - p, i.e. keeps it while the mass of the tokens better than it is < p (so the
    best token always stays)."""
    probs = (x - log_normaliser).exp()
    mass_before = probs.cumsum(dim=0) - probs
    return x.masked_fill(mass_before >= p, float("-inf"))


def _apply_penalties(row: torch.Tensor, state: _RequestState) -> None:
    """vLLM's apply_penalties for one row, in place and only on the tokens seen: repetition
    divides positive / multiplies negative logits of tokens in prompt or output; then
    frequency * count and presence * [count > 0] (output only) are subtracted (OpenAI's
    definition)."""
    spec = state.spec
    if spec.repetition_penalty != 1.0 and state.seen:
        ids = to_device(sorted(state.seen), torch.int64, row.device)
        values = row[ids]
        penalty = spec.repetition_penalty
        # a tiny penalty overflows a positive logit to inf, and inf - inf is NaN in the softmax
        limit = torch.finfo(row.dtype).max
        row[ids] = torch.where(values > 0, values / penalty, values * penalty).clamp(-limit, limit)
    if state.output_counts and (spec.frequency_penalty != 0.0 or spec.presence_penalty != 0.0):
        ids = to_device(list(state.output_counts), torch.int64, row.device)
        counts = to_device(list(state.output_counts.values()), row.dtype, row.device)
        row[ids] -= spec.frequency_penalty * counts + spec.presence_penalty

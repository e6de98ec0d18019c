"""One rank's model work: keeps each live request's slot, blocks and position, turns a
unified step's items into a StepBatch, runs the model, samples on rank 0.

Knows nothing of sockets or of the protocol around it: the rank process calls `run_step`,
`drop` and `snapshot` with plain data.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import partial

import torch

from deltaserve.engine.checkpoint_files import CheckpointError
from deltaserve.engine.model_config import ModelConfig
from deltaserve.engine.rank.batch import SeqSpan, StepBatch, StepPlan
from deltaserve.engine.rank.cache import StateCache
from deltaserve.engine.rank.cudagraph import DecodeGraphs
from deltaserve.engine.rank.draft_graphs import DraftGraphs
from deltaserve.engine.rank.grammar_mask import load_tokenizer
from deltaserve.engine.rank.loader import load_weights
from deltaserve.engine.rank.memory_budget import size_kv_cache, warm_up
from deltaserve.engine.rank.mtp import MultiTokenPredictor, mtp_rows
from deltaserve.engine.rank.parallel import broadcast, tp_rank, tp_size
from deltaserve.engine.rank.prompt_graphs import (
    MIN_BUCKET,
    PROMPT_GRAPH_SEQS,
    PromptGraphs,
    capturable,
    prefix_graph_keys,
)
from deltaserve.engine.rank.prompt_logprobs import prompt_logprobs as compute_prompt_logprobs
from deltaserve.engine.rank.prompt_logprobs import prompt_rows
from deltaserve.engine.rank.qwen3_5 import Qwen3_5ForCausalLM
from deltaserve.engine.rank.sampler import SampleLaunch, Sampler
from deltaserve.engine.rank.sleep_mode import Asleep, release_memory, restore_memory
from deltaserve.engine.rank.speculative import SpecResult, Speculator, speculates
from deltaserve.engine.rank.step_meta import with_step_meta
from deltaserve.engine.rank.transfer import to_device
from deltaserve.engine.rank.verify_graphs import VerifyGraphs, verify_capturable
from deltaserve.engine.rank.vision_inputs import MediaError, RankVision, RequestVision
from deltaserve.engine.vision_config import VisionConfig
from deltaserve.ipc.messages import (
    MAMBA_SSM_CACHE_DTYPES,
    ExecutorConfig,
    PromptLogprobs,
    Sample,
    SaveOnDrop,
    SpecOutcome,
    StepItem,
)
from deltaserve.kernels.kv_quant import FP8
from deltaserve.kernels.triton_compat import gpu_path, report_late_compiles

log = logging.getLogger("deltaserve.rank")

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
# what the DeltaNet states may be kept in: --mamba-ssm-cache-dtype's, but auto (vLLM's)
STATE_DTYPES = tuple(name for name in MAMBA_SSM_CACHE_DTYPES if name != "auto")
KV_DTYPES = {"auto": None, "fp8": FP8, "fp8_e4m3": FP8}  # --kv-cache-dtype's; None: the model's


class StepError(ValueError):
    """A step this rank cannot run as asked: its own state disagrees with the command."""


def item_length(item: StepItem) -> int:
    """Positions the item advances: its tokens, or one (its request's last sample)."""
    return len(item.token_ids) or 1


def resolve_dtype(name: str, device: torch.device, config: ModelConfig) -> torch.dtype:
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        name = config.torch_dtype
        if name not in DTYPES:
            raise ValueError(
                f"config.json's torch_dtype {name!r} is not one we run; pass a dtype, "
                f"one of {', '.join(DTYPES)}"
            )
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_state_dtype(name: str, config: ModelConfig) -> torch.dtype:
    """The DeltaNet recurrent state's dtype: --mamba-ssm-cache-dtype, auto being the
    checkpoint's `mamba_ssm_dtype` (float32 when it names none), on every device."""
    if name == "auto":
        name = config.mamba_ssm_dtype
    if name not in STATE_DTYPES:
        raise ValueError(
            f"mamba_ssm_cache_dtype {name!r} is not one of auto, {', '.join(STATE_DTYPES)}"
        )
    return DTYPES[name]


@dataclass(slots=True)
class LiveRequest:
    """A request this rank holds state for. Invariant: positions 0 .. num_tokens-1 are in the
    cache; the next item must start at num_tokens."""

    slot: int
    blocks: list[int]
    block_table: torch.Tensor
    num_tokens: int = 0
    prompt_done: bool = False  # its last prompt chunk has run; later items are decode inputs
    sampled_through: int = 0  # num_tokens after its last item that sampled (every rank)
    vision: RequestVision | None = None  # a prompt with images: spans, pending embeddings

    def kv_row(self, position: int, block_size: int) -> int:
        """The paged-cache row of the request's `position`."""
        return self.blocks[position // block_size] * block_size + position % block_size


@dataclass(frozen=True, slots=True)
class SavedPrefix:
    """A prompt's state after `num_tokens` positions, in state slot `slot`; `blocks` hold
    those positions' keys and values (the last one partly, when not a multiple of the block
    size), held for it."""

    slot: int
    blocks: list[int]
    num_tokens: int


@dataclass(slots=True)
class RankSnapshot:
    request_ids: list[int]
    slots_used: int
    blocks_used: int
    num_slots: int
    num_blocks: int
    state_heads: int
    kv_heads: int


@dataclass(slots=True)
class LaunchedStep:
    """A step whose device work is queued: the forward, then on rank 0 the sampling and the
    copy of its samples to the host (`launch_sampling`). `finish_step` waits for them."""

    items: list[StepItem]
    logits: torch.Tensor | None = None  # rank 0: the rows of the items that sample
    sampling: SampleLaunch | None = None
    done: torch.cuda.Event | None = None  # off rank 0 (CUDA): recorded after the forward
    # rank 0: the prompt logprobs its chunks asked for (already on the host)
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)
    # rank 0: a step that verified or drafted (speculative.py), sampled with its forward
    speculated: SpecResult | None = None

    @property
    def failed(self) -> dict[int, str]:
        """Rank 0: the requests its sampling found past their own bounds (SampleColumns')."""
        if self.speculated is not None:
            return self.speculated.failed
        return {} if self.sampling is None else self.sampling.failed

    @property
    def speculative(self) -> dict[int, SpecOutcome]:
        """Rank 0: the outcomes of the items that verified or drafted (SampleColumns')."""
        return {} if self.speculated is None else self.speculated.outcomes

    def ready(self) -> bool:
        """Whether the device has finished it (a poll; never waits)."""
        if self.sampling is not None:
            return self.sampling.ready()
        return self.done is None or self.done.query()


class Executor:
    def __init__(self, config: ExecutorConfig) -> None:
        if config.tp_size != tp_size() or config.rank != tp_rank():
            raise ValueError(
                f"executor for rank {config.rank} of {config.tp_size}, but torch.distributed "
                f"says rank {tp_rank()} of {tp_size()}"
            )
        self.config = config
        self.device = torch.device(config.device)
        self.model_config = ModelConfig.from_model_dir(config.model)
        self.model_config.check_tp_size(config.tp_size)
        self.dtype = resolve_dtype(config.dtype, self.device, self.model_config)
        self.state_dtype = resolve_state_dtype(config.mamba_ssm_cache_dtype, self.model_config)
        self.kv_dtype = KV_DTYPES[config.kv_cache_dtype] or self.dtype
        self.kv_scales_pending = False  # not while profiling: set once the cache is made
        self.speculator: Speculator | None = None  # likewise: it needs the cache
        started = time.monotonic()
        mtp = (
            MultiTokenPredictor(self.model_config, self.dtype, self.device) if config.mtp else None
        )
        self.model = Qwen3_5ForCausalLM(self.model_config, self.dtype, self.device, mtp)
        kept = load_weights(self.model, config.model, self.model_config, config.keep_fp8)
        log.info(
            "rank %d: weights loaded in %.1f s%s",
            config.rank,
            time.monotonic() - started,
            f"; {kept} projections kept FP8" if kept else "",
        )
        vision_config = VisionConfig.from_model_dir(config.model)
        self.vision = (
            None
            if vision_config is None
            else RankVision(config.model, vision_config, self.model_config, self.dtype, self.device)
        )
        self.sampler = (
            Sampler(partial(load_tokenizer, config.model, self.model_config.vocab_size))
            if config.rank == 0
            else None
        )
        self.requests: dict[int, LiveRequest] = {}
        self.prefixes: dict[int, SavedPrefix] = {}  # saved prefix id -> its state and blocks
        self.graphs: DecodeGraphs | None = None
        self.prompt_graphs: PromptGraphs | None = None
        self.verify_graphs: VerifyGraphs | None = None
        num_blocks = config.num_kv_blocks
        if num_blocks is None:  # profiles a step through run_step, then budgets (ranks agree)
            num_blocks = size_kv_cache(self).num_blocks
        elif self.device.type == "cuda":
            warm_up(self)  # the same steps, for their kernels' compiles
        self.cache = StateCache(
            self.model_config,
            config.max_num_seqs,
            num_blocks,
            config.block_size,
            config.tp_size,
            self.dtype,
            self.device,
            config.prefix_cache_states,
            mtp=config.mtp,
            state_dtype=self.state_dtype,
            kv_dtype=self.kv_dtype,
        )
        self.speculator = (
            Speculator(
                self.model,
                self.cache,
                self.sampler,
                self.device,
                config.speculative_config.draft_vocab(self.model_config.vocab_size),
            )
            if config.mtp
            else None
        )
        # --calculate-kv-scales: the first step with a new request's prompt sets them
        self.kv_scales_pending = config.calculate_kv_scales and self.kv_dtype == FP8
        self.asleep: Asleep | None = None  # sleep mode: what this rank gave back
        self._capture_graphs()

    def _capture_graphs(self) -> None:
        """The prompt and decode CUDA graphs over the model and cache as they are (start-up, and
        a wake-up from sleep mode: the cache's memory is new)."""
        config = self.config
        # CUDA (or the Triton interpreter, in tests)
        if not config.enforce_eager and gpu_path(self.cache.kv):
            started = time.monotonic()
            reserved = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
            if (size := self.prompt_graph_size()) is not None:
                keys = prefix_graph_keys(
                    config.prefix_cache_states,
                    config.max_model_len or self.cache.num_blocks * config.block_size,
                )
                self.prompt_graphs = PromptGraphs(
                    self.model,
                    self.cache,
                    *size,
                    prefix_keys=keys,
                    vision_axis=None if self.vision is None else self.vision.axis,
                )
                self.prompt_graphs.capture()
            max_len = config.max_model_len or self.cache.num_blocks * config.block_size
            self.graphs = DecodeGraphs(
                self.model, self.cache, config.max_num_seqs, self.cache.blocks_for(max_len)
            )
            if self.prompt_graphs is not None:  # one memory pool: no two graphs ever replay at once
                self.graphs.pool = self.prompt_graphs.pool
            self.graphs.capture()
            if self.speculator is not None:
                self._capture_speculative_graphs()
            held = (
                torch.cuda.memory_reserved(self.device) - reserved
                if self.device.type == "cuda"
                else 0
            )
            drafts = self.speculator.graphs if self.speculator is not None else None
            log.info(
                "rank %d: %d prompt, %d decode, %d draft and %d verify CUDA graphs captured in "
                "%.1f s, holding %.2f GiB",
                config.rank,
                len(self.prompt_graphs.graphs) if self.prompt_graphs else 0,
                len(self.graphs.graphs),
                len(drafts.graphs) if drafts else 0,
                len(self.verify_graphs.graphs) if self.verify_graphs else 0,
                time.monotonic() - started,
                held / 2**30,
            )

    def _capture_speculative_graphs(self) -> None:
        """The MTP head's draft loops per (bucket, k); verify steps and their rollback per
        (bucket, k) up to the batch that still speculates. In the decode graphs' pool (no two
        graphs ever replay at once) and over their block tables."""
        spec = self.config.speculative_config
        drafts = DraftGraphs(
            self.model,
            self.cache,
            self.graphs,
            spec.num_speculative_tokens,
            self.speculator.draft_vocab,
        )
        drafts.pool = self.graphs.pool
        drafts.capture()
        self.speculator.graphs = drafts
        if verify_capturable(self.device):
            self.verify_graphs = VerifyGraphs(
                self.model,
                self.cache,
                self.graphs,
                min(self.config.max_num_seqs, spec.off_at_batch),
                spec.num_speculative_tokens,
            )
            self.verify_graphs.pool = self.graphs.pool
            self.verify_graphs.capture()

    def prompt_graph_size(self) -> tuple[int, int] | None:
        """(tokens of the largest bucket, prompts per step) of the prompt graphs this executor
        captures, or None; the memory budget reserves for the same."""
        config = self.config
        tokens = min(config.prompt_graph_tokens, config.max_num_batched_tokens)
        if (
            config.enforce_eager
            or tokens < MIN_BUCKET
            or not capturable(self.model_config.head_dim, self.dtype, self.device)
        ):
            return None
        return tokens, min(PROMPT_GRAPH_SEQS, config.max_num_seqs)

    @property
    def num_slots(self) -> int:
        return self.cache.num_slots

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    def run_step(
        self, items: list[StepItem], drops: list[int] = (), evict: list[int] = ()
    ) -> list[Sample]:
        """Evict `evict`, drop `drops`, run the step, then sample on rank 0: one Sample per
        item with `sample`, in order."""
        step = self.launch_step(items, drops, evict)
        self.launch_sampling(step)
        return self.finish_step(step)

    def launch_step(
        self,
        items: list[StepItem],
        drops: list[int] = (),
        evict: list[int] = (),
        saves: list[SaveOnDrop] = (),
    ) -> LaunchedStep:
        """Evict `evict`, save and drop `drops` (`drop`) and queue the step's forward. The rank's
        serve loop queues step N+1 this way before it finishes N (`finish_step`), so the device
        never waits for the host between pipelined steps; N+1's items without tokens read N's
        samples on the device."""
        # the sampling, queued before the next step's replay, reads the graph's output in place
        step = LaunchedStep(items)
        step.logits = self.forward(
            items,
            drops=drops,
            graph_output=True,
            evict=evict,
            prompt_logprobs=step.prompt_logprobs,
            saves=saves,
        )
        if self.sampler is None and self.device.type == "cuda":
            step.done = torch.cuda.Event()
            step.done.record()
        return step

    def launch_sampling(self, step: LaunchedStep) -> None:
        """Rank 0: queue the step's sampling, after `finish_step` of the step before (its
        samples count in this one's seeds and penalties), and write the tokens to their
        slots' `last_tokens` on the device."""
        if self.sampler is not None:
            for item in step.items:
                req = self.requests[item.request_id]
                if not req.prompt_done:  # decode inputs are the rank's own samples, already seen
                    self.sampler.observe(item.request_id, item.token_ids, is_prompt=True)
                req.prompt_done = req.prompt_done or item.sample
        if self.speculator is not None and speculates(step.items):  # every rank: drafting
            step.speculated = self.speculator.sample(step.items, step.logits, self.requests)
            return
        if self.sampler is None:
            return
        sampled = [item.request_id for item in step.items if item.sample]
        slots = [self.requests[r].slot for r in sampled]
        step.sampling = self.sampler.launch(sampled, step.logits, slots, self.cache.last_tokens)

    def finish_step(self, step: LaunchedStep) -> list[Sample]:
        """Wait for the step's samples on the host (rank 0; [] elsewhere, at once)."""
        if step.speculated is not None:
            return step.speculated.samples
        return [] if step.sampling is None else self.sampler.finish(step.sampling)

    def forward(
        self,
        items: list[StepItem],
        every_position: bool = False,
        drops: list[int] = (),
        graph_output: bool = False,
        evict: list[int] = (),
        prompt_logprobs: dict[int, PromptLogprobs] | None = None,
        saves: list[SaveOnDrop] = (),
    ) -> torch.Tensor | None:
        """Evict `evict`, save and drop `drops` (`drop`), advance every item's request through the
        model, save the prefixes items ask for; return fp32 logits on rank 0 of the positions
        that sample (or of every position: golden tests), None elsewhere. `graph_output`: a
        decode graph's logits may be its output buffer, which the next replay overwrites (else
        they are copied out). Rank 0 puts the prompt logprobs items ask for into
        `prompt_logprobs`."""
        self._admit_new(items, drops, evict, saves)
        self._share_last_samples(items)
        if self.vision is not None and any(item.media for item in items):
            self.vision.encode(
                items, {i.request_id: self.requests[i.request_id].vision for i in items}
            )
        calibrates = self.kv_scales_pending and any(item.new is not None for item in items)
        self.cache.calibrating = calibrates  # eagerly: no graph holds the calibration
        singles = [item for item in items if len(item.token_ids) <= 1]
        if (
            not every_position
            and not calibrates
            and self._decode_graph_fits(singles)
            and (self.vision is None or not any(self._holds_vision(i) for i in singles))
        ):
            logits = self._run_with_graphs(items, singles, graph_output, prompt_logprobs)
        else:  # one forward of every item: a prompt graph's replay where they fit one
            logits = self._run_plan(items, every_position, prompt_logprobs)
        if calibrates:
            self.cache.calibrating = self.kv_scales_pending = False
        for item in items:
            req = self.requests[item.request_id]
            req.num_tokens = item.start + item_length(item)
            if item.sample:
                req.sampled_through = req.num_tokens
            if req.vision is not None:
                req.vision.release_through(req.num_tokens)
            if item.save >= 0:  # queued after the forward: the state of its positions so far
                self._save_prefix(item.save, req)
        return logits

    def _holds_vision(self, item: StepItem) -> bool:
        """Whether the item runs any of its request's image or video tokens (a single-token
        one then cannot replay a decode graph, which has no vision rows: a prompt chunk of one
        token, cut inside an image)."""
        vision = self.requests[item.request_id].vision
        end = item.start + item_length(item)
        return vision is not None and any(
            span.offset < end and item.start < span.end for span in vision.positions.spans
        )

    def _rope_position(self, item: StepItem) -> int:
        """A single-token item's rotary position: its index, shifted after images (mrope.py)."""
        vision = self.requests[item.request_id].vision
        return item.start if vision is None else vision.positions.text_position(item.start)

    def _save_prefix(self, prefix: int, req: LiveRequest) -> None:
        blocks = req.blocks[: self.cache.blocks_for(req.num_tokens)]
        self.cache.hold(blocks)
        slot = self.cache.num_slots + prefix
        self.cache.copy_state(req.slot, slot)
        self.prefixes[prefix] = SavedPrefix(slot, blocks, req.num_tokens)

    def _start_from_prefix(self, item: StepItem) -> tuple[list[int], SavedPrefix] | None:
        """The saved prefix a new item starts from (its full blocks, shared), or None."""
        if item.new.prefix < 0:
            return None
        saved = self.prefixes[item.new.prefix]
        return saved.blocks[: self._shared_blocks(saved.num_tokens)], saved

    def _shared_blocks(self, num_tokens: int) -> int:
        """Blocks a request starting from a saved prefix of `num_tokens` positions shares: the
        full ones, but with an MTP head not the one of its last position, whose head keys the
        request writes anew (they depend on its next token: mtp.py)."""
        return (num_tokens - (self.model.mtp is not None)) // self.cache.block_size

    def _share_last_samples(self, items: list[StepItem]) -> None:
        """Items without token_ids take their slot's last sample (`cache.last_tokens`),
        which rank 0's sampler wrote: at TP > 1 it sends them to the other ranks first (one
        small broadcast on the device, only in such a step)."""
        if tp_size() > 1 and any(not item.token_ids for item in items):
            broadcast(self.cache.last_tokens)

    def _eager_batch(self, batch: StepBatch) -> StepBatch:
        """On the GPU path, the batch with its index tensors made once for all layers."""
        return with_step_meta(batch, self.device) if gpu_path(batch.input_ids) else batch

    def _decode_graph_fits(self, singles: list[StepItem]) -> bool:
        """Whether a captured decode graph takes the step's single-token items: some, few
        enough, none asking for prompt logprobs (those come from a forward's hidden states,
        which a decode graph does not keep)."""
        if self.graphs is None or any(item.prompt_logprobs >= 0 for item in singles):
            return False
        num_blocks = max((len(self.requests[i.request_id].blocks) for i in singles), default=0)
        return self.graphs.can_run(len(singles), num_blocks)

    def _run_with_graphs(
        self,
        items: list[StepItem],
        singles: list[StepItem],
        graph_output: bool,
        prompt_logprobs: dict[int, PromptLogprobs] | None,
    ) -> torch.Tensor | None:
        """The single-token items (`singles`, which `_decode_graph_fits`) replay a decode CUDA
        graph; prompt chunks run in a forward of their own, a prompt graph's replay where they
        fit one (`_run_plan`). A mixed step so never makes its decodes pay Python's per-kernel
        launch cost (SGLang likewise keeps prefill and decode batches apart). The requests are
        disjoint, so order is free."""
        held = [self.requests[item.request_id] for item in singles]
        chunks = [item for item in items if len(item.token_ids) > 1]
        chunk_logits = self._run_plan(chunks, False, prompt_logprobs) if chunks else None
        decode_logits = self.graphs.run(
            [item.token_ids[0] if item.token_ids else -1 for item in singles],  # -1: last sample
            [item.start for item in singles],
            [r.slot for r in held],
            [
                r.kv_row(item.start, self.cache.block_size)
                for item, r in zip(singles, held, strict=True)
            ],
            [i for i, item in enumerate(singles) if item.sample],
            copy=not (graph_output or chunks),  # with chunks: copied into the merged rows below
            rope_positions=None
            if self.vision is None
            else [self._rope_position(item) for item in singles],
            head_kv_rows=self._head_kv_rows(singles, held),
        )
        if not chunks or decode_logits is None:  # decode-only, or not rank 0
            return decode_logits
        # rows of [decode samples | chunk samples] back into the items' order (a verify item,
        # a chunk, samples each of its rows)
        first_chunk_row = sum(item.sample for item in singles)
        order, next_row = [], [0, first_chunk_row]
        for item in items:
            if item.sample:
                kind = int(len(item.token_ids) > 1)
                rows = 1 + item.num_drafts
                order.extend(range(next_row[kind], next_row[kind] + rows))
                next_row[kind] += rows
        merged = torch.cat((decode_logits, chunk_logits))
        return merged[torch.tensor(order, device=merged.device)]

    def _head_kv_rows(self, singles: list[StepItem], held: list[LiveRequest]) -> list[int] | None:
        """With an MTP head: the KV row of each single-token item's head keys, at the position
        before its own (-1 at a prompt's first; mtp.py), which the decode graph's catch-up
        writes."""
        if self.model.mtp is None:
            return None
        bs = self.cache.block_size
        return [
            -1 if item.start == 0 else r.kv_row(item.start - 1, bs)
            for item, r in zip(singles, held, strict=True)
        ]

    def _run_plan(
        self,
        items: list[StepItem],
        every_position: bool,
        prompt_logprobs: dict[int, PromptLogprobs] | None,
    ) -> torch.Tensor | None:
        """`items` in one forward: a prompt graph's replay where they fit one (prompt chunks
        alone), else eagerly; then the lm_head over the rows whose prompt logprobs items ask
        for, from the same forward's hidden states (every rank: its vocabulary shard), into
        `prompt_logprobs` on rank 0."""
        plan = self._plan(items, every_position)
        wanted = prompt_rows(items, [span.offset for span in plan.spans])
        verify = None if every_position or wanted else self._verify_graphs_fit(plan)
        stash = None
        if self.speculator is not None:
            stash = self.speculator.begin(items, plan.spans, verify)
        if verify is not None:  # verify spans of one k: every row samples
            hidden = verify.run(plan)
            logits = self.model.output_embedding.logits(hidden)
        elif (
            self.prompt_graphs is not None
            and not every_position
            and not self.cache.calibrating
            and stash is None  # a verify span's state is not written (prompt graphs write it)
            and self.prompt_graphs.can_run(plan)
        ):
            hidden, logits = self.prompt_graphs.run(plan)
        else:
            batch = self._eager_batch(self._plan_batch(plan, stash))
            hidden = self.model.hidden_states(batch, self.cache)
            logits = self.model.logits(hidden, batch)
        if wanted:
            found = compute_prompt_logprobs(hidden, wanted, self.model.output_embedding)
            if prompt_logprobs is not None:
                prompt_logprobs.update(found)
        return logits

    def _verify_graphs_fit(self, plan: StepPlan) -> VerifyGraphs | None:
        """The verify graphs, where they take `plan` (verify spans of one k; not a step that
        calibrates FP8 scales), else None."""
        if self.verify_graphs is None or self.cache.calibrating:
            return None
        num_blocks = max((len(span.blocks) for span in plan.spans), default=0)
        return self.verify_graphs if self.verify_graphs.fits(plan, num_blocks) else None

    def _admit_new(
        self, items: list[StepItem], drops: list[int], evict: list[int], saves: list[SaveOnDrop]
    ) -> None:
        """Check every item, drop, save and eviction against this rank's state, then evict,
        save, drop and take slots for new requests; on any mismatch nothing is changed. Every
        rank holds the same state, so all of them reach the same verdict (none waits in a
        collective for another)."""
        self._check_step(items, drops, evict, saves)
        self._drop(drops, evict, saves)
        for item in items:
            if item.new is None:
                continue
            start = self._start_from_prefix(item)
            shared, saved = start if start is not None else ([], None)
            slot, blocks = self.cache.allocate(item.new.reserve_tokens, shared)
            if saved is not None:
                self.cache.copy_state(saved.slot, slot)
                if len(saved.blocks) > len(shared):  # its partly filled block: a copy of our own
                    self.cache.copy_block(saved.blocks[-1], blocks[len(shared)])
            live = LiveRequest(slot, blocks, self._block_table(slot, blocks), item.start)
            if self.vision is not None:
                live.vision = self.vision.new_request(item.new.vision_spans)
            self.requests[item.request_id] = live
            if self.sampler is not None:
                self.sampler.add(item.request_id, item.new.sampling, item.new.output_ids)
        for item in items:
            if item.grow:
                live = self.requests[item.request_id]
                live.blocks += self.cache.take_blocks(item.grow)
                live.block_table = self._block_table(live.slot, live.blocks)

    def _block_table(self, slot: int, blocks: list[int]) -> torch.Tensor:
        """The blocks as a device tensor, and the decode graphs' table of the slot, both
        queued behind the steps ahead (an overlapped step may still read the old ones)."""
        table = to_device(blocks, torch.int64, self.device)
        if self.graphs is not None and len(blocks) <= self.graphs.max_blocks:
            self.graphs.set_table(slot, table)
        return table

    def _check_step(
        self, items: list[StepItem], drops: list[int], evict: list[int], saves: list[SaveOnDrop]
    ) -> None:
        new_blocks = 0
        new_count = 0
        rank = self.config.rank
        for request_id in drops:
            if request_id not in self.requests:
                raise StepError(f"request {request_id} to drop is not held by rank {rank}")
        self._check_saves([item.save for item in items if item.save >= 0], evict, saves)
        self._check_media(items)
        bs = self.cache.block_size
        for item in items:
            held = self.requests.get(item.request_id)
            end = item.start + item_length(item)
            reach = end + max(0, item.propose - 1)
            if item.new is not None:
                if held is not None or item.grow:
                    raise StepError(f"request {item.request_id} is new but already held, or grows")
                start = 0
                if item.new.prefix >= 0:
                    saved = self.prefixes.get(item.new.prefix)
                    if saved is None or item.new.prefix in evict:
                        raise StepError(
                            f"request {item.request_id} starts from saved prefix "
                            f"{item.new.prefix}, which rank {rank} does not hold"
                        )
                    start = saved.num_tokens
                    new_blocks -= self._shared_blocks(saved.num_tokens)
                if item.start != start:
                    raise StepError(
                        f"new request {item.request_id} starts at {item.start}, not {start}"
                    )
                if item.new.reserve_tokens < item.start + len(item.token_ids):
                    raise StepError(
                        f"request {item.request_id} reserves fewer tokens than its chunk"
                    )
                new_blocks += self.cache.blocks_for(item.new.reserve_tokens)
                new_count += 1
            elif held is None:
                raise StepError(f"request {item.request_id} is not held by rank {rank}")
            elif item.start != held.num_tokens:
                raise StepError(
                    f"request {item.request_id} item starts at {item.start}, rank {rank} "
                    f"holds {held.num_tokens} positions"
                )
            elif not (
                # its blocks, with those it adds, hold its positions and its drafts' head rows
                # (speculative.py: up to end + propose - 2); an addition is all needed
                reach <= (len(held.blocks) + item.grow) * bs
                and (not item.grow or reach > (len(held.blocks) + item.grow - 1) * bs)
            ):
                raise StepError(
                    f"request {item.request_id} runs through position {reach - 1} with "
                    f"{len(held.blocks)} blocks of {bs} and {item.grow} more"
                )
            elif not item.token_ids and held.sampled_through != item.start:
                raise StepError(
                    f"request {item.request_id} item has no token_ids, but its previous item "
                    f"did not sample"
                )
            new_blocks += item.grow
        freed = self._blocks_freed(evict)
        if new_count > self.cache.free_slots or new_blocks > self.cache.free_blocks + freed:
            raise StepError(
                f"step needs {new_count} slots and {new_blocks} blocks; rank {rank} has "
                f"{self.cache.free_slots} slots and {self.cache.free_blocks} blocks free"
            )

    def _check_media(self, items: list[StepItem]) -> None:
        """Every item's vision spans and media fit the request and this rank's tower."""
        fresh: set[bytes] = set()
        for item in items:
            spans = item.new.vision_spans if item.new is not None else []
            if not spans and not item.media:
                continue
            if self.vision is None:
                raise StepError(
                    f"request {item.request_id} has images; the model has no vision tower"
                )
            try:
                held = self.requests.get(item.request_id)
                vision = (
                    self.vision.new_request(spans) if item.new is not None else held and held.vision
                )
                for media in item.media:
                    self.vision.check(media, vision, fresh)
            except MediaError as e:
                raise StepError(f"request {item.request_id}: {e}") from None

    def _blocks_freed(self, evict: list[int]) -> int:
        """Blocks that evicting `evict` frees: those nothing else holds."""
        refs: dict[int, int] = {}
        for prefix in evict:
            for b in self.prefixes[prefix].blocks:
                refs[b] = refs.get(b, 0) + 1
        return sum(self.cache.refs(b) == n for b, n in refs.items())

    def _plan(self, items: list[StepItem], every_position: bool) -> StepPlan:
        plan = StepPlan()
        offset = 0
        bs = self.cache.block_size
        for item in items:
            req = self.requests[item.request_id]
            length = item_length(item)
            plan.spans.append(
                SeqSpan(
                    offset,
                    length,
                    item.start,
                    req.slot,
                    req.block_table,
                    req.blocks,
                    verify=item.num_drafts > 0,
                )
            )
            plan.ids.extend(item.token_ids or [-1])
            if not item.token_ids:
                plan.last_sample_rows.append(offset)
                plan.last_sample_slots.append(req.slot)
            positions = range(item.start, item.start + length)
            if self.vision is None:
                plan.positions.extend(positions)
            else:  # rotary positions shifted after images; vision rows and their embeddings
                try:
                    self.vision.add_rows(plan, req.vision, item.start, length, offset)
                except MediaError as e:
                    raise StepError(f"request {item.request_id}: {e}") from None
            plan.kv_rows.extend(req.kv_row(p, bs) for p in positions)
            if every_position:
                plan.sampled.extend(range(offset, offset + length))
            elif item.sample:  # a verify item: its last sample's row and each draft's
                plan.sampled.extend(range(offset + length - 1 - item.num_drafts, offset + length))
            offset += length
        return plan

    def _build_batch(self, items: list[StepItem], every_position: bool) -> StepBatch:
        return self._plan_batch(self._plan(items, every_position))

    def _plan_batch(self, plan: StepPlan, stash: object | None = None) -> StepBatch:
        ids, positions, kv_index, logits_index = (
            to_device(values, torch.int64, self.device)
            for values in (plan.ids, plan.positions, plan.kv_rows, plan.sampled)
        )
        if plan.last_sample_rows:  # the slots' last samples, read on the device
            slots = to_device(plan.last_sample_slots, torch.int64, self.device)
            ids[to_device(plan.last_sample_rows, torch.int64, self.device)] = (
                self.cache.last_tokens[slots]
            )
        vision = None if self.vision is None else self.vision.step_vision(plan)
        mtp = None
        if self.model.mtp is not None:  # the MTP head's keys and values of the step's rows
            mtp = mtp_rows(plan, self.cache.block_size, self.device)
        return StepBatch(
            ids,
            positions,
            kv_index,
            tuple(plan.spans),
            logits_index,
            vision=vision,
            mtp=mtp,
            stash=stash,
        )

    def _check_saves(self, prefixes: list[int], evict: list[int], saves: list[SaveOnDrop]) -> None:
        """`evict` are held; the prefixes saved (`prefixes` by items, `saves` as requests are
        dropped) are free once `evict` is, each once; a state saved as it is dropped covers
        the positions the scheduler counts."""
        rank = self.config.rank
        for prefix in evict:
            if prefix not in self.prefixes:
                raise StepError(f"saved prefix {prefix} to evict is not held by rank {rank}")
        prefixes = [*prefixes, *(save.prefix for save in saves)]
        for prefix in prefixes:
            if not prefix < self.cache.num_prefix_states or (
                prefix in self.prefixes and prefix not in evict
            ):
                raise StepError(f"saved prefix {prefix} is not free on rank {rank}")
        if len(set(prefixes)) != len(prefixes):
            raise StepError("two states are saved as the same prefix")
        for save in saves:
            held = self.requests.get(save.request_id)
            if held is None or held.num_tokens != save.num_tokens:
                raise StepError(
                    f"request {save.request_id} is saved at {save.num_tokens} positions; "
                    f"rank {rank} holds {held.num_tokens if held else 'none'}"
                )

    def drop(
        self, request_ids: list[int], evict: list[int] = (), saves: list[SaveOnDrop] = ()
    ) -> list[bool]:
        """Evict `evict`, keep the states `saves` names as saved prefixes, then free the
        states of `request_ids`; one flag per id: whether this rank held it."""
        self._check_saves([], evict, saves)
        return self._drop(request_ids, evict, saves)

    def _drop(
        self, request_ids: list[int], evict: list[int], saves: list[SaveOnDrop]
    ) -> list[bool]:
        for prefix in evict:
            self.cache.release(self.prefixes.pop(prefix).blocks)
        for save in saves:
            self._save_prefix(save.prefix, self.requests[save.request_id])
        existed = []
        for request_id in request_ids:
            req = self.requests.pop(request_id, None)
            existed.append(req is not None)
            if req is not None:
                self.cache.free(req.slot, req.blocks)
                if self.sampler is not None:
                    self.sampler.remove(request_id)
        return existed

    def load_weights(self, model_dir: str) -> None:
        """The same model's new weights (an RL trainer's checkpoint), copied into the
        parameters in place: CUDA graphs replay them as captured."""
        if differences := self.model_config.differences(ModelConfig.from_model_dir(model_dir)):
            raise CheckpointError(
                f"{model_dir}: not the served model's config.json ({', '.join(differences)})"
            )
        started = time.monotonic()
        load_weights(self.model, model_dir, self.model_config, self.config.keep_fp8, confined=True)
        log.info(
            "rank %d: weights loaded from %s in %.1f s",
            self.config.rank,
            model_dir,
            time.monotonic() - started,
        )

    def sleep(self, level: int) -> None:
        """Sleep mode: give the device memory of the weights and the cache back, between
        requests (engine/rank/sleep_mode.py)."""
        if self.requests or self.prefixes or self.asleep is not None:
            raise RuntimeError(
                f"sleep with {len(self.requests)} requests and {len(self.prefixes)} saved prefixes "
                f"held{', already asleep' if self.asleep is not None else ''}"
            )
        self.graphs = self.prompt_graphs = self.verify_graphs = None  # their pool, the cache's
        if self.speculator is not None:
            self.speculator.graphs = None
        self.asleep = release_memory(self.model, self.cache, level)
        log.info("rank %d: asleep (level %d)", self.config.rank, level)

    def wake_up(self, tags: list[str]) -> None:
        """Take back what sleep gave (`tags`: "weights", "kv_cache"); once both are back, the
        CUDA graphs are captured again."""
        if self.asleep is None:
            raise RuntimeError("wake_up while awake")
        if restore_memory(self.model, self.cache, self.asleep, tags):
            self.asleep = None
            self._capture_graphs()
            log.info("rank %d: awake", self.config.rank)

    def watch_late_compiles(self) -> None:
        """Once start-up is done: log each Triton kernel first compiled from now on, a shape the
        warm-up missed (CUDA; kernels/triton_compat.py)."""
        if self.device.type == "cuda":
            report_late_compiles(log, self.config.rank)

    def snapshot(self) -> RankSnapshot:
        return RankSnapshot(
            request_ids=sorted(self.requests),
            slots_used=self.cache.num_slots - self.cache.free_slots,
            blocks_used=self.cache.num_blocks - self.cache.free_blocks,
            num_slots=self.cache.num_slots,
            num_blocks=self.cache.num_blocks,
            state_heads=self.cache.state_heads,
            kv_heads=self.cache.kv_heads,
        )

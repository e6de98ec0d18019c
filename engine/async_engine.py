"""AsyncEngine: the public asyncio API over one replica.

`generate` validates and tokenizes synchronously (bad input raises at once, naming the
problem), assigns engine RequestIds (never reused) and seeds, and hands the choices to the
scheduler tick, which owns all request state from then on (engine/scheduler.py). Params with
a structured-output constraint or stop regexes are compiled first, off the event loop:
`params = await engine.prepare(params)` (engine/guides.py); `generate` refuses them otherwise.
Tokenizing a large text takes seconds (~1 s per MiB): `await engine.encode(text)` (or
`run_tokenizer`, e.g. for a chat template) does it in a worker thread, off the event loop,
and `generate` then takes the ids. The HTTP server always goes that way.

With `monitor_endpoint` set ("auto", ipc://PATH or tcp://HOST:PORT) the engine binds a
monitor publisher (engine/monitor.py, docs/MONITOR.md) before loading anything; unset, it
publishes nothing (`deltaserve serve` sets "auto").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from deltaserve.engine.config import EngineConfig, EngineLimits, replica_config, resolve_limits
from deltaserve.engine.events import (
    EngineDeadError,
    LoadSnapshot,
    NoWeightsError,
    QueueFullError,
)
from deltaserve.engine.grammar_worker import Setup
from deltaserve.engine.guides import Guides
from deltaserve.engine.kv_event_publisher import KVEventPublisher
from deltaserve.engine.kv_events import BlockEvents
from deltaserve.engine.maintenance import PAUSE_MODES, Kind, PauseMode
from deltaserve.engine.media import MediaError, MediaFetcher, MediaProcessor, MediaSource
from deltaserve.engine.media_prompt import MultimodalPrompt
from deltaserve.engine.metrics import EngineMetrics
from deltaserve.engine.model_config import ModelConfig
from deltaserve.engine.monitor import MonitorPublisher
from deltaserve.engine.planner import StepBudget, max_medium_patches, medium_start_cost
from deltaserve.engine.request import Request
from deltaserve.engine.sampling_params import ParamError, SamplingParams, wire_seed
from deltaserve.engine.scheduler import Scheduler
from deltaserve.engine.stream import EventSink, RequestStream
from deltaserve.engine.tick_records import Submission
from deltaserve.engine.tokenizer import (
    INLINE_TOKENIZE_CHARS,
    TokenizerWorker,
    eos_token_ids,
    load_tokenizer,
)
from deltaserve.engine.vision_config import VisionConfig
from deltaserve.ipc.controller import ReplicaController
from deltaserve.ipc.messages import SLEEP_TAGS, SnapshotReply

T = TypeVar("T")


class AsyncEngine:
    """Start with `await AsyncEngine.start(config)` (or `async with`), stop with `shutdown`.
    One replica of the model; `config.data_parallel_size` replicas are a DataParallelEngine
    (engine/interface.py `start_engine` starts either)."""

    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, limits: EngineLimits, replica: int
    ) -> None:
        """Holds the parts; `start` is the way in (it also launches the replica)."""
        self.config = config
        self.replica = replica  # which of the config's data-parallel replicas this is
        self.model_config = model_config
        self.tokenizer: Any = None  # loaded while the ranks start (`_launch`)
        self._limits = limits
        self.max_model_len = limits.max_model_len
        # a request's logprobs and prompt_logprobs at most (--max-logprobs, -1 resolved)
        self.max_logprobs = limits.max_logprobs
        self._media: MediaProcessor | None = None  # the checkpoint's processor, on first use
        self.eos_token_ids = eos_token_ids(config.model, model_config)
        self._next_request_id = itertools.count(1)
        self._streams: dict[str, EventSink] = {}  # client request id -> unresolved sink
        self._shutting_down = False
        self._shutdowns: set[asyncio.Task] = set()  # shutdown calls' tasks, until done
        self._controller: ReplicaController | None = None
        self._scheduler: Scheduler | None = None
        self._task: asyncio.Task | None = None
        self._monitor: MonitorPublisher | None = None
        self._kv_events: KVEventPublisher | None = None  # --kv-events-config
        # loads the tokenizer (`start`) and tokenizes large inputs; the loop uses the same instance
        self._tokenizer_worker = TokenizerWorker(functools.partial(load_tokenizer, config.model))
        self._think_end_id: int | None = None  # the tokenizer's </think> (a thinking budget's end)
        self._guides: Guides | None = None  # structured outputs' compiles: made when first needed
        self.weights_dir = config.model  # where the weights served came from (update_weights)

    @classmethod
    async def start(cls, config: EngineConfig, replica: int | None = None) -> AsyncEngine:
        """The engine of `config`, started; or of its replica `replica` (DataParallelEngine
        starts each), which `config.data_parallel_size` > 1 needs."""
        if replica is None:
            if config.data_parallel_size > 1:
                raise ValueError(
                    f"data_parallel_size {config.data_parallel_size}: start a "
                    "DataParallelEngine (engine/interface.py start_engine starts either)"
                )
            replica = 0
        t0 = time.monotonic()
        model_config = ModelConfig.from_model_dir(config.model)
        model_config.check_tp_size(config.tp_size)
        if config.speculative_config is not None:
            model_config.check_mtp_head()
            config.speculative_config.draft_vocab(model_config.vocab_size)  # refused by name
        limits = resolve_limits(config, model_config)
        monitor = None
        if config.monitor_endpoint is not None:
            monitor = MonitorPublisher(config.monitor_endpoint)  # "starting" from now on
        self = None
        try:
            self = cls(config, model_config, limits, replica)
            # the tokenizer loads in its thread while the ranks start
            self._tokenizer_worker.start()
            self._monitor = monitor
            events = config.kv_events_config
            if events is not None and events.publishes:
                self._kv_events = KVEventPublisher(events.for_replica(replica), replica)
            await self._launch()
        except BaseException as exc:
            if self is not None:
                self._tokenizer_worker.close()
                if self._kv_events is not None:
                    await self._kv_events.aclose()
            if monitor is not None:
                monitor.failed_to_start(f"start failed: {exc!r}")
                await monitor.aclose()
            raise
        if monitor is not None:
            c = self._controller
            monitor.ready(
                model=config.model,
                tp_size=config.tp_size,
                device=config.device,
                num_slots=c.num_slots,
                num_blocks=c.num_blocks,
                block_size=c.block_size,
                max_model_len=self.max_model_len,
                startup_s=time.monotonic() - t0,
            )
        return self

    async def _launch(self) -> None:
        """Start the replica, then take the tokenizer loaded meanwhile. Without num_kv_blocks
        on CUDA each rank sizes its KV cache from gpu_memory_utilization and the ranks agree
        on the smallest (their Ready says)."""
        config = self.config
        replica = replica_config(config, self._limits, self.replica)
        # The controller's poison callback is routed through the engine: the scheduler that
        # handles it needs the started controller.
        self._controller = await ReplicaController.start(replica, on_poison=self._on_poison)
        try:
            self.tokenizer = await self._tokenizer_worker.tokenizer()
            self._think_end_id = _token_id(self.tokenizer, "</think>")
            self._scheduler = Scheduler(
                self._controller,
                self.tokenizer,
                self.eos_token_ids,
                StepBudget(config.max_num_batched_tokens, config.max_num_seqs),
                self.max_model_len,
                force_mixed=config.force_mixed_steps,
                pipeline=config.async_scheduling,
                prefix_states=replica.executor.prefix_cache_states,
                by_priority=config.scheduling_policy == "priority",
                speculative=config.speculative_config,
                kv_watermark=config.kv_watermark,
                reserve_lifetime=config.reserve_lifetime,
            )
        except BaseException:
            await self._controller.shutdown()
            raise
        if self._monitor is not None:
            self._monitor.attach(self._scheduler)
        if self._kv_events is not None:
            self._scheduler.prefix.events = BlockEvents(
                self._controller.block_size, self._kv_events.publish
            )
        if self._controller.poison_reason is not None:
            self._scheduler.on_poison(self._controller.poison_reason)
        self._task = asyncio.get_running_loop().create_task(
            self._scheduler.run(), name="deltaserve-scheduler"
        )

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    def _on_poison(self, reason: str) -> None:
        if self._scheduler is not None:
            self._scheduler.on_poison(reason)

    # ---- state ------------------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self._scheduler.dead_reason is not None

    @property
    def dead_reason(self) -> str | None:
        return self._scheduler.dead_reason

    @property
    def metrics(self) -> EngineMetrics:
        return self._scheduler.metrics

    @property
    def longest_sequence(self) -> int:
        """The most positions (prompt and output) one sequence can ever hold: max_model_len, or
        fewer where the KV cache given (num_kv_blocks) holds fewer. A chat's default max_tokens
        is what this leaves after its prompt."""
        ledger = self._scheduler.ledger
        return min(self.max_model_len, ledger.num_blocks * ledger.block_size)

    @property
    def max_queued_requests(self) -> int:
        """The most choices that may wait at once (--max-queued-requests)."""
        return self.config.max_queued_requests

    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    async def wait_closed(self) -> None:
        """Return once the engine has stopped: after `shutdown`, or after failing closed
        (every owner told, replica torn down, no rank process left)."""
        await asyncio.shield(self._task)
        if self._shutdowns:
            await asyncio.wait(set(self._shutdowns))

    @property
    def kv_events_endpoints(self) -> tuple[str, str | None] | None:
        """Where KV-event subscribers connect (PUB) and ask for replays (ROUTER, or None);
        None without --kv-events-config."""
        if self._kv_events is None:
            return None
        return self._kv_events.endpoint, self._kv_events.replay_endpoint

    @property
    def monitor_endpoint(self) -> str | None:
        """Where monitors connect (`deltaserve monitor ENDPOINT`); None without a publisher."""
        return None if self._monitor is None else self._monitor.endpoint

    @property
    def rank_pids(self) -> list[int]:
        """Process ids of the replica's ranks (operations, and tests that kill one)."""
        return self._controller.rank_pids

    def load(self) -> LoadSnapshot:
        return self._scheduler.load()

    def replica_loads(self) -> list[LoadSnapshot]:
        """Each data-parallel replica's load (one here; engine/data_parallel.py has several)."""
        return [self.load()]

    async def rank_snapshots(self) -> list[SnapshotReply]:
        self._check_alive()
        return await self._controller.snapshot()

    def _check_alive(self) -> None:
        if self._scheduler.dead_reason is not None:
            raise EngineDeadError(f"engine is dead: {self._scheduler.dead_reason}")
        if self._shutting_down:
            raise EngineDeadError("engine is shut down")

    def _check_weights(self) -> None:
        if self.weights_dropped:
            raise NoWeightsError(
                "no weights loaded: a level-2 sleep discarded them; load new ones "
                "(update_weights) before generating"
            )

    # ---- tokenization -----------------------------------------------------------------------

    async def run_tokenizer(self, fn: Callable[[Any], T], size: int) -> T:
        """`fn(tokenizer)`: on the event loop when `size` (characters of input) is small,
        else in the tokenizer worker thread (the same tokenizer instance),
        so that the loop, the scheduler tick and the HTTP server keep running meanwhile.
        Raises EngineDeadError once the engine is dead or shut down."""
        self._check_alive()
        if size <= INLINE_TOKENIZE_CHARS:
            return fn(self.tokenizer)
        return await self._tokenizer_worker.run(fn)

    async def media_prompt(self, text: str, sources: list[MediaSource]) -> MultimodalPrompt:
        """A rendered chat prompt whose template placed `sources` (images and videos, in
        order) as token ids and media: fetched here, decoded and preprocessed off the event
        loop by the checkpoint's processor (engine/media.py); MediaError (a ValueError)
        names the part it refuses."""
        vision = VisionConfig.from_model_dir(self.config.model)
        if vision is None:
            raise MediaError(
                f"{sources[0].part}: the model {self.config.model} has no vision tower"
            )
        if self._media is None:
            self._media = MediaProcessor(
                self.config.model,
                self.tokenizer,
                vision,
                self.config.media,
                self._media_dtype(),
                max_patches=max_medium_patches(self.config.max_num_batched_tokens),
            )
        processor = self._media
        processor.check_counts(
            sum(s.kind == "image" for s in sources), sum(s.kind == "video" for s in sources)
        )
        fetcher = MediaFetcher(self.config.media)
        loaded = [(source, await fetcher.fetch(source.url, source.part)) for source in sources]
        prompt = await self.run_tokenizer(
            lambda _: processor.prompt(text, loaded), INLINE_TOKENIZE_CHARS + 1
        )
        self._check_media_fit(prompt, [source.part for source in sources])  # in prompt order
        return prompt

    def _check_media_fit(self, prompt: MultimodalPrompt, names: list[str]) -> None:
        """Each medium one step can start (engine/planner.py), or a MediaError naming it."""
        budget = self.config.max_num_batched_tokens
        for name, item in zip(names, prompt.media, strict=True):
            if medium_start_cost(item.num_patches) > budget:
                raise MediaError(
                    f"{name}: {item.num_patches} patches and its first token, more than a step "
                    f"encodes (max_num_batched_tokens {budget}); send it smaller or lower "
                    "max_pixels"
                )

    def _media_dtype(self) -> str:
        """The dtype pixels travel in: the model's (the tower casts them to it anyway)."""
        if self.config.device == "cpu" and self.config.dtype == "auto":
            return "float32"
        name = self.config.dtype if self.config.dtype != "auto" else self.model_config.torch_dtype
        return {"fp32": "float32", "bf16": "bfloat16"}.get(name, name)

    async def encode(self, text: str) -> list[int]:
        """The token ids `generate(text, ...)` would use, without blocking the event loop on
        a large text; pass them to `generate`."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        return await self.run_tokenizer(lambda tok: _encode_text(tok, text), len(text))

    # ---- requests ---------------------------------------------------------------------------

    async def prepare(self, params: SamplingParams) -> SamplingParams:
        """`params` ready for `generate`: their structured-output constraint and stop regexes
        compiled in the compile worker, off the event loop, each text once (failures too;
        engine/guides.py). Raises ValueError naming the field and the bound or the error,
        and EngineDeadError; params with nothing to compile come back as they are."""
        self._check_alive()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.is_prepared:
            return params
        if self._guides is None:
            setup = Setup(
                tokenizer_json=str(Path(self.config.model) / "tokenizer.json"),
                vocab_size=self.model_config.vocab_size,
                eos_ids=sorted(self.eos_token_ids),
                max_lexer_states=self.config.structured_outputs_config.max_lexer_states,
                max_mask_ms=self.config.structured_outputs_config.max_mask_ms,
                parent_pid=os.getpid(),
            )
            self._guides = Guides(setup, self.config.structured_outputs_config)
        return await self._guides.prepare(params)

    @property
    def guides(self) -> Guides | None:
        """The structured outputs' compile cache and worker, once a request needed them."""
        return self._guides

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Submit a prompt; returns the stream of its events. Raises ValueError (bad input),
        QueueFullError (waiting queue at its bound), NoWeightsError (a level-2 sleep dropped
        the weights, none loaded since) or EngineDeadError, synchronously.
        `priority` (vLLM's): under the priority policy, lower values are admitted first."""
        self._check_alive()
        self._check_weights()
        with self._refusals_told(request_id):
            if type(priority) is not int:
                raise ParamError("priority", f"priority must be an integer, got {priority!r}")
            if priority and self.config.scheduling_policy != "priority":
                raise ParamError(
                    "priority",
                    f"priority {priority} needs the priority scheduling policy "
                    "(--scheduling-policy priority); this engine admits first come first served",
                )
            return self._submit(prompt, params, request_id, priority)

    def check(
        self,
        prompts: list[str | list[int]],
        params: list[SamplingParams],
        request_id: str | None = None,
    ) -> None:
        """Raise what `generate` would for these prompts submitted one after another (the
        queue bound over all their choices), submitting none: a caller that needs all or none
        (a completion of several prompts) checks first, so a refusal leaves no aborted choice
        behind in the metrics. Nothing awaited between this and the `generate` calls can
        change the answer."""
        self._check_alive()
        with self._refusals_told(request_id):
            tokens = 0
            for prompt, p in zip(prompts, params, strict=True):
                prompt_ids, _ = self._check_request(prompt, p)  # tokenized again by generate: small
                tokens += len(prompt_ids) * p.n
            self._check_queue(sum(p.n for p in params), tokens)

    @contextlib.contextmanager
    def _refusals_told(self, request_id: str | None) -> Iterator[None]:
        """Monitors hear every refused submission, with its reason."""
        try:
            yield
        except QueueFullError as exc:
            self._scheduler.notify_refused(request_id or "", "queue_full", str(exc))
            raise
        except ValueError as exc:
            self._scheduler.notify_refused(request_id or "", "invalid", str(exc))
            raise

    def _check_request(
        self, prompt: str | list[int], params: SamplingParams
    ) -> tuple[tuple[int, ...], SamplingParams]:
        """The prompt's ids, and the params with their bad_words tokenized (as vLLM's
        processor)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not params.is_prepared:
            raise ValueError(
                "structured outputs and stop_regex are compiled before generate, off the "
                "event loop: params = await engine.prepare(params)"
            )
        encode = functools.partial(_encode_text, self.tokenizer)
        params = params.tokenize_bad_words(encode).resolve_thinking_end(self._think_end_id)
        prompt_ids = self._prompt_ids(prompt)
        params = params.resolve_max_tokens(len(prompt_ids), self.longest_sequence)
        self._check_fits(prompt_ids, params)
        return prompt_ids, params

    def _check_queue(self, choices: int, tokens: int) -> None:
        """The queue's bounds: choices, and their prompt tokens (a prompt is held in memory
        while it waits). The token bound takes any one call while nothing else waits, so a
        prompt over it is never refused forever."""
        queued, queued_tokens = self._scheduler.num_queued, self._scheduler.queued_tokens
        if queued + choices > self.config.max_queued_requests:
            raise QueueFullError(
                f"waiting queue is full: {queued} queued + {choices} new > "
                f"max_queued_requests {self.config.max_queued_requests}"
            )
        if queued and queued_tokens + tokens > self.config.max_queued_tokens:
            raise QueueFullError(
                f"waiting queue is full: {queued_tokens} queued prompt tokens + {tokens} new > "
                f"max_queued_tokens {self.config.max_queued_tokens}"
            )

    def _submit(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None, priority: int
    ) -> RequestStream:
        prompt_ids, params = self._check_request(prompt, params)
        if request_id is None:
            request_id = f"req-{uuid.uuid4().hex}"
        elif (old := self._streams.get(request_id)) is not None:
            if not old.closed:
                raise ParamError(
                    "request_id",
                    f"request_id {request_id!r} is already in use by a running request",
                )
            # its owner left (aclose, a cancelled consumer, the stream dropped): the id is free
            # at once, as after `abort`; the tick cancels the old choices
            self._forget(old)
        self._check_queue(params.n, len(prompt_ids) * params.n)
        now = time.monotonic()
        requests = []
        for index in range(params.n):
            requests.append(
                Request(
                    request_id=next(self._next_request_id),
                    index=index,
                    prompt_ids=prompt_ids,
                    params=params,
                    seed=self._seed(params, index),
                    arrival_time_s=now,
                    priority=priority,
                    multimodal=prompt if isinstance(prompt, MultimodalPrompt) else None,
                )
            )
        ids = tuple(r.request_id for r in requests)
        withdraw = functools.partial(self._scheduler.withdraw, ids)  # a closed stream's places
        sink = EventSink(request_id, ids, withdraw, self._forget)
        self._streams[request_id] = sink
        self._scheduler.submit(Submission(sink, requests))
        return RequestStream(sink, prompt_ids)

    # ---- between requests (engine/maintenance.py) --------------------------------------------

    async def update_weights(self, model_dir: str, abort_running: bool = False) -> None:
        """Serve the same model's weights from `model_dir` (an RL trainer's checkpoint): every
        rank loads them between requests. Running requests end first on the old weights (or,
        `abort_running`, at once with "abort"; requests frozen by a "keep" pause stay, to go
        on with the new ones); those waiting start on the new ones; saved prompt states are
        forgotten. Raises ValueError, changing nothing, when the folder is
        not this model's (config.json, its tensors' names and shapes), and EngineDeadError."""
        self._check_alive()
        model_dir = str(model_dir)

        def check() -> None:  # in a worker thread: it imports torch, which serving never needs else
            from deltaserve.engine.checkpoint_files import check_new_weights

            check_new_weights(self.weights_dir, model_dir, self.model_config)

        await asyncio.to_thread(check)
        done = self._maintain("load_weights", model_dir)  # admission held from here
        if abort_running:
            for request_id in self.request_ids():
                await self.abort(request_id)
        await asyncio.shield(done)  # a caller that stops waiting leaves it to run
        self.weights_dir = model_dir

    async def flush_cache(self) -> None:
        """Forget every saved prompt state (prefix caching), between requests."""
        await asyncio.shield(self._maintain("flush_cache"))

    async def pause(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        """Admit nothing until `resume` (vLLM's pause_generation), returning once in effect:
        "abort" ends the running and waiting requests with "abort"; "wait" lets the running
        ones finish; "keep" freezes them where they are, to go on after `resume` (with any
        weights updated meanwhile). `clear_cache` (not with "keep"): also forget the saved
        prompt states. Requests submitted while paused wait."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        done = self._maintain("pause", mode=mode, flush=clear_cache and mode != "keep")
        if mode == "abort":
            for request_id in self.request_ids():
                await self.abort(request_id)
        await asyncio.shield(done)

    def resume(self) -> None:
        """Admit and step again after `pause` (a pause not yet in effect raises ValueError)."""
        self._check_alive()
        self._scheduler.maintenance.resume()
        self._scheduler.wake()

    @property
    def is_paused(self) -> bool:
        return self._scheduler.maintenance.paused is not None

    async def sleep(self, level: int = 1) -> None:
        """Sleep mode (vLLM's sleep): once no request runs (admission held meanwhile), the
        ranks give back the device memory of their weights (level 1: kept on the host; 2:
        dropped, new ones to be loaded) and of their cache; saved prompt states are forgotten.
        Requests submitted while asleep wait for `wake_up`. ValueError when asleep already or
        beside requests frozen by a "keep" pause."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        await asyncio.shield(self._maintain("sleep", level=level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back what `sleep` gave: "weights", "kv_cache" (default both; vLLM's tags: an RL
        loop wakes the weights, loads new ones, then the cache). Requests are admitted again
        once both are back."""
        tags = list(SLEEP_TAGS) if tags is None else list(tags)
        if not tags or set(tags) - set(SLEEP_TAGS):
            raise ValueError(f"wake_up tags must be among {', '.join(SLEEP_TAGS)}, got {tags}")
        await asyncio.shield(self._maintain("wake_up", tags=tuple(tags)))

    @property
    def is_sleeping(self) -> bool:
        return bool(self._scheduler.maintenance.asleep)

    @property
    def weights_dropped(self) -> bool:
        """A level-2 sleep discarded the weights and none loaded since: nothing is admitted."""
        return self._scheduler.maintenance.weights_dropped

    def _maintain(
        self, kind: Kind, model_dir: str | None = None, **options: Any
    ) -> asyncio.Future[None]:
        self._check_alive()
        done = self._scheduler.maintenance.ask(kind, model_dir, **options)
        self._scheduler.wake()
        return done

    def cached_tokens(self, prompt_ids: list[int]) -> int:
        """How many leading tokens of the prompt a saved prefix holds now (prefix caching;
        else 0): what a request of it would skip, were it admitted now."""
        return self._scheduler.prefix.cached_tokens(tuple(prompt_ids))

    def request_ids(self) -> list[str]:
        """The ids of the requests not yet ended or given up (what `abort` can still cancel)."""
        return list(self._streams)

    async def abort(self, request_id: str) -> None:
        """Cancel every choice of `request_id`; idempotent, unknown ids are ignored. The id is
        free for a new request at once (as in vLLM); the aborted stream still ends with its
        "abort" events, and the new request gets fresh engine ids."""
        sink = self._streams.get(request_id)
        if sink is not None:
            self._forget(sink)
            if self._scheduler.dead_reason is None:
                self._scheduler.cancel(sink.request_ids)

    def _forget(self, sink: EventSink) -> None:
        if self._streams.get(sink.client_id) is sink:
            del self._streams[sink.client_id]

    def _prompt_ids(self, prompt: str | list[int] | MultimodalPrompt) -> tuple[int, ...]:
        if isinstance(prompt, MultimodalPrompt):
            self._check_media_fit(prompt, [f"media {i}" for i in range(len(prompt.media))])
            prompt = list(prompt.ids)
        if isinstance(prompt, str):
            ids = _encode_text(self.tokenizer, prompt)
        elif isinstance(prompt, list | tuple):
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            # one fast pass (a prompt can hold a million ids), the slow one only to name the culprit
            if ids and not (
                all(type(t) is int for t in ids) and min(ids) >= 0 and max(ids) < vocab
            ):
                for i, t in enumerate(ids):
                    if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                        raise ParamError(
                            "prompt",
                            f"prompt token {i} is {t!r}: ids must be integers in [0, {vocab})",
                        )
        else:
            raise ParamError(
                "prompt",
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
            )
        if not ids:
            raise ParamError("prompt", "prompt is empty: at least one token is needed")
        return tuple(ids)

    def _check_fits(self, prompt_ids: tuple[int, ...], params: SamplingParams) -> None:
        """The limits of this engine's configuration (ParamError naming the field): logprobs,
        token ids inside the vocabulary, and the one check that the prompt and max_tokens fit
        a sequence (max_model_len and the KV cache)."""
        vocab = self.model_config.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            if (k := getattr(params, name)) is not None and k > self.max_logprobs:
                raise ParamError(
                    name, f"{name} must be in 0..{self.max_logprobs}, got {k} (--max-logprobs)"
                )
        for t in params.stop_token_ids:
            if t >= vocab:
                raise ParamError(
                    "stop_token_ids", f"stop_token_ids has {t}, outside the vocabulary [0, {vocab})"
                )
        for name, ids in (
            ("logit_bias", [t for t, _ in params.logit_bias]),  # as vLLM, every such id named
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("bad_words", {t for word in params.bad_words_token_ids or () for t in word}),
        ):
            if outside := sorted(t for t in ids if t >= vocab):
                raise ParamError(
                    name, f"{name} has token ids {outside}, outside the vocabulary [0, {vocab})"
                )
        if params.n > self.config.max_queued_requests:  # refused now, it would be refused forever
            raise ParamError(
                "n",
                f"n ({params.n}) exceeds max_queued_requests ({self.config.max_queued_requests})",
            )
        need = len(prompt_ids) + params.max_tokens
        sum_up = f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {need}"
        if need > self.max_model_len:
            raise ParamError("prompt", f"{sum_up} exceeds max_model_len {self.max_model_len}")
        ledger = self._scheduler.ledger
        if not ledger.fits_ever(need):
            raise ParamError(
                "prompt",
                f"{sum_up} positions need {ledger.blocks_for(need)} KV blocks; the cache has "
                f"{ledger.num_blocks} blocks of {ledger.block_size}",
            )

    @staticmethod
    def _seed(params: SamplingParams, index: int) -> int:
        if params.seed is not None:
            return wire_seed(params.seed, index)
        if params.is_greedy:
            return 0
        return secrets.randbits(63)

    # ---- shutdown ---------------------------------------------------------------------------

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop admitting, let running requests finish for up to `drain_timeout_s`, abort
        the rest, stop the replica. Idempotent. Cancelling the call (a timeout around it)
        cancels only the wait: the shutdown goes on in its own task (`wait_closed` waits for
        it). Awaited here directly, the cancellation reached the scheduler task and failed
        the engine, or stranded it mid-drain with its ranks running."""
        self._shutting_down = True
        task = asyncio.get_running_loop().create_task(self._shutdown(drain_timeout_s))
        self._shutdowns.add(task)
        task.add_done_callback(self._shutdowns.discard)
        await asyncio.shield(task)

    async def _shutdown(self, drain_timeout_s: float) -> None:
        if not self._task.done():
            await self._scheduler.stop(drain_timeout_s)
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        try:
            await self._controller.shutdown()
        finally:
            self._tokenizer_worker.close()  # after the drain: its requests were tokenized
            if self._guides is not None:
                await self._guides.close()
            if self._monitor is not None:
                await self._monitor.aclose()  # its last message: shut_down
            if self._kv_events is not None:
                await self._kv_events.aclose()


def _encode_text(tokenizer: Any, text: str) -> list[int]:
    """The ids of `text` (no special tokens added). A lone surrogate (text decoded with
    errors="surrogateescape", say) is a ValueError naming where it is, not the tokenizer's
    TypeError "TextEncodeInput must be Union[...]"."""
    try:
        return tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"prompt is not valid Unicode: character {exc.start} is a lone surrogate "
                f"{text[exc.start]!r}"
            ) from None
        raise


def _token_id(tokenizer: Any, token: str) -> int | None:
    """`token`'s id when the vocabulary holds it as one token, else None."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None

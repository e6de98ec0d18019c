"""The control plane's wire schema: one tagged union of commands, one of replies.

Sender and receiver of every message:
- commands: replica controller (event-loop process) -> every rank process, the same bytes to
  each rank; each carries a sequence number `seq` that increases by one per command.
- replies: rank process -> controller, exactly one per command per rank, carrying `rank` and
  the command's `seq`.

msgspec msgpack only, decoded strictly against these types; no pickle on any socket.
`RequestId`s are assigned by the engine, unique for its lifetime, never reused.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import msgspec

from deltaserve.engine.speculative_config import SpeculativeConfig

RequestId = int


class SamplingRange(NamedTuple):
    """The values a sampling knob takes: finite, above `low` (or at it, unless `low_open`), at
    most `high`."""

    low: float
    high: float
    low_open: bool = False

    def admits(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return math.isfinite(value) and above and value <= self.high

    def __str__(self) -> str:
        left = "(" if self.low_open else "["
        right = ")" if self.high == math.inf else "]"
        return f"{left}{self.low}, {self.high}{right}"


# Each float knob's range, as vLLM's SamplingParams checks it: the engine refuses a request
# outside it naming the field (engine/sampling_params.py), the controller a plan outside it
# (ipc/validate.py).
SAMPLING_RANGES = {
    "temperature": SamplingRange(0.0, math.inf),
    "top_p": SamplingRange(0.0, 1.0, low_open=True),
    "min_p": SamplingRange(0.0, 1.0),
    "presence_penalty": SamplingRange(-2.0, 2.0),
    "frequency_penalty": SamplingRange(-2.0, 2.0),
    "repetition_penalty": SamplingRange(0.0, math.inf, low_open=True),
}
# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing by them overflows.
GREEDY_BELOW = 1e-5


def is_greedy(temperature: float) -> bool:
    """Whether a request samples greedily (argmax), on the engine and on the rank alike."""
    return temperature < GREEDY_BELOW


class GuideLimits(msgspec.Struct, frozen=True, array_like=True):
    """The bounds rank 0 holds a guided request's matcher to (engine/structured_config.py):
    its lexer's states (llguidance's limit) and the time of one token mask."""

    max_lexer_states: int
    max_mask_ms: float


class SamplingSpec(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """What a rank needs to sample one request's tokens; sent once, with its first chunk.

    `seed` is always set (the engine draws one for unseeded requests), so every sample is a
    function of (seed, output index) alone, whatever else is in the batch. Until `min_tokens`
    tokens were sampled, `stop_token_ids` (the EOS ids and the request's stop ids, sent with
    min_tokens only) cannot be; `logit_bias` holds (token id, bias) pairs, ids ascending.
    `allowed_token_ids` (empty: all) are the only ones that can be; `bad_words` are token-id
    sequences whose last token cannot be where the output so far ends with the rest.
    `guide_grammar` (non-empty: guided decoding) is the llguidance grammar the whole output
    must match, compiled once by the engine (engine/guides.py): only the tokens that keep the
    output a prefix of a match can be, and `guide_end_ids` (the EOS ids) where it is a match;
    past `guide_limits` the request fails alone (`SampleColumns.failed`).
    `think_budget` >= 0: the output starts inside a think block, and once that many tokens
    were sampled without `think_end_id` (`</think>`), that token is the only one that can be.
    """

    seed: int
    temperature: float = 0.0  # greedy (`is_greedy`); the engine sends the request's
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    num_logprobs: int = 0  # alternatives to return beside the sampled token's logprob
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    guide_grammar: str = ""
    guide_end_ids: tuple[int, ...] = ()
    guide_limits: GuideLimits | None = None
    think_budget: int = -1  # -1: none
    think_end_id: int = -1

    @property
    def is_greedy(self) -> bool:
        return is_greedy(self.temperature)


class NewRequest(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """Carried by a request's first chunk: the rank takes a state slot and KV blocks for
    `reserve_tokens` positions (what it computes before it samples; its whole lifetime when
    the engine reserves lifetimes; later items add blocks: `StepItem.grow`) and keeps the
    sampling spec.

    `prefix` >= 0: its first positions are saved prefix `prefix` (a StepItem's `save`): the
    rank starts the slot from that state, shares its full KV blocks and copies its partial
    one, and the first chunk starts where the prefix ends.
    `vision_spans`: the prompt's image and video-frame placeholder runs, (first token index,
    height, width) in tokens, in order: the rotary positions of the request's tokens follow
    from them (engine/rank/mrope.py); their embeddings come as `MediaInput`s.
    `output_ids`: a request preempted and admitted again (engine/scheduler.py) prefills its
    prompt and these, the tokens it sampled before; the rank counts them as sampled (the next
    sample's seed index, penalties, bad words, guided state, thinking budget), so the stream
    goes on as if it had never stopped."""

    reserve_tokens: int
    sampling: SamplingSpec
    prefix: int = -1
    vision_spans: list[tuple[int, int, int]] = []
    output_ids: tuple[int, ...] = ()


class MediaInput(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """An image's or a video's pixels for the vision tower, sent with the first chunk that
    holds one of its tokens (engine -> every rank, inside a StepItem).

    `key` is the SHA-256 of its pixels; `grid` its patch grid (frames, height, width) as the
    processor made it; `offsets` where each of its frame groups' placeholder runs starts in the
    request (one for an image). `pixels`: the processor's patches, [t*h*w, patch_dim]
    row-major in `dtype` (the model's: the tower casts to it anyway); empty when the ranks hold
    its encoding already (engine/encoder_cache.py, kept alike by the scheduler and each rank)."""

    key: bytes
    grid: tuple[int, int, int]
    offsets: list[int]
    pixels: bytes = b""
    dtype: str = ""


class StepItem(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """One request's share of a unified step: `token_ids` at positions start, start+1, ...

    A decode item is one token; a prefill chunk any number. `sample` asks for a token after
    the last position (decode items and the final prompt chunk). `new` is set on the first
    chunk only (start == 0, or where its saved prefix ends). Empty `token_ids` is a decode
    item whose token is the one the ranks sampled for this request in its previous step: the
    scheduler sends such a step before that sample has come back (a pipelined step).
    `save` >= 0 (prompt chunks): after the step, keep the request's state as saved prefix
    `save` (a free one), holding the KV blocks of its positions so far.
    `prompt_logprobs` >= 0 (prompt chunks): rank 0 returns the logprob of each prompt token
    that follows a position of the chunk, with that many alternatives (`PromptLogprobs`):
    token_ids[1:], then `next_token` (the next chunk's first) unless the chunk samples.
    `media` (prompt chunks): the images and videos whose first token the chunk holds (or,
    for a first chunk, any it holds part of); the tower encodes them in this step.
    `grow` > 0 (not on a first chunk): the rank adds that many free KV blocks to the request's
    before the step runs, which then hold exactly its positions through this item's last; the
    scheduler counted them free (engine/capacity.py), so a rank never runs out.
    Speculative decoding (engine/rank/speculative.py): `num_drafts` > 0 makes the last that
    many token ids drafts to verify (a decode item of 1 + num_drafts tokens): the ranks keep
    the positions up to the last accepted one and rank 0 reports the outcome
    (`SpecOutcome`); `propose` > 0 (items that sample) asks for that many drafts after the
    step's last accepted token, from the checkpoint's MTP head.
    """

    request_id: RequestId
    start: int
    token_ids: list[int]
    sample: bool
    new: NewRequest | None = None
    save: int = -1
    prompt_logprobs: int = -1
    next_token: int = -1
    media: list[MediaInput] = []
    grow: int = 0
    num_drafts: int = 0
    propose: int = 0

    @property
    def num_prompt_logprobs(self) -> int:
        """Rows of prompt logprobs the chunk returns (0 without prompt_logprobs)."""
        if self.prompt_logprobs < 0:
            return 0
        return len(self.token_ids) - self.sample


class Sample(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A sampled token with its logprob and the best `num_logprobs` alternatives, best
    first, as (token_id, logprob) pairs. Logprobs are of the model's raw distribution.
    What the executor returns; the wire carries a step's samples as `SampleColumns`."""

    request_id: RequestId
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One chunk's prompt logprobs, a row per position (`StepItem.prompt_logprobs`): the
    next prompt token's logprob and rank (1 + the tokens with a larger logit), and the best
    alternatives as (token_id, logprob) pairs, best first; raw distribution."""

    logprobs: list[float]
    ranks: list[int]
    top_logprobs: list[list[tuple[int, float]]]

    def __post_init__(self) -> None:
        if not len(self.logprobs) == len(self.ranks) == len(self.top_logprobs):
            raise ValueError(
                f"prompt logprob columns differ in length: {len(self.logprobs)} logprobs, "
                f"{len(self.ranks)} ranks, {len(self.top_logprobs)} top_logprobs"
            )


class SpecOutcome(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One item's speculative outcome (`StepItem.num_drafts`, `propose`): `accepted` of its
    drafts were taken, each emitted before the row's token (the one sampled after the last
    accepted position), with its logprob and, if the request asked, its alternatives (one
    list per accepted draft); `drafts` the next step may verify."""

    accepted: int
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    drafts: list[int]


class SampleColumns(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Rank 0's samples of one step as parallel columns: row i is request_ids[i]'s token
    and logprob; `top_logprobs` holds alternatives only for requests that asked for some
    (num_logprobs > 0), keyed by request id. The event-loop process decodes three lists in C
    instead of a struct and a list per sample, and one list comparison matches them to the
    step (ipc/validate.py). Decoding checks that the columns line up.

    `failed`: requests that rank 0 could not sample within their own bounds (a guided one
    whose matcher went past its limits), with the reason. Not a replica error: the engine
    ends each with an error and drops its state, as for a finished request; their row's
    token is meaningless. Reported once, with a sample of the request's."""

    request_ids: list[RequestId]
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: dict[RequestId, list[tuple[int, float]]]
    prompt_logprobs: dict[RequestId, PromptLogprobs] = {}  # of the chunks that asked
    failed: dict[RequestId, str] = {}
    speculative: dict[RequestId, SpecOutcome] = {}  # of the items with drafts or `propose`

    def __post_init__(self) -> None:
        if not len(self.token_ids) == len(self.logprobs) == len(self.request_ids):
            raise ValueError(
                f"sample columns differ in length: {len(self.request_ids)} request_ids, "
                f"{len(self.token_ids)} token_ids, {len(self.logprobs)} logprobs"
            )

    @classmethod
    def from_samples(
        cls,
        samples: list[Sample],
        prompt_logprobs: dict[RequestId, PromptLogprobs] | None = None,
        failed: dict[RequestId, str] | None = None,
        speculative: dict[RequestId, SpecOutcome] | None = None,
    ) -> SampleColumns:
        return cls(
            [s.request_id for s in samples],
            [s.token_id for s in samples],
            [s.logprob for s in samples],
            {s.request_id: s.top_logprobs for s in samples if s.top_logprobs},
            prompt_logprobs or {},
            failed or {},
            speculative or {},
        )

    def __len__(self) -> int:
        return len(self.request_ids)

    def sample(self, row: int) -> Sample:
        rid = self.request_ids[row]
        top = self.top_logprobs.get(rid, [])
        return Sample(rid, self.token_ids[row], self.logprobs[row], top)

    def by_id(self) -> dict[RequestId, Sample]:
        """Every row as a Sample, keyed by request id (tests, tools; not the hot path)."""
        return {self.request_ids[row]: self.sample(row) for row in range(len(self))}


# ---- commands: controller -> ranks --------------------------------------------------------


class SaveOnDrop(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Before a request's state is dropped, keep it as saved prefix `prefix` (free, or evicted
    by the same command), holding the KV blocks of its positions: where a generation ends, the
    next turn of its conversation begins. `num_tokens` is how many positions the scheduler
    knows the state covers; a rank that holds another count refuses the command."""

    request_id: RequestId
    prefix: int
    num_tokens: int


class RunUnifiedStep(msgspec.Struct, frozen=True, tag=True, array_like=True, gc=False):
    """First forget the saved prefixes `evict`, keep the states `saves` names, and free the
    state of `drops` (every rank must hold each; none is in `items`), then run one forward over
    `items` (ordered, each request at most once) and sample on rank 0.
    Reply: rank 0 `StepResult` with one sample per item with `sample` set (in any order);
    others `Ack`. A pipelined step carries the drops of requests that ended while it was
    planned, so that they cost no command of their own.

    Items stay one struct each on the wire: the executor takes `StepItem`s, and msgspec
    decodes them straight into structs in C, cheaper than any conversion from columns."""

    seq: int
    items: list[StepItem]
    drops: list[RequestId] = []
    evict: list[int] = []
    saves: list[SaveOnDrop] = []


class DropRequests(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Forget the saved prefixes `evict`, keep the states `saves` names (of requests in
    `request_ids`, "must_exist" only), then free the state of `request_ids`. Reply: `DropAck`
    from every rank, one flag per id, in order, saying whether the rank held it. `expect` is
    what the scheduler believes."""

    seq: int
    request_ids: list[RequestId]
    expect: Literal["must_exist", "must_be_absent"]
    evict: list[int] = []
    saves: list[SaveOnDrop] = []


class Ping(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Liveness probe. Reply: `Ack` from every rank."""

    seq: int


class Snapshot(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Ask each rank what it holds. Reply: `SnapshotReply` from every rank."""

    seq: int


class LoadWeights(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Copy the weights in `model_dir` (the same model's: an RL trainer's checkpoint) into
    the parameters in place, between requests. Reply: `Ack` from every rank. A rank that
    fails may hold half of them: the replica is poisoned (fail closed)."""

    seq: int
    model_dir: str


class Sleep(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Sleep mode (engine/rank/sleep_mode.py): give back the device memory of the weights (level
    1: kept on the host; 2: dropped) and of the cache, with no request or saved prefix held.
    Reply: `Ack` from every rank."""

    seq: int
    level: int


SLEEP_TAGS = ("weights", "kv_cache")  # what a wake-up may take back, as vLLM's tags


class WakeUp(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Take back what `Sleep` gave: the parts `tags` name ("weights", "kv_cache"). Reply: `Ack`."""

    seq: int
    tags: list[str]


class Shutdown(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Leave the serve loop and exit 0. Reply: `Ack` from every rank, then the rank exits."""

    seq: int


Command = RunUnifiedStep | DropRequests | Ping | Snapshot | LoadWeights | Sleep | WakeUp | Shutdown

# Commands that change rank state run only after the start gate releases them.
GATED_COMMANDS = (RunUnifiedStep, DropRequests, LoadWeights, Sleep, WakeUp)


# ---- replies: ranks -> controller ---------------------------------------------------------


class Ack(msgspec.Struct, frozen=True, tag=True, array_like=True):
    rank: int
    seq: int


class DropAck(msgspec.Struct, frozen=True, tag=True, array_like=True):
    rank: int
    seq: int
    existed: list[bool]


class StepResult(msgspec.Struct, frozen=True, tag=True, array_like=True, gc=False):
    rank: int
    seq: int
    samples: SampleColumns


class SnapshotReply(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """A rank's lifecycle snapshot. `slots_used`/`blocks_used` count what live requests hold;
    `num_slots`/`num_blocks` are the rank's whole capacity."""

    rank: int
    seq: int
    request_ids: list[RequestId]
    slots_used: int
    blocks_used: int
    num_slots: int
    num_blocks: int
    state_heads: int  # DeltaNet value heads this rank holds state for (its TP shard)
    kv_heads: int  # full-attention KV heads this rank caches (its TP shard)


class Failure(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The rank could not carry out command `seq`; the replica is poisoned with `reason`."""

    rank: int
    seq: int
    reason: str


Reply = Ack | DropAck | StepResult | SnapshotReply | Failure


# ---- rank start-up --------------------------------------------------------------------------


DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16")  # auto: the checkpoint's (fp32 on cpu)
FP8_WEIGHTS = ("widen", "keep")  # an FP8 checkpoint's projections: widened as they load, or kept
# the DeltaNet recurrent states' dtype (vLLM's --mamba-ssm-cache-dtype): auto is the
# checkpoint's mamba_ssm_dtype (float32 for the released Qwen3.5)
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16")
# the full-attention layers' KV cache (vLLM's --kv-cache-dtype): auto is the model's dtype;
# fp8 (= fp8_e4m3) halves a bf16 cache (kernels/kv_quant.py)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


class ExecutorConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one rank's executor runs (engine/rank/executor.py); sent inside the rank's
    RankConfig at spawn (ipc/launch.py). A field named as an EngineConfig field is that
    setting, named as its flag, passed on unchanged (engine/config.py `executor_config`); the
    others are the rank's place and the limits resolved at start. The engine takes its
    defaults for these settings from here: each is defined once."""

    model: str  # the checkpoint folder
    rank: int = 0
    tp_size: int = 1
    device: str = "cpu"  # "cpu", or "cuda:N" (a replica's every-rank view: "cuda")
    dtype: str = "auto"  # one of DTYPES
    block_size: int = 16  # KV cache positions per block
    max_num_seqs: int = 16  # state slots: requests running at once
    num_kv_blocks: int | None = None  # None: what gpu_memory_utilization leaves (CUDA only)
    max_model_len: int = 0  # longest request in positions (sizes CUDA graphs); 0: the cache
    gpu_memory_utilization: float = 0.9  # the device's share to use, when num_kv_blocks is None
    max_num_batched_tokens: int = 2048  # a step's tokens: the profiling step, prompt graphs
    enforce_eager: bool = False  # CUDA: never replay CUDA graphs
    prompt_graph_tokens: int = 2048  # CUDA: prompt steps of up to this many replay graphs
    fp8_weights: str = "widen"  # one of FP8_WEIGHTS (engine/rank/loader.py)
    # bfloat16 halves the DeltaNet states' memory (more requests fit) and the bytes a decode
    # step moves for them, at some accuracy (docs/RANK.md)
    mamba_ssm_cache_dtype: str = "auto"  # one of MAMBA_SSM_CACHE_DTYPES
    # fp8: keys and values stored as e4m3 with a scale per layer and KV head: 1.0, or with
    # calculate_kv_scales set from the first prompt step's (vLLM's flags)
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    calculate_kv_scales: bool = False
    prefix_cache_states: int = 0  # saved prefix states (prefix caching); 0: off
    # speculative decoding: the checkpoint's MTP head loads and keeps its KV (engine/rank/mtp.py)
    speculative_config: SpeculativeConfig | None = None

    @property
    def keep_fp8(self) -> bool:
        return self.fp8_weights == "keep"

    @property
    def mtp(self) -> bool:
        """Speculative decoding is on: the MTP head is loaded and its KV kept."""
        return self.speculative_config is not None

    @property
    def num_speculative_tokens(self) -> int:
        """Drafts per step item at most; 0 without speculative decoding."""
        spec = self.speculative_config
        return 0 if spec is None else spec.num_speculative_tokens

    def __post_init__(self) -> None:
        for name in ("tp_size", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            _check_int(name, getattr(self, name), 1)
        for name in ("rank", "max_model_len", "prompt_graph_tokens", "prefix_cache_states"):
            _check_int(name, getattr(self, name), 0)
        if self.rank >= self.tp_size:
            raise ValueError(f"rank {self.rank} is outside tp_size {self.tp_size}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.num_kv_blocks is not None:  # None: CUDA only (engine/rank/memory_budget.py)
            _check_int("num_kv_blocks", self.num_kv_blocks, 1)
        util = self.gpu_memory_utilization
        if type(util) not in (int, float) or not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {util!r}")
        choices = (
            ("dtype", DTYPES),
            ("fp8_weights", FP8_WEIGHTS),
            ("mamba_ssm_cache_dtype", MAMBA_SSM_CACHE_DTYPES),
            ("kv_cache_dtype", KV_CACHE_DTYPES),
        )
        for name, allowed in choices:
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                )
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError(
                "calculate_kv_scales sets the scales of an FP8 KV cache: give kv_cache_dtype fp8"
            )


def _check_int(name: str, value: object, low: int) -> None:
    """`value` is an int (not a bool) >= `low`; else ValueError naming `name`."""
    if type(value) is not int or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


class Ready(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Sent once by each rank after its weights and cache are in place."""

    rank: int
    num_slots: int
    num_blocks: int
    block_size: int


class StartupFailed(msgspec.Struct, frozen=True, tag=True, array_like=True):
    rank: int
    reason: str


StartupReply = Ready | StartupFailed

command_encoder = msgspec.msgpack.Encoder()
command_decoder = msgspec.msgpack.Decoder(Command)
reply_decoder = msgspec.msgpack.Decoder(Reply)
startup_decoder = msgspec.msgpack.Decoder(StartupReply)
# What these decoders raise on bad bytes: msgspec.DecodeError (ValidationError included), but
# UnicodeDecodeError for a string that is not UTF-8 and RecursionError for very deep nesting.
DECODE_ERRORS = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)

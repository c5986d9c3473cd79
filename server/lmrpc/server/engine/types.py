"""The engine's public types, shared by the front doors and the engine: no torch, no protobuf.

The servicer turns a validated `GenerateRequest` into one `EngineRequest` per output (prompt x n); the engine
answers with `EngineOutput` deltas. Everything here is immutable once built, so it can cross threads freely.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from lmrpc.server.models.types import PromptMedia

if TYPE_CHECKING:
    import regex
    from llguidance import LLMatcher

GREEDY_TEMPERATURE = 1e-6  # below this, a row is decoded greedily (argmax)


class FinishReason(enum.Enum):
    """Why an output ended; mirrors lmrpc.v1.FinishReason (values match the proto numbers)."""

    LENGTH = 1
    EOS = 2
    STOP_TOKEN = 3
    STOP_STRING = 4
    STOP_REGEX = 5
    GRAMMAR_END = 6
    ABORT = 7
    ERROR = 8


@dataclass(frozen=True)
class Finish:
    """The end of one output."""

    reason: FinishReason  # why it ended
    matched_token_id: int | None = None  # EOS / stop token / grammar-end token that ended it
    matched_text: str | None = None  # stop string, or stop_regex pattern, that ended it
    message: str = ""  # human-readable detail (ERROR, ABORT)
    # ERROR caused by the request itself, not by the server (its grammar passed the parser's limits mid-generation,
    # its tokens cannot fit the KV pool): services that answer a status say INVALID_ARGUMENT, not INTERNAL
    request_fault: bool = False


ConstraintKind = Literal["json_schema", "regex", "ebnf", "structural_tag"]


@dataclass(frozen=True)
class Constraint:
    """A structured-output constraint (compiled by the grammar module)."""

    kind: ConstraintKind  # which grammar language `text` is written in
    text: str  # the schema / pattern / grammar / structural tag, as sent
    # JSON layout (json_schema, and the schemas of a structural_tag): True any whitespace, False exactly
    # json.dumps' ", " and ": ", None llguidance's default (any whitespace) unless the schema's "x-guidance" says
    json_whitespace_flexible: bool | None = None
    # The matcher the service's check built (never advanced: the engine copies it for each output, in microseconds,
    # where building one compiles the grammar again). Held by the requests that carry it and gone with them; None
    # until checked (the engine then builds one on its matcher thread).
    checked: LLMatcher | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class SamplingParams:
    """Fully resolved sampling parameters of one output: defaults applied, already validated."""

    max_new_tokens: int = 128  # cap on generated tokens (already capped to fit the context)
    min_new_tokens: int = 0  # stop tokens are masked until this many tokens exist
    temperature: float = 1.0  # < GREEDY_TEMPERATURE means greedy
    top_p: float = 1.0  # nucleus threshold in (0, 1]
    top_k: int = -1  # -1: all tokens
    min_p: float = 0.0  # relative probability floor in [0, 1]
    frequency_penalty: float = 0.0  # per occurrence in the output, [-2, 2]
    presence_penalty: float = 0.0  # once if present in the output, [-2, 2]
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of output tokens
    stop: tuple[str, ...] = ()  # stop strings
    stop_token_ids: tuple[int, ...] = ()  # extra stop token ids (besides the model's EOS ids)
    stop_regex: tuple[str, ...] = ()  # stop patterns matched against the decoded tail
    # stop_regex compiled once at validation (the `regex` module's patterns): compiled again for each output on the
    # engine thread, a call of 320 outputs x 1,024 patterns stalled it. Empty: not compiled (the engine compiles).
    stop_patterns: tuple[regex.Pattern[str], ...] = field(default=(), compare=False, repr=False)
    ignore_eos: bool = False  # don't stop on EOS ids nor stop_token_ids
    skip_special_tokens: bool = True  # leave special tokens out of the text
    spaces_between_special_tokens: bool = True  # join special tokens with spaces in the text
    no_stop_trim: bool = False  # keep the matched stop string / token text in the text
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # token id -> added logit
    seed: int | None = None  # per-request seed: reproducible whatever the batch
    n: int = 1  # samples per prompt (the servicer fans out; informational here)
    constraint: Constraint | None = None  # structured output, if any
    logit_processor: str | None = None  # name of a registered custom logit processor
    processor_params: Mapping[str, Any] = field(default_factory=dict)  # its custom_params

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0


@dataclass(frozen=True)
class LogprobOptions:
    """What logprobs one output asks for (only built when return_logprob is set)."""

    start_len: int = -1  # first prompt position with a prompt logprob; -1: no prompt logprobs
    top_k: int = 0  # alternatives per position, best first
    token_ids: tuple[int, ...] = ()  # ids whose logprobs are reported at every position, in this order
    with_text: bool = False  # decode each entry's token on its own (special tokens kept)


class AdapterRef(Protocol):
    """A loaded LoRA adapter as requests carry it (lora.registry.LoadedAdapter); the engine runs its deltas."""

    @property
    def name(self) -> str: ...  # how requests name it

    @property
    def uid(self) -> int: ...  # unique per load: the prefix cache keys on it


class HiddenStatesMode(enum.Enum):
    """Which final-layer hidden states an output returns (GenerateRequest.hidden_states_mode)."""

    ALL = 1  # every position the model computed for it: the prompt, then each output token but the last
    LAST = 2  # only the last computed position (the one whose logits chose the last token), with the last output


@dataclass(frozen=True)
class PromptEmbeddings:
    """A prompt given as embeddings instead of token ids: the rows the model's first layer reads."""

    data: bytes  # float32 little-endian, [num_positions, hidden], validated finite
    num_positions: int  # prompt length in positions (>= 1)
    hidden: int  # row width: the model's hidden size
    # one digest per position, of its row's bytes: the prefix cache's key for that position (bytes, so it can never
    # equal a token id: an embeddings prompt never shares KV pages with a token prompt; pages chain on their parent,
    # so a row's key only has to tell rows apart)
    position_keys: tuple[bytes, ...]

    def __post_init__(self) -> None:
        assert self.num_positions >= 1 and self.hidden >= 1
        assert len(self.data) == self.num_positions * self.hidden * 4
        assert len(self.position_keys) == self.num_positions


@dataclass(frozen=True)
class EngineRequest:
    """One output to generate: a prompt and its parameters. A call with b prompts and n samples makes b * n."""

    request_id: str  # unique among live requests: the rid, or "rid/i" for sample i of n > 1
    rid: str  # the user-facing request id (Abort by rid ends all outputs sharing it)
    index: int  # output index in the call, prompt-major (prompt * n + sample)
    prompt_ids: tuple[int, ...]  # the tokenized prompt, special tokens included
    params: SamplingParams  # resolved sampling parameters
    logprobs: LogprobOptions | None = None  # None: no logprobs
    share_prefill_with: str | None = None  # request_id of sample 0 whose prompt pages samples 1..n-1 reuse
    priority: int = 0  # lower is admitted first among waiting outputs; ties in arrival order
    client: str = ""  # who asked (an API key's fingerprint, or the peer's address): per-client accounting
    adapter: AdapterRef | None = None  # the LoRA adapter it runs under; None: the base model
    # The prompt as embeddings; then prompt_ids holds one placeholder id per position (never read by the model,
    # never a prefix-cache key) so that lengths, positions and usage stay token-shaped
    prompt_embeds: PromptEmbeddings | None = None
    # Images and audio clips in the prompt: prompt_ids holds the model's placeholder id at their positions (read by
    # nothing but usage and the detokenizer's context); the executor replaces those rows with the items' own
    prompt_media: PromptMedia | None = None
    hidden_states: HiddenStatesMode | None = None  # return final-layer normalized hidden states; None: don't
    routed_experts_from: int | None = None  # return routed experts from this position on; None: don't


@dataclass(frozen=True)
class TokenLogprob:
    """One token's logprob."""

    token_id: int  # the token
    logprob: float | None  # natural log; None where nothing predicts the position (first prompt token)
    text: str | None = None  # the token decoded alone, when LogprobOptions.with_text


@dataclass(frozen=True)
class PositionLogprobs:
    """The logprobs at one position."""

    chosen: TokenLogprob  # the token at (or sampled for) this position
    top: tuple[TokenLogprob, ...] = ()  # best first
    requested: tuple[TokenLogprob, ...] = ()  # LogprobOptions.token_ids, in order


@dataclass(frozen=True)
class Usage:
    """Token counts of one output."""

    prompt_tokens: int  # prompt length as tokenized
    completion_tokens: int  # generated tokens, stop token included
    cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass(frozen=True)
class RoutedExperts:
    """The experts some consecutive positions were routed to."""

    start_position: int  # position of the first row
    num_positions: int  # rows
    data: bytes  # int32 little-endian [num_positions, moe layers, top_k], best expert first

    def __post_init__(self) -> None:
        assert self.num_positions >= 1 and len(self.data) % (4 * self.num_positions) == 0


@dataclass(frozen=True)
class EngineOutput:
    """What is new for one output since its previous EngineOutput (deltas)."""

    request_id: str  # EngineRequest.request_id
    token_ids: tuple[int, ...] = ()  # new token ids
    text: str = ""  # new text (held back while it may still become a stop string or half a character)
    output_logprobs: tuple[PositionLogprobs, ...] = ()  # one per new token, when requested
    input_logprobs: tuple[PositionLogprobs, ...] = ()  # prompt logprobs, in the first output only
    finish: Finish | None = None  # set on the last output only
    usage: Usage | None = None  # set on the last output only
    # new final-layer normalized hidden states, one float32 little-endian [hidden] row per position, in position
    # order, continuing where the previous output stopped (EngineRequest.hidden_states)
    hidden_states: tuple[bytes, ...] = ()
    routed_experts: RoutedExperts | None = None  # new positions' routed experts, when asked for and any are new
    # time.monotonic() when the engine first scheduled the output (its queue time ends there); None until then,
    # and on outputs that never reached the model (rejected, aborted while waiting, max_new_tokens == 0)
    scheduled_at: float | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load, for admission control, health and metrics."""

    num_running: int  # sequences holding KV pages (prefilling or decoding)
    num_waiting: int  # sequences queued for admission (incl. preempted)
    num_pages: int  # total KV pages
    num_free_pages: int  # pages not referenced by a live sequence (free or evictable prefix cache)
    num_used_pages: int  # pages referenced by live sequences
    num_cached_pages: int  # pages held only by the prefix cache
    num_paused: int = 0  # outputs not scheduled because their client has not read what they produced
    num_loaded_adapters: int = 0  # LoRA adapters held in memory
    # What routers built for vLLM read (metrics.py exports it under vLLM's names): the page size, and the LoRA
    # adapters a step can run and those its outputs run or wait under. Names sorted, each once.
    page_size: int = 0  # tokens per KV page; 0: not reported
    max_adapters: int = 0  # distinct adapters one step can run (--max-loras-per-batch); 0: the model runs none
    running_adapters: tuple[str, ...] = ()  # adapters of the running outputs
    waiting_adapters: tuple[str, ...] = ()  # adapters of the waiting outputs


class EngineClient(Protocol):
    """What the servicer needs from the engine (implemented by engine.AsyncEngine)."""

    def generate(self, requests: list[EngineRequest]) -> AsyncGenerator[EngineOutput, None]:
        """Submit requests; yield their outputs as they come, ending after every request finished.

        Closing the generator early (cancel, deadline) aborts the unfinished requests and frees their pages; callers
        close it explicitly (contextlib.aclosing), so that this happens before their own close returns.
        """
        ...

    def abort(self, rids: list[str] | None) -> list[str]:
        """Abort the live requests of these user rids (None: all). Returns the rids found."""
        ...

    def stats(self) -> EngineStats:
        """Current load."""
        ...

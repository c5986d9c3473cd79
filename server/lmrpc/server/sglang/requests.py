"""An SMG GenerateRequest -> lmrpc's typed request: the prompt ids, the sampling parameters resolved by validation.py's
shared rules (`resolve_sampling`, the same defaults, bounds and messages as GenerateService) and logprob options;
the service makes its prompt plan of them (pipeline/fanout.py: n samples of the one prompt).

SMG's SamplingParams are proto3 scalars without presence: the gateway fills what a request left unset with
SGLang's semantic defaults (temperature 1, top_p 1, top_k -1, repetition_penalty 1) after applying the worker's
`default_sampling_params_json`. So a value arrives as a value, and an explicit temperature 0 (greedy) is the
scalar's zero. Zeros that mean nothing to the sampler (top_p 0, top_k 0, repetition_penalty 0, n 0) are taken as
unset, i.e. the worker's default; `max_new_tokens` has presence, and absent means the worker's default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from smg_grpc_proto import sglang_scheduler_pb2 as sgl

from lmrpc.server import statuses, validation
from lmrpc.server.config import RequestLimits
from lmrpc.server.engine.types import LogprobOptions, SamplingParams
from lmrpc.server.models.types import ModelInfo
from lmrpc.v1 import generate_pb2

INT32_MAX = 2**31 - 1  # lmrpc.v1's counts are int32; SMG's are uint32 (a larger value is refused by the bounds)
# SMG's constraint oneof -> lmrpc.v1's (the names differ only for EBNF)
_CONSTRAINTS = {"regex": "regex", "json_schema": "json_schema", "ebnf_grammar": "ebnf",
                "structural_tag": "structural_tag"}
# lmrpc's SamplingParams field names -> SMG's, for the violations' field paths
_SMG_NAMES = {"ebnf": "ebnf_grammar"}


@dataclass(frozen=True)
class Translated:
    """An SMG GenerateRequest checked and resolved: everything but the constraint's compilation and the adapter."""

    prompt: tuple[int, ...]  # tokenized.input_ids
    params: SamplingParams  # resolved (defaults applied, bounds checked)
    logprobs: LogprobOptions | None  # None: return_logprob unset


def sampling_field(name: str) -> str:
    """A SamplingParams field name -> the SMG request's field path (what a violation names)."""
    return f"sampling_params.{_SMG_NAMES.get(name, name)}"


def to_lmrpc_sampling(sp: sgl.SamplingParams) -> generate_pb2.SamplingParams:
    """SMG's sampling parameters as lmrpc.v1's (presence where SMG's value means something: see the module doc)."""
    pb = generate_pb2.SamplingParams(
        temperature=sp.temperature, min_p=sp.min_p, frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty, min_new_tokens=min(sp.min_new_tokens, INT32_MAX),
        ignore_eos=sp.ignore_eos, no_stop_trim=sp.no_stop_trim, stop=list(sp.stop),
        stop_token_ids=[min(t, INT32_MAX) for t in sp.stop_token_ids],
    )
    if sp.top_p > 0:
        pb.top_p = sp.top_p
    if sp.top_k != 0:
        pb.top_k = sp.top_k
    if sp.repetition_penalty > 0:
        pb.repetition_penalty = sp.repetition_penalty
    if sp.n > 0:
        pb.n = min(sp.n, INT32_MAX)
    if sp.HasField("max_new_tokens"):
        pb.max_new_tokens = min(sp.max_new_tokens, INT32_MAX)
    kind = sp.WhichOneof("constraint")
    if kind is not None:
        setattr(pb, _CONSTRAINTS[kind], getattr(sp, kind))
    if sp.HasField("custom_params"):
        pb.custom_params.CopyFrom(sp.custom_params)
    return pb


def add_logit_bias(sp: sgl.SamplingParams, pb: generate_pb2.SamplingParams, vocab_size: int) -> None:
    """SMG's logit_bias (token ids as map<string, float> keys) into `pb`'s integer keys; a key that is no token id
    is a user error (the values are checked by resolve_sampling)."""
    c = statuses.Collector()
    for key, value in sp.logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if 0 <= token < vocab_size:
            pb.logit_bias[token] = value
        else:
            c.check(False, "sampling_params.logit_bias", f"key {key[:32]!r} is not a token id in [0, {vocab_size})")
    c.raise_if_any()


def translate(req: sgl.GenerateRequest, info: ModelInfo, limits: RequestLimits, capacity: int,
              use_model_defaults: bool, processors_enabled: bool) -> Translated:
    """Check and resolve an SMG GenerateRequest: its counts first (nothing is built for a request past a bound),
    then the prompt ids, sampling parameters and logprob options. Raises statuses.RequestError."""
    c = statuses.Collector()
    sp = req.sampling_params
    n = max(sp.n, 1)
    validation.check_outputs(n, capacity, "sampling_params.n" if n > 1 else "tokenized.input_ids")
    c.check(req.HasField("tokenized"), "tokenized", "the worker takes token ids: set tokenized.input_ids")
    c.check(not req.input_embeds, "input_embeds", "not taken by this worker: send tokenized.input_ids")
    c.check(not req.HasField("mm_inputs"), "mm_inputs", "multimodal inputs are not taken on this path")
    c.check(not req.return_hidden_states, "return_hidden_states", "not served on this path")
    c.check(not req.HasField("disaggregated_params"), "disaggregated_params", "this worker does not disaggregate")
    c.check(0 <= req.top_logprobs_num <= validation.MAX_TOP_LOGPROBS, "top_logprobs_num",
            f"must be in [0, {validation.MAX_TOP_LOGPROBS}], got {req.top_logprobs_num}")
    c.check(len(req.token_ids_logprob) <= limits.max_logprob_token_ids, "token_ids_logprob",
            f"has {len(req.token_ids_logprob)} entries; the server takes at most {limits.max_logprob_token_ids} "
            "(--max-logprob-token-ids)")
    count = len(sp.logit_bias)  # counted before any key is read
    c.check(count <= limits.max_logit_bias, "sampling_params.logit_bias",
            f"has {count} entries; the server takes at most {limits.max_logit_bias} (--max-logit-bias)")
    pb = to_lmrpc_sampling(sp)
    validation.check_sizes(c, [("sampling_params.", pb)], limits)
    c.raise_if_any()
    prompt = list(req.tokenized.input_ids)
    c.check(bool(prompt), "tokenized.input_ids", "must not be empty")
    c.raise_if_any()
    validation.check_prompt_ids(c, prompt, "tokenized.input_ids", info)
    if req.return_logprob:
        k = req.logprob_start_len
        c.check(-1 <= k <= len(prompt), "logprob_start_len", f"must be in [-1, {len(prompt)}] (prompt length), got {k}")
        for t in req.token_ids_logprob:
            c.check(0 <= t < info.vocab_size, "token_ids_logprob", f"token id {t} outside [0, {info.vocab_size})")
    c.raise_if_any()
    add_logit_bias(sp, pb, info.vocab_size)
    namer: Callable[[str], str] = sampling_field
    params = validation.resolve_sampling(pb, namer, info, use_model_defaults, len(prompt), req.custom_logit_processor,
                                         processors_enabled)
    logprobs = None
    if req.return_logprob:
        logprobs = LogprobOptions(start_len=req.logprob_start_len, top_k=req.top_logprobs_num,
                                  token_ids=tuple(req.token_ids_logprob))
    return Translated(tuple(prompt), params, logprobs)

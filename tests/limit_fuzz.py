"""The limits mode of the fuzz: requests that start valid and are pushed toward and past the server's bounds.

A case is one template (a valid call: Generate with a short text prompt or with input_ids, Complete, ChatComplete,
each with max_new_tokens 1-4; Tokenize, Detokenize, LoadLoraAdapter, UnloadLoraAdapter, Abort) and one to three
mutations of a kind (KINDS): counts at orders of magnitude around the capacity and the --max-* limits, JSON schemas,
Struct schemas, EBNF rule chains and parentheses nested deep, unsatisfiable and explosive grammars, grammars around
the byte limit, every string field of the request (found from its descriptor, three messages deep) 10 to 10^6
characters long or with a control character in it, long x-request-id metadata. Lone surrogates are left out: a
protobuf string cannot carry them.

Hypothesis chooses the template and the mutations, not an enumeration: the kinds multiply into more combinations
than a run sends, a --seed replays a run, CI derandomizes, and with WireFuzzer(raise_forbidden=True) a forbidden
status shrinks to its fewest, smallest mutations. The bounds come from GetModelInfo's `limits` (RequestLimits) when
the server fills them, else from the documented defaults (Limits). Every case is sent as bytes by WireFuzzer
(tests/wire_fuzz.py); LimitRun keeps its code and wall time by kind, the slowest calls, and every FORBIDDEN status
with the request that got it. bench/fuzz.py --mode limits runs thousands; tests/e2e/test_fuzz.py a CI-sized run.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import grpc
import limit_values as lv
from google.protobuf.message import Message
from hypothesis import strategies as st
from wire_fuzz import FORBIDDEN, METHODS, Case, WireFuzzer

from lmrpc.v1 import generate_pb2, openai_pb2


@dataclass(frozen=True)
class Limits:
    """The bounds a case is mutated around: GetModelInfo's RequestLimits, else these defaults (the server's flags'
    defaults; the grammar ones are guesses)."""

    max_outputs_per_call: int = 320
    max_logit_bias: int = 4096
    max_stop: int = 1024
    max_stop_chars: int = 1024
    max_logprob_token_ids: int = 256
    max_top_logprobs: int = 20
    max_grammar_bytes: int = 65536
    max_grammar_depth: int = 64
    max_grammar_rules: int = 1024
    max_request_id_chars: int = 256
    max_media_items: int = 16
    max_adapter_name_chars: int = 64
    vocab_size: int = 49152  # not RequestLimits fields: GetModelInfo's vocab_size and max_context_length
    max_context_length: int = 8192


def read_limits(channel: grpc.Channel, api_key: str | None) -> tuple[Limits, list[str]]:
    """The server's limits, and the names of those it left 0 (unset) that took the default instead."""
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
    info: generate_pb2.GetModelInfoResponse = channel.unary_unary(
        "/lmrpc.v1.GenerateService/GetModelInfo", generate_pb2.GetModelInfoRequest.SerializeToString,
        generate_pb2.GetModelInfoResponse.FromString)(generate_pb2.GetModelInfoRequest(), timeout=30,
                                                      metadata=metadata)
    given = {f.name: int(getattr(info.limits, f.name, 0)) for f in fields(Limits)} | {
        "vocab_size": info.vocab_size, "max_context_length": info.max_context_length}
    defaults = Limits()
    guessed = [name for name, value in given.items() if not value]
    return Limits(**{name: value or getattr(defaults, name) for name, value in given.items()}), guessed


# ---- templates ---------------------------------------------------------------------------------------------------

# Made fresh for each case (a mutation changes its message in place): (stream, max new tokens) -> a valid request.
TEMPLATES: dict[str, Callable[[bool, int], Message]] = {
    "Generate.text": lambda s, k: generate_pb2.GenerateRequest(
        text=["Hello"], sampling_params=[generate_pb2.SamplingParams(max_new_tokens=k, temperature=0)], stream=s),
    "Generate.ids": lambda s, k: generate_pb2.GenerateRequest(
        input_ids=[generate_pb2.TokenIds(ids=[1, 19556, 28])],
        sampling_params=[generate_pb2.SamplingParams(max_new_tokens=k, temperature=0)], stream=s),
    "Complete": lambda s, k: openai_pb2.CompleteRequest(prompt=["Hello"], max_tokens=k, temperature=0, stream=s),
    "ChatComplete": lambda s, k: openai_pb2.ChatCompleteRequest(
        messages=[openai_pb2.ChatMessage(role="user", content="Hi")], max_tokens=k, temperature=0, stream=s),
    "Tokenize": lambda s, k: generate_pb2.TokenizeRequest(text="Hello"),
    "Detokenize": lambda s, k: generate_pb2.DetokenizeRequest(token_ids=[19556, 28]),
    "LoadLoraAdapter": lambda s, k: generate_pb2.LoadLoraAdapterRequest(name="fuzz-adapter", path="fuzz-adapter"),
    "UnloadLoraAdapter": lambda s, k: generate_pb2.UnloadLoraAdapterRequest(name="fuzz-adapter"),
    "Abort": lambda s, k: generate_pb2.AbortRequest(rid=["fuzz-rid"]),
}
# The generating RPCs are drawn three times as often: they have the most fields and the most limits.
_WEIGHTED = [t for t in TEMPLATES for _ in range(3 if t.split(".")[0] in ("Generate", "Complete", "ChatComplete")
                                                 else 1)]
_METHODS = {m.path.rsplit("/", 1)[1]: m for m in METHODS}


def _sampling(msg: Message) -> Any:
    """Where a request's sampling fields are: its first SamplingParams (Generate), itself (Complete, ChatComplete),
    or None."""
    if isinstance(msg, generate_pb2.GenerateRequest):
        return msg.sampling_params[0]
    return msg if isinstance(msg, (openai_pb2.CompleteRequest, openai_pb2.ChatCompleteRequest)) else None


def _replace(container: Any, values: list[Any]) -> None:
    del container[:]
    container.extend(values)


# A mutation changes the message in place and says what it did; it may add bytes to the serialized message (a
# singular message field given twice is merged) and metadata.
@dataclass
class _Extra:
    payload: bytes = b""
    metadata: list[tuple[str, str]] = field(default_factory=list)


Mutation = Callable[[st.DrawFn, Message, Limits, _Extra], str]

# ---- counts ------------------------------------------------------------------------------------------------------


def _set_prompts(msg: Message, k: int) -> None:
    if isinstance(msg, openai_pb2.CompleteRequest):
        _replace(msg.prompt, ["Hello"] * k)
    elif isinstance(msg, generate_pb2.GenerateRequest) and msg.input_ids:
        _replace(msg.input_ids, [generate_pb2.TokenIds(ids=[1, 19556])] * k)
    elif isinstance(msg, generate_pb2.GenerateRequest):
        _replace(msg.text, ["Hello"] * k)


def _outputs(draw: st.DrawFn, msg: Message, limits: Limits, extra: _Extra) -> str:
    cap = limits.max_outputs_per_call
    counts = sorted({*lv.COUNTS, cap - 1, cap, cap + 1})
    sampling = _sampling(msg)
    # One new token each: a call of the capacity's outputs that is let in is the costliest case of a run.
    setattr(sampling, "max_new_tokens" if isinstance(msg, generate_pb2.GenerateRequest) else "max_tokens", 1)
    options = ["n"] + ["best_of"] * isinstance(msg, openai_pb2.CompleteRequest) + \
        ["prompts", "prompts_x_n"] * (not isinstance(msg, openai_pb2.ChatCompleteRequest))
    what = draw(st.sampled_from(options))
    if what in ("n", "best_of"):
        setattr(sampling, what, draw(st.sampled_from(counts)))
        return f"{what}={getattr(sampling, what)}"
    if what == "prompts":  # at most 10^5 prompts: 10^6 would not fit in a message
        k = draw(st.sampled_from([c for c in counts if c <= 10**5]))
        _set_prompts(msg, k)
        return f"prompts={k}"
    k = draw(st.sampled_from([2, 3, 10, 18, 32]))
    sampling.n = cap // k + draw(st.sampled_from([0, 1]))  # just within the capacity, or just past it
    _set_prompts(msg, k)
    return f"prompts={k} x n={sampling.n}"


def _sized(name: str, limit: Callable[[Limits], int], entry: Callable[[int, Limits], Any]) -> Mutation:
    """A repeated field (or map) of the sampling params, its size around its limit."""
    def mutate(draw: st.DrawFn, msg: Message, limits: Limits, extra: _Extra) -> str:
        k = draw(st.sampled_from(lv.around(limit(limits))))
        target = getattr(_sampling(msg), name)
        if name == "logit_bias":
            target.clear()
            target.update({i: 0.5 for i in range(k)})  # keys past the vocabulary once k is: invalid either way
        else:
            _replace(target, [entry(i, limits) for i in range(k)])
        return f"{name} x{k}"
    return mutate


def _stop_chars(draw: st.DrawFn, msg: Message, limits: Limits, extra: _Extra) -> str:
    name, k = draw(st.sampled_from(["stop", "stop_regex"])), draw(st.sampled_from(lv.around(limits.max_stop_chars)))
    getattr(_sampling(msg), name).append("a" * k)
    return f"{name}[-1] of {k} chars"


def _logprob_ids(draw: st.DrawFn, msg: Message, limits: Limits, extra: _Extra) -> str:
    k = draw(st.sampled_from(lv.around(limits.max_logprob_token_ids)))
    msg.return_logprob = True  # type: ignore[attr-defined]
    _replace(msg.token_ids_logprob, [i % limits.vocab_size for i in range(k)])  # type: ignore[attr-defined]
    return f"token_ids_logprob x{k}"


def _top_logprobs(draw: st.DrawFn, msg: Message, limits: Limits, extra: _Extra) -> str:
    v = draw(st.sampled_from([*lv.around(limits.max_top_logprobs)[:3], 1000, 2**31 - 1, -1]))
    if isinstance(msg, generate_pb2.GenerateRequest):
        msg.return_logprob, msg.top_logprobs_num = True, v
    elif isinstance(msg, openai_pb2.CompleteRequest):
        msg.logprobs = v
    elif isinstance(msg, openai_pb2.ChatCompleteRequest):
        msg.logprobs, msg.top_logprobs = True, v
    return f"top logprobs={v}"


def _media_items(draw: st.DrawFn, msg: Message, limits: Limits, extra: _Extra) -> str:
    k = draw(st.sampled_from(lv.around(limits.max_media_items)))
    if isinstance(msg, openai_pb2.ChatCompleteRequest):
        part = openai_pb2.ContentPart(type="image_url", image_url=openai_pb2.ImageUrl(url="data:image/png;base64,iVBO"))
        msg.messages[0].ClearField("content")
        _replace(msg.messages[0].content_parts, [openai_pb2.ContentPart(type="text", text="Hi")] + [part] * k)
        return f"image_url parts x{k}"
    name = draw(st.sampled_from(["image_data", "audio_data"]))
    _replace(getattr(msg, name), [generate_pb2.MediaList(items=[generate_pb2.MediaItem(data=b"\x89PNG")] * k)])
    return f"{name}[0].items x{k}"


def _id_count(draw: st.DrawFn, msg: Message, limits: Limits, extra: _Extra) -> str:
    k = draw(st.sampled_from([10, 1000, 10**4, 10**5, 10**6]))
    if isinstance(msg, generate_pb2.GenerateRequest):  # a prompt that fills the context, or more: refused unread
        k = draw(st.sampled_from([limits.max_context_length, limits.max_context_length + 1, 10**5, 10**6]))
    if isinstance(msg, generate_pb2.AbortRequest):
        k = min(k, 10**5)  # each id is a few bytes: 10^6 would pass the message limit
        _replace(msg.rid, [f"r{i}" for i in range(k)])
        return f"rid x{k}"
    ids = [i % limits.vocab_size for i in range(k)]
    if isinstance(msg, generate_pb2.DetokenizeRequest):
        _replace(msg.token_ids, ids)
        return f"token_ids x{k}"
    _replace(msg.input_ids[0].ids, ids)  # type: ignore[attr-defined]
    return f"input_ids[0] of {k} ids"


# ---- grammars ----------------------------------------------------------------------------------------------------


def _constraint(draw: st.DrawFn, msg: Message, kinds: list[str]) -> str:
    """One of `kinds` of structured-output constraint that the request takes (structural_tag: Generate only)."""
    if not isinstance(msg, generate_pb2.GenerateRequest):
        kinds = [k for k in kinds if k != "structural_tag"]
    return draw(st.sampled_from(kinds))


def _json_depth(draw: st.DrawFn, msg: Message, limits: Limits, extra: _Extra) -> str:
    limit = limits.max_grammar_depth
    d = draw(st.sampled_from(sorted({*lv.DEPTHS, limit - 1, limit, limit + 1})))
    shape = draw(st.sampled_from(["object", "array", "mixed", "anyOf", "raw"]))
    schema = lv.nested_schema(d, shape)
    if _constraint(draw, msg, ["json_schema", "structural_tag"]) == "structural_tag":
        _sampling(msg).structural_tag = ('{"type": "structural_tag", "triggers": ["<f>"], "structures": [{"begin": '
                                         f'"<f>", "end": "</f>", "schema": {schema}}}]}}')
        return f"structural_tag schema {shape} x{d}"
    _sampling(msg).json_schema = schema
    return f"json_schema {shape} x{d}"


def _struct_depth(draw: st.DrawFn, msg: Message, limits: Limits, extra: _Extra) -> str:
    d = draw(st.sampled_from(lv.DEPTHS))
    where = draw(st.sampled_from(["response_format"] + ["tools"] * isinstance(msg, openai_pb2.ChatCompleteRequest)))
    number, ld = msg.DESCRIPTOR.fields_by_name[where].number, lv.ld
    if where == "tools":  # Tool{type 1, function 2: FunctionDefinition{name 1, parameters 3}}
        extra.payload += ld(number, ld(1, b"function") + ld(2, ld(1, b"f") + ld(3, lv.deep_struct(d))))
    else:  # ResponseFormat{type 1, json_schema 2: JsonSchemaFormat{name 1, schema 3}}
        extra.payload += ld(number, ld(1, b"json_schema") + ld(2, ld(1, b"s") + ld(3, lv.deep_struct(d))))
    return f"{where} Struct schema x{d}"


def _ebnf_rules(draw: st.DrawFn, msg: Message, limits: Limits, extra: _Extra) -> str:
    limit = limits.max_grammar_rules
    k = draw(st.sampled_from(sorted({*lv.RULES, limit - 1, limit, limit + 1})))
    _sampling(msg).ebnf = lv.chain_ebnf(k)
    return f"ebnf chain of {k} rules"


def _parens(draw: st.DrawFn, msg: Message, limits: Limits, extra: _Extra) -> str:
    d, kind = draw(st.sampled_from(lv.DEPTHS)), draw(st.sampled_from(["ebnf", "regex"]))
    setattr(_sampling(msg), kind, lv.parens(kind, d))
    return f"{kind} parentheses x{d}"


def _grammar_edge(draw: st.DrawFn, msg: Message, limits: Limits, extra: _Extra) -> str:
    kind, text = draw(st.sampled_from(lv.EDGES))
    setattr(_sampling(msg), kind, text)
    return f"{kind} {text[:40]!r}"


def _grammar_bytes(draw: st.DrawFn, msg: Message, limits: Limits, extra: _Extra) -> str:
    size = draw(st.sampled_from(lv.around(limits.max_grammar_bytes)[:4]))  # 100x would pass 4 MiB
    kind, form = _constraint(draw, msg, ["regex", "ebnf", "json_schema"]), draw(st.sampled_from(["literal", "alt"]))
    text = lv.sized_grammar(kind, "alternation" if form == "alt" else form, size)
    setattr(_sampling(msg), kind, text)
    return f"{kind} {form} of {len(text)} bytes"


# ---- strings -----------------------------------------------------------------------------------------------------


def _long_string(draw: st.DrawFn, msg: Message, limits: Limits, extra: _Extra) -> str:
    path, unit = draw(st.sampled_from(lv.string_paths(msg.DESCRIPTOR))), draw(st.sampled_from(lv.UNITS))
    k = draw(st.sampled_from([*(10**i for i in range(1, 7)), limits.max_request_id_chars + 1,
                              limits.max_adapter_name_chars + 1, limits.max_stop_chars + 1]))
    lv.set_string(msg, path, lambda _: lv.long_text(unit, k))
    return f"{'.'.join(path)} = {unit!r} x{k} chars"


def _control_char(draw: st.DrawFn, msg: Message, limits: Limits, extra: _Extra) -> str:
    path, char = draw(st.sampled_from(lv.string_paths(msg.DESCRIPTOR))), draw(st.sampled_from(lv.CONTROLS))
    where = draw(st.sampled_from([0, 1, 2]))

    def insert(text: str) -> str:
        text = text or "ab"
        at = (0, len(text) // 2, len(text))[where]
        return text[:at] + char + text[at:]
    lv.set_string(msg, path, insert)
    return f"{'.'.join(path)} with {char!r} at {('start', 'middle', 'end')[where]}"


def _rid_header(draw: st.DrawFn, msg: Message, limits: Limits, extra: _Extra) -> str:
    k = draw(st.sampled_from([*lv.around(limits.max_request_id_chars)[:3], 1000, 4000]))  # under 8 KiB of metadata
    extra.metadata.append(("x-request-id", draw(st.sampled_from(["r", "a b", "~"])) * k))
    return f"x-request-id of {k} chars"


def _none(draw: st.DrawFn, msg: Message, limits: Limits, extra: _Extra) -> str:
    return "template as is"


_GEN = (generate_pb2.GenerateRequest, openai_pb2.CompleteRequest, openai_pb2.ChatCompleteRequest)
_GRPC = (*_GEN, generate_pb2.TokenizeRequest, generate_pb2.DetokenizeRequest, generate_pb2.AbortRequest)
# kind -> (its mutation, the request types it applies to)
KINDS: dict[str, tuple[Mutation, tuple[type[Message], ...]]] = {
    "none": (_none, _GRPC),
    "outputs": (_outputs, _GEN),
    "logit_bias": (_sized("logit_bias", lambda lim: lim.max_logit_bias, lambda i, lim: 0), _GEN),
    "stop": (_sized("stop", lambda lim: lim.max_stop, lambda i, lim: f"s{i}"), _GEN),
    "stop_token_ids": (_sized("stop_token_ids", lambda lim: lim.max_stop, lambda i, lim: i % lim.vocab_size), _GEN),
    "stop_regex": (_sized("stop_regex", lambda lim: lim.max_stop, lambda i, lim: f"q{i}z"), _GEN),
    "stop_chars": (_stop_chars, _GEN),
    "token_ids_logprob": (_logprob_ids, (generate_pb2.GenerateRequest,)),
    "top_logprobs": (_top_logprobs, _GEN),
    "media_items": (_media_items, (generate_pb2.GenerateRequest, openai_pb2.ChatCompleteRequest)),
    "id_count": (_id_count, (generate_pb2.DetokenizeRequest, generate_pb2.AbortRequest)),
    "json_depth": (_json_depth, _GEN),
    "struct_depth": (_struct_depth, (openai_pb2.CompleteRequest, openai_pb2.ChatCompleteRequest)),
    "ebnf_rules": (_ebnf_rules, _GEN),
    "nested_parens": (_parens, _GEN),
    "grammar_edge": (_grammar_edge, _GEN),
    "grammar_bytes": (_grammar_bytes, _GEN),
    "long_string": (_long_string, (Message,)),
    "control_char": (_control_char, (Message,)),
    "rid_header": (_rid_header, _GEN),
}


@dataclass(frozen=True)
class LimitCase:
    case: Case  # what is sent
    template: str  # which template it started from
    kind: str  # its mutation's kind; "mixed" for several
    label: str  # what was done to it

    def __repr__(self) -> str:  # hypothesis prints a failing case: not its megabytes
        return f"LimitCase({self.template}: {self.label}; {len(self.case.payload)} bytes)"


@st.composite
def limit_cases(draw: st.DrawFn, limits: Limits, timeout: float) -> LimitCase:
    """A template (with the API key, a stream or not, 1-4 new tokens) and one to three mutations."""
    template = draw(st.sampled_from(_WEIGHTED))
    msg = TEMPLATES[template](draw(st.booleans()), draw(st.integers(1, 4)))
    kinds = [k for k, (_, types) in KINDS.items() if isinstance(msg, types)
             and (lv.string_paths(msg.DESCRIPTOR) or k not in ("long_string", "control_char"))]
    if isinstance(msg, generate_pb2.GenerateRequest) and msg.input_ids:
        kinds.append("id_count")  # a prompt of 10^6 token ids
    extra, labels, chosen = _Extra(), [], []
    for _ in range(draw(st.sampled_from([1, 1, 1, 1, 1, 1, 2, 2, 3]))):
        chosen.append(draw(st.sampled_from(kinds)))
        labels.append(KINDS[chosen[-1]][0](draw, msg, limits, extra))
    payload = msg.SerializeToString(deterministic=True) + extra.payload
    case = Case(_METHODS[template.split(".")[0]], payload, True, timeout, tuple(extra.metadata))
    return LimitCase(case, template, chosen[0] if len(set(chosen)) == 1 else "mixed", "; ".join(labels))


def warm_up_cases(timeout: float = 60.0) -> list[LimitCase]:
    """Each template once as it is: a valid call (LoRA ones: NOT_FOUND, the root is empty)."""
    return [LimitCase(Case(_METHODS[name.split(".")[0]], make(False, 2).SerializeToString(), True, timeout), name,
                      "warm-up", "template as is") for name, make in TEMPLATES.items()]


class LimitRun:
    """Sends limit cases with a WireFuzzer and keeps what a limits run reports: codes by kind, the slowest call and
    the slowest refused one, every FORBIDDEN status with its request (each distinct one once, counted)."""

    def __init__(self, fuzzer: WireFuzzer) -> None:
        self.fuzzer = fuzzer
        self.by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.seconds: dict[str, float] = collections.defaultdict(float)  # wall time by kind
        self.slowest: list[tuple[float, str, str]] = []  # the five slowest calls: (seconds, code, request)
        # The slowest refusal (a code neither OK nor DEADLINE_EXCEEDED, which is the client's deadline), and the
        # number of refusals slower than a second: a request past a limit should be refused before any work.
        self.slowest_refused: tuple[float, str, str] = (0.0, "", "")
        self.slow_refusals = 0
        self.forbidden: dict[tuple[str, str, str], tuple[int, str]] = {}  # (method, code, message) -> (n, request)

    def send(self, lc: LimitCase) -> grpc.StatusCode:
        code = self.fuzzer.send(lc.case)
        seconds, request = self.fuzzer.last_seconds, f"{lc.template}: {lc.label}"
        self.by_kind[lc.kind][code.name] += 1
        self.seconds[lc.kind] += seconds
        self.slowest = sorted([*self.slowest, (seconds, code.name, request)], reverse=True)[:5]
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED):
            self.slow_refusals += int(seconds > 1.0)
            if seconds > self.slowest_refused[0]:
                self.slowest_refused = (seconds, code.name, request)
        if code in FORBIDDEN:
            key = (lc.template.split(".")[0], code.name, self.fuzzer.last_details[:160])
            count, first = self.forbidden.get(key, (0, request))
            self.forbidden[key] = (count + 1, first)
        return code

    def summary(self) -> dict[str, Any]:
        return {"by_kind": {k: dict(c) for k, c in sorted(self.by_kind.items())},
                "seconds_by_kind": {k: round(s, 1) for k, s in sorted(self.seconds.items(), key=lambda i: -i[1])},
                "slowest": [{"seconds": round(s, 3), "code": c, "request": r[:300]} for s, c, r in self.slowest],
                "slowest_refused": {"seconds": round(self.slowest_refused[0], 3), "code": self.slowest_refused[1],
                                    "request": self.slowest_refused[2][:300]},
                "refusals_over_1s": self.slow_refusals,
                "forbidden": [{"method": m, "code": c, "message": msg, "count": n, "request": r[:300]}
                              for (m, c, msg), (n, r) in self.forbidden.items()]}

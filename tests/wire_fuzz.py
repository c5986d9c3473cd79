"""Hypothesis strategies for requests of every lmrpc RPC (and health, reflection), sent over the wire as bytes, and
the checks a fuzz run makes: no call ends INTERNAL, UNKNOWN or UNAVAILABLE (a crash or a dead server), and once the
run is over the server is serving with no output running and no KV page held.

A request is a random message of the method's type built from its descriptor (every field, random presence, values
at and beyond their ranges, nested messages, maps, google.protobuf.Struct), or one with a repeated field made huge,
or one with a string field's bytes made invalid UTF-8, or random bytes. tests/e2e/test_fuzz.py runs a few hundred
cases in CI; bench/fuzz.py runs thousands.
"""

from __future__ import annotations

import collections
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import strategies as st

from lmrpc.v1 import generate_pb2, openai_pb2

F = FieldDescriptor
FORBIDDEN = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE,
                       grpc.StatusCode.DATA_LOSS})
MAX_DEPTH = 3  # nesting of generated messages
INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
# Strings that mean something to some field: schemas, patterns, grammars, roles, names, JSON.
MEANINGFUL = ("", " ", "user", "assistant", "system", "tool", "function", "auto", "none", "required", "text",
              "json_object", "json_schema", "structural_tag", "SmolLM2-135M-Instruct", "base:adapter",
              '{"type": "object"}', '{"type": "string", "maxLength": 3}', '{"type": "objekt"}', "{", "[a-z]+", "(a",
              "root ::= \"yes\" | \"no\"", "root ::= ", "disallowed_tokens", "<tool_call>", "\x00", "\ud7ff\ue000",
              "Hello", "The capital of France is", "x" * 300)


# Fields that mostly end a request early (media on the text-only model, embeddings of a random width:
# INVALID_ARGUMENT; a model name: NOT_FOUND) are set rarely, so that
# most requests get past them to the rules and the engine behind.
RARE_FIELDS = frozenset({"input_embeds", "image_data", "audio_data", "lora_path", "return_hidden_states",
                         "return_routed_experts", "model", "custom_logit_processor"})


@dataclass(frozen=True)
class Method:
    """One RPC of the server, as the fuzz calls it."""

    path: str  # /package.Service/Method
    request: type[Message]  # its request type
    streaming: str  # "unary", "server" (unary request, stream of responses) or "bidi"


METHODS: tuple[Method, ...] = (
    *(Method(f"/lmrpc.v1.GenerateService/{m.name}", message_factory.GetMessageClass(m.input_type),
             "server" if m.server_streaming else "unary")
      for m in generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].methods),
    *(Method(f"/lmrpc.v1.OpenAIService/{m.name}", message_factory.GetMessageClass(m.input_type),
             "server" if m.server_streaming else "unary")
      for m in openai_pb2.DESCRIPTOR.services_by_name["OpenAIService"].methods),
    Method("/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest, "unary"),
    Method("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", reflection_pb2.ServerReflectionRequest,
           "bidi"),
)


# ---- values ----------------------------------------------------------------------------------------------------


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = [v for v in (0, 1, -1, 2, 16, 128, 4096, 49151, 49152, 100_000, lo, hi, lo + 1, hi - 1) if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi), st.integers(max(lo, -5), min(hi, 300)))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        return _ints(*INT32)
    if t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
        return _ints(*INT64)
    if t in (F.TYPE_UINT32, F.TYPE_FIXED32):
        return _ints(0, 2**32 - 1)
    if t in (F.TYPE_UINT64, F.TYPE_FIXED64):
        return _ints(0, 2**64 - 1)
    if t == F.TYPE_FLOAT:
        return st.one_of(st.floats(width=32), st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 1e-7, 1e30]))
    if t == F.TYPE_DOUBLE:
        return st.floats()
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return st.one_of(st.sampled_from(MEANINGFUL), st.text(max_size=40), st.text(max_size=2000))
    if t == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == F.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), _ints(*INT32))  # proto3 enums are open: unknown numbers parse
    raise AssertionError(f"no strategy for field type {t} ({field.full_name})")


_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20)),
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=10), children,
                                                                              max_size=4)),
    max_leaves=20)


@st.composite
def _struct(draw: st.DrawFn, cls: type[Message]) -> Message:
    msg = cls()
    msg.update(draw(st.dictionaries(st.text(max_size=12), _JSON, max_size=5)))  # type: ignore[attr-defined]
    return msg


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def _repeated(field: FieldDescriptor) -> bool:
    return bool(field.is_repeated)


@st.composite
def message(draw: st.DrawFn, descriptor: Descriptor, depth: int = 0) -> Message:
    """A random message of `descriptor`'s type: each field set or not, oneofs one member at most."""
    cls = message_factory.GetMessageClass(descriptor)
    if descriptor.full_name == "google.protobuf.Struct":
        return draw(_struct(cls))
    msg = cls()
    if descriptor.full_name in ("google.protobuf.Value", "google.protobuf.ListValue"):
        return msg  # reached only through Struct, which builds its own
    for field in descriptor.fields:
        rare = field.name in RARE_FIELDS
        if not draw(st.integers(0, 99)) < (5 if rare else 40):
            continue
        if field.containing_oneof is not None and msg.WhichOneof(field.containing_oneof.name) is not None:
            continue
        _set(draw, msg, field, depth)
    return msg


def _set(draw: st.DrawFn, msg: Message, field: FieldDescriptor, depth: int) -> None:
    name = field.name
    if _is_map(field):
        key_field, value_field = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        target = getattr(msg, name)
        for key in draw(st.lists(_scalar(key_field), max_size=4)):
            if value_field.message_type is not None:
                if depth < MAX_DEPTH:
                    target[key].CopyFrom(draw(message(value_field.message_type, depth + 1)))
            else:
                target[key] = draw(_scalar(value_field))
        return
    if field.message_type is not None:
        if depth >= MAX_DEPTH:
            return
        if _repeated(field):
            for item in draw(st.lists(message(field.message_type, depth + 1), max_size=3)):
                getattr(msg, name).add().CopyFrom(item)
        else:
            getattr(msg, name).CopyFrom(draw(message(field.message_type, depth + 1)))
        return
    if _repeated(field):
        getattr(msg, name).extend(draw(st.lists(_scalar(field), max_size=6)))
    else:
        setattr(msg, name, draw(_scalar(field)))


# ---- requests as bytes -----------------------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _string_fields(descriptor: Descriptor) -> list[int]:
    return [f.number for f in descriptor.fields if f.type == F.TYPE_STRING]


_PROMPTS = st.one_of(st.sampled_from(["Hello", "The capital of France is", "1, 2, 3,", ""]), st.text(max_size=60))
# Mostly in range, now and then not (the rules' errors are part of the run too).
_SMALL = st.one_of(*[st.integers(1, 16)] * 9, st.integers(-2, 0))
_UNIT = st.one_of(*[st.sampled_from([0.0, 0.5, 1.0])] * 9, st.floats(-1, 3, width=32))


@dataclass(frozen=True)
class _Knobs:
    """The values a plausible request draws from: sloppy ones sometimes fall out of range, valid ones never do."""

    prompts: st.SearchStrategy[str]
    small: st.SearchStrategy[int]  # max new tokens
    unit: st.SearchStrategy[float]  # temperature
    n: st.SearchStrategy[int]
    top_logprobs: st.SearchStrategy[int]
    constraints: st.SearchStrategy[tuple[str, str] | None]  # (field, value)
    roles: st.SearchStrategy[str]
    priority: st.SearchStrategy[int]


_SLOPPY = _Knobs(prompts=_PROMPTS, small=_SMALL, unit=_UNIT, n=st.sampled_from([1, 1, 2, 3, 0]),
                 top_logprobs=st.sampled_from([0, 0, 2, 5, 21]),
                 constraints=st.sampled_from([None, None, None, ("regex", "[a-z ]+"),
                                              ("json_schema", '{"type": "object"}'), ("regex", "(a")]),
                 roles=st.sampled_from(["user"] * 6 + ["assistant", "system", "tool", "bogus"]),
                 priority=st.integers(*INT32))
_VALID = _Knobs(prompts=st.sampled_from(["Hello", "The capital of France is", "1, 2, 3,"]), small=st.integers(1, 8),
                unit=st.sampled_from([0.0, 0.5, 1.0]), n=st.sampled_from([1, 1, 2]),
                top_logprobs=st.sampled_from([0, 2, 5]),
                constraints=st.sampled_from([None, None, ("regex", "[a-z ]+"), ("json_schema", '{"type": "object"}')]),
                roles=st.sampled_from(["user", "user", "system"]), priority=st.integers(-100, 100))


@st.composite
def _plausible(draw: st.DrawFn, method: Method, knobs: _Knobs) -> Message | None:
    """A request of a generating RPC that passes validation (knobs=_VALID) or often does (_SLOPPY: sometimes one
    value out of range), so that a fuzz run also drives the engine: streams, n > 1, logprobs, stops, constraints."""
    name = method.path.rsplit("/", 1)[1]
    constraint = draw(knobs.constraints)
    if name == "Generate":
        sp = generate_pb2.SamplingParams(max_new_tokens=draw(knobs.small), temperature=draw(knobs.unit),
                                         n=draw(knobs.n),
                                         stop=draw(st.lists(st.sampled_from(["\n", ".", " the", ""]), max_size=2)))
        if constraint is not None:
            setattr(sp, constraint[0], constraint[1])
        req = generate_pb2.GenerateRequest(text=draw(st.lists(knobs.prompts, min_size=1, max_size=3)),
                                           sampling_params=[sp], stream=draw(st.booleans()),
                                           return_logprob=draw(st.booleans()),
                                           top_logprobs_num=draw(knobs.top_logprobs))
        if draw(st.booleans()):
            req.priority = draw(knobs.priority)
        return req
    if name == "Complete":
        creq = openai_pb2.CompleteRequest(prompt=draw(st.lists(knobs.prompts, min_size=1, max_size=2)),
                                          max_tokens=draw(knobs.small), temperature=draw(knobs.unit),
                                          n=draw(knobs.n), stream=draw(st.booleans()), echo=draw(st.booleans()))
        if draw(st.booleans()):
            creq.logprobs = draw(knobs.top_logprobs)
        if constraint is not None:
            setattr(creq, constraint[0], constraint[1])
        return creq
    if name == "ChatComplete":
        messages = draw(st.lists(st.builds(lambda r, c: openai_pb2.ChatMessage(role=r, content=c), knobs.roles,
                                           knobs.prompts), min_size=1, max_size=3))
        chat = openai_pb2.ChatCompleteRequest(messages=messages, max_tokens=draw(knobs.small),
                                              temperature=draw(knobs.unit), stream=draw(st.booleans()),
                                              logprobs=draw(st.booleans()))
        if draw(st.booleans()):
            chat.top_logprobs = draw(knobs.top_logprobs)
        return chat
    return None


@st.composite
def request_bytes(draw: st.DrawFn, method: Method) -> bytes:
    """Bytes for `method`: a random message (usually), a valid or plausible one (generating RPCs), one with a huge
    repeated field, one with bad UTF-8 in a string field, or random bytes."""
    descriptor = method.request.DESCRIPTOR
    # "plausible" first: hypothesis leans to a strategy's first choices when it simplifies.
    kind = draw(st.sampled_from(["valid"] * 4 + ["plausible"] * 2 + ["message"] * 3 + ["huge", "utf8", "garbage"]))
    if kind == "garbage":
        return draw(st.binary(max_size=300))
    knobs = {"valid": _VALID, "plausible": _SLOPPY}.get(kind)
    plausible = draw(_plausible(method, knobs)) if knobs is not None else None
    if plausible is not None:
        return bytes(plausible.SerializeToString(deterministic=True))
    msg = draw(message(descriptor))
    data = msg.SerializeToString(deterministic=True)
    if kind == "huge":
        # A repeated scalar field of the top-level message made long: ~30 KB to ~5 MB on the wire, so past the
        # server's 4 MiB receive limit sometimes.
        repeated = [f for f in descriptor.fields if _repeated(f) and f.message_type is None]
        if repeated:
            field = draw(st.sampled_from(repeated))
            count = draw(st.sampled_from([10_000, 300_000, 1_200_000]))
            if field.type in (F.TYPE_STRING, F.TYPE_BYTES):
                data += (_varint(field.number << 3 | 2) + b"\x01x") * count
            else:
                one = {F.TYPE_FLOAT: struct.pack("<f", 0.5), F.TYPE_DOUBLE: struct.pack("<d", 0.5)}.get(
                    field.type, _varint(7))
                packed = one * count
                data += _varint(field.number << 3 | 2) + _varint(len(packed)) + packed
    elif kind == "utf8":
        numbers = _string_fields(descriptor)
        if numbers:
            bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"ok\xf0\x28\x8c\x28", b"\x80abc"]))
            data += _varint(draw(st.sampled_from(numbers)) << 3 | 2) + _varint(len(bad)) + bad
    return data


GENERATING = frozenset({"Generate", "Complete", "ChatComplete"})  # RPCs that run the model


@dataclass(frozen=True)
class Case:
    method: Method  # what is called
    payload: bytes  # the request's bytes
    with_key: bool  # send the API key (a server without keys ignores it)
    timeout: float  # the call's deadline, seconds
    metadata: tuple[tuple[str, str], ...] = ()  # more metadata sent with it (x-request-id, ...)


def cases(timeouts: tuple[float, ...] = (0.5, 1.5)) -> st.SearchStrategy[Case]:
    """A method, its request's bytes, the key sent nine times in ten, and a deadline. The generating RPCs are drawn
    three times as often as the others, so that a run keeps reaching the model as the contract gains RPCs."""
    weighted = [m for m in METHODS for _ in range(3 if m.path.rsplit("/", 1)[1] in GENERATING else 1)]
    return st.sampled_from(weighted).flatmap(lambda m: st.builds(
        Case, st.just(m), request_bytes(m), st.sampled_from([True] * 9 + [False]), st.sampled_from(timeouts)))


# ---- calling -----------------------------------------------------------------------------------------------------


def _identity(b: bytes) -> bytes:
    return b


class WireFuzzer:
    """Sends cases to a server and counts the status codes they end with."""

    def __init__(self, target: str, api_key: str | None = None, raise_forbidden: bool = True) -> None:
        self.channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20),
                                                              ("grpc.max_send_message_length", 64 << 20)])
        self.api_key = api_key
        # False: a forbidden code is returned like any other (a run that lists every one, tests/limit_fuzz.py);
        # True: it raises, so that hypothesis shrinks the case.
        self.raise_forbidden = raise_forbidden
        self.last_seconds = 0.0  # the last call's wall time
        self.last_details = ""  # the last call's error message ("" when it ended OK)
        self.slowest: tuple[float, str] = (0.0, "")  # the slowest call's wall time and method
        self.codes: collections.Counter[str] = collections.Counter()
        self.by_method: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.messages: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)  # errors

    def close(self) -> None:
        self.channel.close()

    def send(self, case: Case) -> grpc.StatusCode:
        key = (("authorization", f"Bearer {self.api_key}"),) if self.api_key and case.with_key else ()
        metadata = (*key, *case.metadata) or None
        code = grpc.StatusCode.OK
        self.last_details = ""
        started = time.monotonic()
        try:
            if case.method.streaming == "unary":
                call: Callable[..., Any] = self.channel.unary_unary(case.method.path, _identity, _identity)
                call(case.payload, timeout=case.timeout, metadata=metadata)
            elif case.method.streaming == "server":
                stream = self.channel.unary_stream(case.method.path, _identity, _identity)
                for _ in stream(case.payload, timeout=case.timeout, metadata=metadata):
                    pass
            else:
                stream = self.channel.stream_stream(case.method.path, _identity, _identity)
                for _ in stream(iter([case.payload]), timeout=case.timeout, metadata=metadata):
                    pass
        except grpc.RpcError as e:
            code = e.code()  # type: ignore[attr-defined]
            details = e.details()  # type: ignore[attr-defined]
            self.last_details = str(details)
            self.messages[case.method.path.rsplit("/", 1)[1]][f"{code.name}: {str(details)[:90]}"] += 1
            if code in FORBIDDEN and self.raise_forbidden:
                raise AssertionError(f"{case.method.path} ended {code.name}: {details!r} (payload "
                                     f"{case.payload[:200]!r}{'...' if len(case.payload) > 200 else ''})") from None
        finally:
            self.last_seconds = time.monotonic() - started
            if self.last_seconds > self.slowest[0]:
                self.slowest = (self.last_seconds, case.method.path.rsplit("/", 1)[1])
        self.codes[code.name] += 1
        self.by_method[case.method.path.rsplit("/", 1)[1]][code.name] += 1
        return code

    def settled(self, timeout: float = 60.0) -> generate_pb2.GetLoadResponse:
        """Wait until no output runs or waits and no KV page is held; return that reading (raises if it never
        comes: a leak)."""
        metadata = (("authorization", f"Bearer {self.api_key}"),) if self.api_key else None
        get_load = self.channel.unary_unary("/lmrpc.v1.GenerateService/GetLoad",
                                            generate_pb2.GetLoadRequest.SerializeToString,
                                            generate_pb2.GetLoadResponse.FromString)
        deadline = time.monotonic() + timeout
        while True:
            load: generate_pb2.GetLoadResponse = get_load(generate_pb2.GetLoadRequest(), timeout=10,
                                                          metadata=metadata)
            idle = load.running_outputs == 0 and load.waiting_outputs == 0 and load.kv_cache_used_pages == 0
            if idle or time.monotonic() > deadline:
                if not idle:
                    raise AssertionError(f"the server did not settle: {load}")
                return load
            time.sleep(0.25)


"""A fake lmrpc.v1 GenerateService (+ grpc.health.v1) with canned answers, on a loopback port, for client tests.

Prompts drive it: "invalid" is answered INVALID_ARGUMENT with BadRequest details, "fail" ends with finish ERROR,
"slow" streams one delta then waits until the client cancels. Every other text prompt p gets, per sample s,
the pieces PIECES + [f" #{index}"] with token ids [100 + index, 1, 2, 3].
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from lmrpc.v1 import generate_pb2, generate_pb2_grpc

PIECES = ["Paris", ".", " It"]
VIOLATION = ("sampling_params[0].top_p", "must be in (0, 1], got 1.5")


def expected_text(index: int) -> str:
    return "".join(PIECES) + f" #{index}"


def expected_ids(index: int) -> list[int]:
    return [100 + index, 1, 2, 3]


@dataclass
class FakeGenerateService(generate_pb2_grpc.GenerateServiceServicer):
    requests: list[generate_pb2.GenerateRequest] = field(default_factory=list)  # every Generate request seen
    metadata: list[dict[str, str]] = field(default_factory=list)  # invocation metadata of every Generate call
    cancelled: threading.Event = field(default_factory=threading.Event)  # a "slow" call saw its client cancel

    def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext
                 ) -> Iterator[generate_pb2.GenerateResponse]:
        self.requests.append(request)
        self.metadata.append({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
        prompts = list(request.text) or [" ".join(map(str, t.ids)) for t in request.input_ids]
        if "invalid" in prompts:
            context.abort_with_status(rpc_status.to_status(bad_request_status()))
        if "slow" in prompts:
            # The callback runs when the call ends; it can only end by the client cancelling (or a deadline).
            context.add_callback(self.cancelled.set)
            yield generate_pb2.GenerateResponse(index=0, rid="slow", text="x", token_ids=[5])
            while context.is_active():
                time.sleep(0.01)
            return
        n = request.sampling_params[0].n if request.sampling_params and request.sampling_params[0].HasField("n") else 1
        outputs = [(p * n + s, request.rid[p] if request.rid else f"rid-{p}", prompt)
                   for p, prompt in enumerate(prompts) for s in range(n)]
        if request.stream:
            # Round-robin over the outputs so that the client must merge interleaved indices.
            for step in range(len(PIECES) + 1):
                for index, rid, prompt in outputs:
                    yield self._message(request, index, rid, prompt, step)
        else:
            for index, rid, prompt in reversed(outputs):  # out of order: the client sorts by index
                yield self._message(request, index, rid, prompt, None)

    def _message(self, request: generate_pb2.GenerateRequest, index: int, rid: str, prompt: str,
                 step: int | None) -> generate_pb2.GenerateResponse:
        """The streamed piece `step` of one output (the last step finishes), or the whole output (step None)."""
        ids = expected_ids(index)
        pieces = [*PIECES, f" #{index}"]
        last = step is None or step == len(pieces) - 1
        msg = generate_pb2.GenerateResponse(
            index=index, rid=rid,
            text="".join(pieces) if step is None else pieces[step],
            token_ids=ids if step is None else ids[step:step + 1],
        )
        if request.return_logprob:
            for token_id in msg.token_ids:
                pos = msg.output_logprobs.add()
                pos.chosen.token_id, pos.chosen.logprob = token_id, -0.5
                for k in range(request.top_logprobs_num):
                    pos.top.add(token_id=token_id + k, logprob=-0.5 - k)
            if request.HasField("logprob_start_len") and (step is None or step == 0):
                msg.input_logprobs.add().chosen.token_id = 1  # position 0: no logprob
        if last:
            if prompt == "fail":
                msg.finish.reason, msg.finish.message = generate_pb2.FINISH_REASON_ERROR, "boom"
            elif index == 0:
                msg.finish.reason, msg.finish.matched_text = generate_pb2.FINISH_REASON_STOP_STRING, "\n"
            else:
                msg.finish.reason = generate_pb2.FINISH_REASON_LENGTH
            msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_tokens = 3, len(ids), 1
        return msg

    def Abort(self, request: generate_pb2.AbortRequest, context: grpc.ServicerContext
              ) -> generate_pb2.AbortResponse:
        return generate_pb2.AbortResponse(aborted_rid=["r1", "r2"] if request.abort_all else list(request.rid))

    def GetModelInfo(self, request: generate_pb2.GetModelInfoRequest, context: grpc.ServicerContext
                     ) -> generate_pb2.GetModelInfoResponse:
        return generate_pb2.GetModelInfoResponse(
            model_path="/models/fake.gguf", served_model_name="fake", vocab_size=1000, max_context_length=2048,
            eos_token_ids=[2], architecture="LlamaForCausalLM", dtype="float32", device="cpu",
            default_sampling_params=generate_pb2.SamplingParams(temperature=0.5, max_new_tokens=128))

    def Tokenize(self, request: generate_pb2.TokenizeRequest, context: grpc.ServicerContext
                 ) -> generate_pb2.TokenizeResponse:
        special = not request.HasField("add_special_tokens") or request.add_special_tokens
        ids = ([1] if special else []) + [len(w) for w in request.text.split()]
        return generate_pb2.TokenizeResponse(token_ids=ids)

    def Detokenize(self, request: generate_pb2.DetokenizeRequest, context: grpc.ServicerContext
                   ) -> generate_pb2.DetokenizeResponse:
        skip = not request.HasField("skip_special_tokens") or request.skip_special_tokens
        return generate_pb2.DetokenizeResponse(
            text=" ".join(f"w{i}" for i in request.token_ids if not (skip and i == 1)))


def bad_request_status() -> status_pb2.Status:
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.BadRequest(field_violations=[
        error_details_pb2.BadRequest.FieldViolation(field=VIOLATION[0], description=VIOLATION[1])]))
    return status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message="invalid sampling parameters", details=[detail])


@contextmanager
def running_fake_server(serving: bool = True) -> Iterator[tuple[str, FakeGenerateService]]:
    """Start the fake on 127.0.0.1:<free port>; yield (target, servicer)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    service = FakeGenerateService()
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING if serving
                        else health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", service
    finally:
        server.stop(grace=None)

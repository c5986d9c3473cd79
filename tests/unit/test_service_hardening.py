"""The service's hardening over the fake engine, on a real grpc.aio server: API keys, undecodable requests, the
stalled-stream timeout, the per-client queue cap, GetLoad and its ORCA trailer; and the watchdog over a fake engine.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import shutil
import struct
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import cast

import grpc
import pytest
from fake_engine import HANG, FakeEngine, ids_request
from google.rpc import error_details_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from lmrpc.server import auth, load
from lmrpc.server.auth import ApiKeys, AuthInterceptor
from lmrpc.server.config import EngineConfig, SchedulerConfig, ServerConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.types import EngineStats
from lmrpc.server.frontend import Frontend
from lmrpc.server.generate.service import GenerateService
from lmrpc.server.watchdog import EngineState, Watchdog
from lmrpc.server.wire import WireInterceptor
from lmrpc.v1 import generate_pb2, generate_pb2_grpc

KEY = "s3cret-key-0123456789"


@asynccontextmanager
async def served(engine: FakeEngine, *, keys: ApiKeys | None = None, stall: float = 30.0,
                 per_client: int | None = None, max_running: int = 8,
                 channel_options: list[tuple[str, int]] | None = None,
                 ) -> AsyncIterator[tuple[grpc.aio.Channel, Frontend, int]]:
    """GenerateService over `engine` with the production interceptors, plus health."""
    engine_config = EngineConfig(scheduler=SchedulerConfig(max_running_requests=max_running),
                                 sampling_defaults="openai")
    server_config = ServerConfig(host="127.0.0.1", port=0, api_keys=keys, stalled_stream_timeout=stall,
                                 max_queued_per_client=per_client)
    frontend = Frontend(cast(AsyncEngine, engine), engine_config, server_config)
    interceptors: list[grpc.aio.ServerInterceptor] = [AuthInterceptor(keys)] if keys is not None else []
    interceptors.append(WireInterceptor(report=frontend.report_load, stall_timeout=stall))
    server = grpc.aio.server(interceptors=interceptors)
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(GenerateService(frontend), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options) as channel:
            yield channel, frontend, port
    finally:
        await server.stop(grace=None)


# ---- API keys --------------------------------------------------------------------------------------------------


def test_key_file_parsing(tmp_path: Path) -> None:
    good = tmp_path / "keys"
    good.write_text("# team keys\n\n  first-key-aaaaaaaa  \nsecond-key-bbbbbbbb\n")
    keys = ApiKeys.read(str(good))
    assert keys.accepts("first-key-aaaaaaaa") and keys.accepts("second-key-bbbbbbbb")
    assert not keys.accepts("first-key-aaaaaaa") and not keys.accepts("")
    assert "first" not in repr(keys) and repr(keys) == "ApiKeys(2 keys)"
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        ApiKeys.read(str(empty))
    spaced = tmp_path / "spaced"
    spaced.write_text("zebra quokka\n")
    with pytest.raises(ValueError, match="line 1") as info:
        ApiKeys.read(str(spaced))
    assert "zebra" not in str(info.value) and "quokka" not in str(info.value)  # never echo a key
    with pytest.raises(ValueError, match="cannot read"):
        ApiKeys.read(str(tmp_path / "missing"))


def test_client_identity() -> None:
    keys = ApiKeys.of([KEY])
    by_key = auth.client_identity([("authorization", f"Bearer {KEY}")], "ipv4:10.0.0.1:1234", keys)
    assert by_key.startswith("key:") and KEY not in by_key
    assert auth.client_identity([], "ipv4:10.0.0.1:1234", keys) == "peer:ipv4:10.0.0.1"
    assert auth.client_identity([], "ipv6:[::1]:55", None) == "peer:ipv6:[::1]"
    # Without keys required, a header proves nothing: the peer is the identity.
    assert auth.client_identity([("authorization", f"Bearer {KEY}")], "ipv4:10.0.0.1:1", None) == "peer:ipv4:10.0.0.1"


async def test_calls_need_a_key_health_does_not() -> None:
    async with served(FakeEngine(), keys=ApiKeys.of([KEY, "other-key-cccccccc"])) as (channel, _, _port):
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        for metadata in (None, (("authorization", "Bearer wrong-key-xxxxxxxx"),), (("authorization", KEY),)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "Bearer" in (info.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Generate(ids_request([5, 6]), metadata=metadata):
                    pass
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = (("authorization", f"Bearer {KEY}"),)
        assert (await stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), metadata=good)).vocab_size == 1000
        other = (("authorization", "bearer other-key-cccccccc"),)  # either key; the scheme is case-insensitive
        assert [m async for m in stub.Generate(ids_request([5, 6]), metadata=other)]
        check = health_pb2_grpc.HealthStub(channel).Check
        assert (await check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING


# ---- the wire ------------------------------------------------------------------------------------------------------


async def test_undecodable_requests_are_invalid_argument_not_unknown() -> None:
    async with served(FakeEngine()) as (channel, _, _port):
        for method in ("/lmrpc.v1.GenerateService/Tokenize", "/lmrpc.v1.GenerateService/Generate",
                       "/grpc.health.v1.Health/Check"):
            for payload in (b"\x0a\x02\xff\xfe", b"\x0a\x05ab", b"\xff\xff\xff"):
                if method.endswith("Generate"):
                    call = channel.unary_stream(method)(payload)
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        async for _ in call:
                            pass
                else:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await channel.unary_unary(method)(payload)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, payload, info.value)
                assert "is not a valid" in (info.value.details() or "")


async def test_a_stream_the_client_does_not_read_ends_resource_exhausted() -> None:
    engine = FakeEngine()
    # A small receive window: the client's gRPC stops taking data after a few KB, as a client that stops reading.
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    async with served(engine, stall=1.0, channel_options=options) as (channel, _, _port):
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        big = generate_pb2.GenerateRequest(input_ids=[generate_pb2.TokenIds(ids=[5] * 1500)], stream=True,
                                           return_text_in_logprobs=True)
        call = stub.Generate(big)
        first = await call.read()
        assert first.token_ids
        await asyncio.sleep(3)  # read nothing: the server's write waits, then times out
        assert engine.live == {}, "the stalled call's engine requests were aborted"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while await call.read() is not grpc.aio.EOF:
                pass
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "stream stalled" in (info.value.details() or "")
        # Others are served meanwhile and after.
        assert [m async for m in stub.Generate(ids_request([5, 6], stream=True))]


@pytest.mark.parametrize("leave_after", [2.5, 1.0])  # after the stall's abort began; about when the stall is seen
async def test_a_stalled_client_that_leaves_is_one_warning_line_not_a_traceback(
        leave_after: float, caplog: pytest.LogCaptureFixture) -> None:
    """A client that stops reading and then disconnects: the stalled write or the abort's status fails in gRPC's
    core, which gRPC logged as an ERROR with a traceback (found by a hostile client). It is the client's fault: one
    WARNING line per stalled call, no traceback, and the call's engine requests are aborted all the same."""
    caplog.set_level(logging.WARNING)
    engine = FakeEngine()
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    big = generate_pb2.GenerateRequest(input_ids=[generate_pb2.TokenIds(ids=[5] * 1500)] * 2, stream=True,
                                       return_text_in_logprobs=True)
    async with served(engine, stall=0.5) as (_, _, port):
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options)
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        calls = [stub.Generate(big) for _ in range(3)]
        await asyncio.sleep(leave_after)  # reads nothing, then goes away
        await channel.close()
        for _ in range(50):
            if engine.live == {}:
                break
            await asyncio.sleep(0.1)
        assert engine.live == {}, "the stalled calls' engine requests were aborted"
        del calls
        await asyncio.sleep(0.5)  # the server's handlers finish
    loud = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not loud, [f"{r.name}: {r.getMessage()}" for r in loud]
    stalls = [r for r in caplog.records if r.name == "lmrpc.server.wire"]
    assert stalls and all(r.levelno == logging.WARNING and "stream stalled" in r.getMessage() for r in stalls)
    assert len(stalls) <= 3  # at most one line per call (a call may have seen the client leave first)


# ---- per-client cap ------------------------------------------------------------------------------------------------


async def test_one_client_cannot_fill_the_queue() -> None:
    engine = FakeEngine(max_running=2)
    async with served(engine, per_client=2, max_running=2) as (channel, _, _port):
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        hung = [stub.Generate(ids_request([HANG, 1], stream=True)) for _ in range(4)]  # 2 running + 2 queued
        for call in hung:
            await call.read()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Generate(ids_request([5, 6])):
                pass
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-queued-per-client" in (info.value.details() or "")
        status = rpc_status.from_call(info.value)
        assert status is not None
        retry = error_details_pb2.RetryInfo()
        assert status.details[0].Unpack(retry) and retry.retry_delay.seconds == 1
        for call in hung:
            call.cancel()
        await asyncio.sleep(0.1)
        assert [m async for m in stub.Generate(ids_request([5, 6]))]


# ---- load ----------------------------------------------------------------------------------------------------------


def _wire_fields(data: bytes) -> dict[int, list[bytes | float]]:
    """A minimal protobuf wire reader, independent of the encoder under test: field -> values (doubles, or bytes)."""
    out: dict[int, list[bytes | float]] = {}
    i = 0
    while i < len(data):
        key, shift = 0, 0
        while True:
            b = data[i]
            i += 1
            key |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        number, kind = key >> 3, key & 7
        if kind == 1:
            out.setdefault(number, []).append(struct.unpack("<d", data[i:i + 8])[0])
            i += 8
        elif kind == 2:
            length = data[i]
            i += 1
            out.setdefault(number, []).append(data[i:i + length])
            i += length
        else:
            raise AssertionError(f"unexpected wire type {kind}")
    return out


def _map(entries: list[bytes | float]) -> dict[str, float]:
    result = {}
    for entry in entries:
        assert isinstance(entry, bytes)
        fields = _wire_fields(entry)
        key, value = fields[1][0], fields[2][0]
        assert isinstance(key, bytes) and isinstance(value, float)
        result[key.decode()] = value
    return result


def test_orca_report_has_the_published_field_numbers() -> None:
    reading = load.Load(running=4, waiting=2, paused=0, kv_usage=0.25, num_pages=100, used_pages=25,
                        generation_tokens_per_second=10.0, prompt_tokens_per_second=50.0, queue_time_p50=0.5,
                        resident_bytes=1 << 30, memory_limit_bytes=4 << 30, max_running=8)
    fields = _wire_fields(load.orca_report(reading))
    assert fields[9] == [pytest.approx(0.5 + 0.25)]  # application_utilization: running share 4/8 + queue 2/8
    assert fields[2] == [pytest.approx(0.25)]  # mem_utilization: 1 GiB of 4
    assert _map(fields[5]) == {"kv_cache": 0.25}  # utilization
    assert _map(fields[8]) == {"running_outputs": 4.0, "waiting_outputs": 2.0, "generation_tokens_per_second": 10.0,
                               "queue_time_p50_seconds": 0.5}  # named_metrics


def test_tracker_rates_and_median() -> None:
    now = [1000.0]
    tracker = load.LoadTracker(clock=lambda: now[0])
    now[0] = 1100.0  # up for 100 s: a full window
    for t in range(60):
        tracker.add_tokens(generated=2, prompt=10, now=1040.5 + t)
    for seconds in (0.1, 0.2, 5.0):
        tracker.add_queue_time(seconds, now=1099.0)
    generated, prompt, p50 = tracker.snapshot()
    assert generated == pytest.approx(2 * 59 / 60)  # the bucket of second 1040 is past the window
    assert prompt == pytest.approx(10 * 59 / 60)
    assert p50 == pytest.approx(0.2)
    now[0] = 1300.0
    assert tracker.snapshot() == (0.0, 0.0, 0.0)


def _raw_trailers(port: int, method: str, message: bytes) -> dict[str, str]:
    """The trailers of a call made with curl over HTTP/2: gRPC's C-core client consumes endpoint-load-metrics-bin
    (its load-balancing policies read it) and does not show it to the application."""
    body = b"\x00" + struct.pack(">I", len(message)) + message
    done = subprocess.run(["curl", "-sv", "--http2-prior-knowledge", "-H", "content-type: application/grpc",
                           "-H", "te: trailers", "--data-binary", "@-", f"http://127.0.0.1:{port}{method}",
                           "-o", "/dev/null"], input=body, capture_output=True, timeout=30, check=False)
    lines = [line[2:] for line in done.stderr.decode(errors="replace").splitlines() if line.startswith("< ")]
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines) if v}


async def test_get_load_and_the_orca_trailer() -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is needed to read the raw trailers")
    engine = FakeEngine()
    engine.load_tracker.add_tokens(6, 30)
    async with served(engine) as (channel, frontend, port):
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        reply = await stub.GetLoad(generate_pb2.GetLoadRequest())
        assert reply.kv_cache_pages == 100 and reply.max_running_outputs == 8
        assert reply.generation_tokens_per_second > 0 and reply.resident_memory_bytes > 10 << 20
        assert reply.memory_limit_bytes == frontend.memory_limit > 0
        for method, message in (("/lmrpc.v1.GenerateService/GetLoad", b""),
                                ("/lmrpc.v1.GenerateService/Generate", ids_request([5, 6]).SerializeToString())):
            trailers = await asyncio.to_thread(_raw_trailers, port, method, message)
            assert trailers.get("grpc-status") == "0", trailers
            report = base64.b64decode(trailers[load.ORCA_TRAILER] + "==")
            fields = _wire_fields(report)
            # An idle server: application_utilization 0 is left out (proto3); memory and the named figures are there.
            assert fields[2][0] == pytest.approx(reply.resident_memory_bytes / reply.memory_limit_bytes, rel=0.5)
            assert _map(fields[5]).keys() == {"kv_cache"} and "running_outputs" in _map(fields[8])
        # Health is not lmrpc's: no report there.
        trailers = await asyncio.to_thread(_raw_trailers, port, "/grpc.health.v1.Health/Check", b"")
        assert trailers.get("grpc-status") == "0" and load.ORCA_TRAILER not in trailers


# ---- watchdog ------------------------------------------------------------------------------------------------------


class _Engine:
    def __init__(self) -> None:
        self.heartbeat = 0.0
        self.thread_alive = True
        self.died: BaseException | None = None
        self.failed: list[str] = []
        self.recoveries = 0

    def fail_calls(self, reason: str) -> int:
        self.failed.append(reason)
        return 3

    def recovered(self) -> None:
        self.recoveries += 1


async def test_watchdog_stuck_recovered_and_dead(caplog: pytest.LogCaptureFixture) -> None:
    engine = _Engine()
    health_log: list[tuple[bool, bool]] = []

    async def set_health(services: bool, liveness: bool) -> None:
        health_log.append((services, liveness))

    dog = Watchdog(engine, set_health, stall_timeout=3, tick=1)
    for beat in range(5):  # a heartbeat every tick: serving
        engine.heartbeat = float(beat)
        await dog.check()
    assert dog.state is EngineState.SERVING and not health_log
    for _ in range(3):  # no heartbeat for 3 ticks: stuck
        await dog.check()
    assert dog.state is EngineState.STUCK and health_log == [(False, True)]
    assert engine.failed and "no progress for 3 s" in engine.failed[0]
    assert "health NOT_SERVING, 3 call(s) in flight ended UNAVAILABLE" in caplog.text
    engine.heartbeat = 99.0
    await dog.check()
    assert dog.state is EngineState.SERVING and health_log[-1] == (True, True) and engine.recoveries == 1
    for _ in range(9):  # stuck for 3x the timeout: liveness fails too
        await dog.check()
    assert health_log[-1] == (False, False)
    engine.thread_alive = False
    engine.died = RuntimeError("boom")
    await dog.check()
    assert dog.state is EngineState.DEAD and "died (RuntimeError('boom'))" in engine.failed[-1]
    assert health_log[-1] == (False, False)


def test_engine_stats_default_paused() -> None:
    assert EngineStats(1, 2, 3, 4, 5, 6).num_paused == 0


# ---- flags ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("flags", "message"), [
    (["--stalled-stream-timeout", "0"], "--stalled-stream-timeout must be in [0.1, 86400]"),
    (["--engine-stall-timeout", "0.5"], "--engine-stall-timeout must be in [1, 86400]"),
    (["--max-queued-per-client", "-1"], "--max-queued-per-client must be >= 0"),
    (["--api-key-file", "/nonexistent/keys"], "--api-key-file: cannot read '/nonexistent/keys'"),
    (["--api-key-file", "{empty}"], "holds no key"),
])
def test_bad_hardening_flags_exit_2_naming_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    flags: list[str], message: str) -> None:
    from lmrpc.server.__main__ import parse_args, server_config

    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(SystemExit) as exc:
        server_config(parse_args([f.format(empty=empty) for f in flags]))
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_max_buffered_outputs_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from lmrpc.server.__main__ import engine_config, parse_args, server_config

    with pytest.raises(SystemExit) as exc:
        engine_config(parse_args(["--max-buffered-outputs", "1"]))
    assert exc.value.code == 2 and "--max-buffered-outputs must be in [2," in capsys.readouterr().err
    args = parse_args(["--max-buffered-outputs", "16", "--max-queued-per-client", "4"])
    assert engine_config(args).max_buffered_outputs == 16
    assert server_config(args).max_queued_per_client == 4 and server_config(args).api_keys is None


async def test_priority_and_client_reach_the_engine() -> None:
    engine = FakeEngine()
    seen: list[tuple[int, str]] = []
    async with served(engine) as (channel, _, _port):
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        original = engine.generate

        async def spy(requests):  # type: ignore[no-untyped-def]
            seen.extend((r.priority, r.client) for r in requests)
            async for out in original(requests):
                yield out

        engine.generate = spy  # type: ignore[method-assign]
        request = ids_request([5, 6])
        request.priority = -7
        _ = [m async for m in stub.Generate(request)]
        _ = [m async for m in stub.Generate(ids_request([5, 6]))]
    assert seen[0][0] == -7 and seen[1][0] == 0
    assert all(client == "peer:ipv4:127.0.0.1" for _, client in seen)


def test_the_metrics_have_the_process_rss() -> None:
    from prometheus_client import generate_latest

    from lmrpc.server.metrics import Metrics

    text = generate_latest(Metrics().registry).decode()
    rss = [line for line in text.splitlines() if line.startswith("process_resident_memory_bytes ")]
    assert rss and float(rss[0].split()[1]) > 10 << 20

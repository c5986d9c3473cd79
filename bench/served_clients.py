"""One streamed request on each system of bench/served.py, timed as a StreamTrace: lmrpc through the Python
AsyncClient (gRPC), llama.cpp's llama-server through its native /completion endpoint (HTTP/1.1 server-sent events
read from a raw asyncio connection, so that its connect time is counted); and llama-server's greedy ids, unstreamed.
bench/budgets.py times its lmrpc servers with the same lmrpc_generate."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from served_stats import StreamTrace

from lmrpc.client import AsyncClient

Generate = Callable[[list[int], int], Awaitable[StreamTrace]]  # (prompt ids, new tokens) -> one streamed request


def lmrpc_generate(client: AsyncClient) -> Generate:
    async def generate(prompt: list[int], new_tokens: int) -> StreamTrace:
        # repetition_penalty explicit: with the server's default --sampling-defaults model it could come from the
        # model's generation_config, and llama.cpp's default is 1.0.
        params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True, "repetition_penalty": 1.0}
        arrivals: list[tuple[float, int]] = []
        ids: list[int] = []
        sent = time.perf_counter()
        async for delta in await client.generate(input_ids=prompt, sampling_params=params, stream=True):
            if delta.token_ids:
                arrivals.append((time.perf_counter(), len(delta.token_ids)))
                ids.extend(delta.token_ids)
        return StreamTrace(sent, tuple(arrivals), tuple(ids))

    return generate


class LlamaError(RuntimeError):
    """llama-server answered with an HTTP error or an error event."""


async def _read_http_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = (await reader.readline()).decode("latin-1")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        raise LlamaError(f"not an HTTP response: {status_line!r}")
    headers: dict[str, str] = {}
    while (line := (await reader.readline()).decode("latin-1").strip()):
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _http_body_chunks(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The body as it arrives: decoded from chunked transfer encoding (what cpp-httplib streams), else read to EOF."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while size := int((await reader.readline()).split(b";")[0].strip() or b"0", 16):
            yield await reader.readexactly(size)
            await reader.readexactly(2)  # the CRLF after each chunk
        return
    while data := await reader.read(65536):
        yield data


def llama_generate(port: int) -> Generate:
    async def generate(prompt: list[int], new_tokens: int) -> StreamTrace:
        # Field names as in this llama.cpp's tools/server/server-schema.cpp. A prompt given as token ids gets no BOS.
        body = json.dumps({"prompt": prompt, "n_predict": new_tokens, "temperature": 0.0, "ignore_eos": True,
                           "cache_prompt": False, "stream": True, "repeat_penalty": 1.0}).encode()
        head = (f"POST /completion HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
        arrivals: list[tuple[float, int]] = []
        ids: list[int] = []
        predicted = 0  # tokens_predicted so far: each event's count of new tokens is the increase
        sent = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(head.encode() + body)
            await writer.drain()
            status, headers = await _read_http_head(reader)
            if status != 200:
                raise LlamaError(f"HTTP {status}: {(await reader.read(2000)).decode(errors='replace')}")
            pending = b""
            async for chunk in _http_body_chunks(reader, headers):
                now = time.perf_counter()
                pending += chunk
                *events, pending = pending.split(b"\n\n")  # server-sent events end with a blank line
                for obj in (o for event in events for o in _event_objects(event)):
                    ids.extend(obj.get("tokens") or ())
                    if obj.get("tokens_predicted", 0) > predicted:
                        arrivals.append((now, obj["tokens_predicted"] - predicted))
                        predicted = obj["tokens_predicted"]
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        return StreamTrace(sent, tuple(arrivals), tuple(ids))

    return generate


def _event_objects(event: bytes) -> list[dict[str, Any]]:
    """The JSON objects of one server-sent event of /completion. A partial event carries one token in `tokens` and
    `tokens_predicted`, the count so far; a token that ends in incomplete UTF-8 gets no event of its own (the next
    one counts it); the final event has no tokens, its tokens_predicted is the total."""
    objects: list[dict[str, Any]] = []
    for line in event.decode().splitlines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            continue
        obj = json.loads(data)
        if "error" in obj:
            raise LlamaError(f"error event: {obj['error']}")
        objects.append(obj)
    return objects


def llama_greedy_ids(port: int, prompt: list[int], new_tokens: int) -> tuple[int, ...]:
    """Every generated id, not streamed (a stream leaves out the ids of tokens held back as incomplete UTF-8)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/completion", json.dumps({
            "prompt": prompt, "n_predict": new_tokens, "temperature": 0.0, "ignore_eos": True, "cache_prompt": False,
            "repeat_penalty": 1.0, "return_tokens": True}), {"Content-Type": "application/json"})
        response = conn.getresponse()
        body = response.read().decode(errors="replace")
    finally:
        conn.close()
    if response.status != 200:
        raise LlamaError(f"HTTP {response.status}: {body[:2000]}")
    return tuple(json.loads(body)["tokens"])

"""GGUF files in the new block formats served end to end (tiny_gguf.py writes them):

- a tiny 2-layer Llama with every matrix in Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q3_K, Q2_K, IQ4_NL or IQ4_XS, or in
  Q4_K_M's mix (v and down in Q6_K: the fused qkv holds both), is served as its blocks (GetModelInfo names the
  formats) and gives one request the same greedy tokens alone, in a batch, with its prompt prefilled in chunks of
  16 tokens, and as a prefix-cache hit (in float32, and every format but Q6_K in bfloat16 too);
- SmolLM2 with its MLP down projections in Q4_K and Q6_K (Q4_K_M's mix), in Q5_K and Q5_0, in Q3_K and IQ4_XS, or in
  Q2_K and IQ4_NL
  decodes, under teacher forcing, the greedy token of its own dequantized dense model (float32) at >= 97% of 320
  positions, served as blocks with bfloat16 activations.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest
from teacher_forcing import CONTINUATION, PROMPTS, chat
from tiny_gguf import write_smollm2_k_quant, write_tiny_llama
from transformers import PreTrainedTokenizerBase

from lmrpc.kernels import native
from lmrpc.server.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.types import EngineOutput, EngineRequest, LogprobOptions, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not native.available(), reason="blocks need the native kernels")]

FORMATS = ("q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "q3_k", "q2_k", "iq4_nl", "iq4_xs",
           "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m", "tq1_0", "tq2_0")
NEW = 16
_ids = iter(range(10**9))


def start(model: Path, dtype: str, quantization: str, max_batched: int = 512) -> AsyncEngine:
    return AsyncEngine.start(EngineConfig(
        model=ModelConfig(path=str(model), dtype=dtype, device="cpu", quantization=quantization),
        cache=CacheConfig(page_size=16, num_tokens=8192, enable_prefix_cache=True),
        scheduler=SchedulerConfig(max_running_requests=32, max_batched_tokens=max_batched,
                                  max_prefill_chunk=max_batched),
        sampling_defaults="openai",
    ))


def request(prompt: list[int], new: int, logprobs: LogprobOptions | None = None) -> EngineRequest:
    rid = f"q{next(_ids)}"
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    return EngineRequest(rid, rid, 0, tuple(prompt), params, logprobs)


def run(engine: AsyncEngine, requests: list[EngineRequest]) -> dict[str, list[EngineOutput]]:
    async def collect() -> dict[str, list[EngineOutput]]:
        outs: dict[str, list[EngineOutput]] = {r.request_id: [] for r in requests}
        async for o in engine.generate(requests):
            outs[o.request_id].append(o)
        return outs

    return asyncio.run(collect())


def tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def greedy(engine: AsyncEngine, prompt: list[int], new: int) -> list[int]:
    r = request(prompt, new)
    return tokens(run(engine, [r])[r.request_id])


PROMPT = [(i * 7919) % 40000 + 100 for i in range(37)]  # two full pages and a partial one
OTHERS = [[(i * 104729 + j * 31) % 40000 + 100 for j in range(3 + 11 * i)] for i in range(7)]


# float32 models (every format's float32 products), and in bfloat16 too the formats whose codes only bfloat16
# products read as stored: IQ4's 4-bit codes through their table, the 5- and 3-bit layouts (float32 ones hold them
# as int8 values and 6-bit codes).
BF16_HELD = ("iq4_nl", "iq4_xs", "q5_k", "q5_0", "q5_1", "q3_k", "q2_k", "tq2_0")


@pytest.mark.parametrize("fmt", [*FORMATS, "q4_k_m", *(f"{f}:bfloat16" for f in BF16_HELD)])
def test_a_tiny_model_in_each_format_gives_the_same_tokens_on_every_route(fmt: str, tmp_path: Path) -> None:
    fmt, _, dtype = fmt.partition(":")
    dtype = dtype or "float32"
    q = gguf.GGMLQuantizationType
    formats: tuple[str, ...]
    if fmt == "q4_k_m":  # Q4_K with v and down in Q6_K: qkv fused from both formats
        path = write_tiny_llama(tmp_path / "tiny-q4_k_m.gguf", q.Q4_K, v_down=q.Q6_K)
        formats, name = ("q4_k", "q6_k"), "Q4_K+Q6_K"
    else:
        path = write_tiny_llama(tmp_path / f"tiny-{fmt}.gguf", q[fmt.upper()])
        formats, name = (fmt,), fmt.upper()
    engine = start(path, dtype, "auto")
    try:
        assert engine.model_info.weight_formats == formats
        assert engine.model_info.quantization == name
        expected = greedy(engine, PROMPT, NEW)  # cold: alone
        assert len(expected) == NEW
        assert greedy(engine, PROMPT, NEW) == expected  # a full prefix-cache hit
        batch = [request(PROMPT, NEW)] + [request(p, NEW) for p in OTHERS]
        outs = run(engine, batch)
        assert tokens(outs[batch[0].request_id]) == expected  # in a batch (its pages cached, others cold)
    finally:
        engine.shutdown()
    chunked = start(path, dtype, "auto", max_batched=16)
    try:
        batch = [request(PROMPT, NEW)] + [request(p, NEW) for p in OTHERS[:3]]
        assert tokens(run(chunked, batch)[batch[0].request_id]) == expected  # prefilled 16 tokens a step, cold
    finally:
        chunked.shutdown()


# The down projections' formats (even layers, odd layers): Q4_K_M's mix, the 5-bit formats, then the 3- and 2-bit
# K-quants each beside an IQ4 format.
MIXES = {"q4_k+q6_k": (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K),
         "q5_k+q5_0": (gguf.GGMLQuantizationType.Q5_K, gguf.GGMLQuantizationType.Q5_0),
         "q3_k+iq4_xs": (gguf.GGMLQuantizationType.Q3_K, gguf.GGMLQuantizationType.IQ4_XS),
         "q2_k+iq4_nl": (gguf.GGMLQuantizationType.Q2_K, gguf.GGMLQuantizationType.IQ4_NL)}


@pytest.fixture(scope="module", params=sorted(MIXES))
def k_quant_engines(request: pytest.FixtureRequest,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, AsyncEngine, AsyncEngine]]:
    even, odd = MIXES[request.param]
    path = write_smollm2_k_quant(tmp_path_factory.mktemp("k-quant") / f"smollm2-{request.param}.gguf", even, odd)
    dense = start(path, "float32", "none")
    blocks = start(path, "bfloat16", "auto")
    yield request.param, dense, blocks
    dense.shutdown()
    blocks.shutdown()


def scored(engine: AsyncEngine, ids: list[int], first: int) -> list[int]:
    """The top-1 token at every position from `first` (teacher forcing)."""
    r = request(ids, 0, LogprobOptions(start_len=first, top_k=1))
    positions = [p for o in run(engine, [r])[r.request_id] for p in o.input_logprobs]
    assert len(positions) == len(ids) - first
    return [p.top[0].token_id for p in positions]


def test_a_k_quant_model_agrees_with_its_dense_model_under_teacher_forcing(
        k_quant_engines: tuple[str, AsyncEngine, AsyncEngine], smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    mix, dense, blocks = k_quant_engines
    assert dense.model_info.quantization == "none"
    formats = tuple(sorted(("q4_1", "q8_0", *mix.split("+"))))
    assert blocks.model_info.weight_formats == formats
    assert blocks.model_info.quantization == "+".join(f.upper() for f in formats)
    agree = total = 0
    for text in PROMPTS:
        prompt = chat(smollm2_tokenizer, text)
        ids = prompt + greedy(dense, prompt, CONTINUATION)
        reference, ours = scored(dense, ids, len(prompt)), scored(blocks, ids, len(prompt))
        agree += sum(r == o for r, o in zip(reference, ours, strict=True))
        total += len(reference)
    print(f"{mix} blocks (bf16 activations) top-1 = dense top-1 at {agree}/{total} positions")
    assert total == len(PROMPTS) * CONTINUATION
    assert agree / total >= 0.97

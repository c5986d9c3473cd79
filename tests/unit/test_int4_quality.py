"""int4 as served (the bundled GGUF's own Q4_1 blocks, bfloat16 activations) against the dense dequantized model
(the same file's weights dequantized, float32 activations), under teacher forcing:

- 5 chat prompts, each followed by the dense model's 64 greedy tokens: at each of those 320 positions the int4
  model's top-1 token is the dense model's in at least 97% of positions;
- the perplexity of a fixed English text is within 1% of the dense model's.

Measured here (-s shows them): top-1 agreement 319/320 (99.7%); perplexity over 168 tokens 29.4143 for int4 against
29.4020 dense (ratio 1.0004). With `--int8-activations` (2026-11-24): 312/320 (97.5%) and 29.3470 (ratio 0.9981).
On an AVX2 host (float32 compute, 2026-11-26): 320/320 and ratio 1.0000; with `--int8-activations` there 313/320
(97.8%) and ratio 1.0030.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import pytest
from teacher_forcing import CONTINUATION, PROMPTS, chat
from transformers import PreTrainedTokenizerBase

from lmrpc.kernels import native
from lmrpc.server.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.types import EngineOutput, EngineRequest, LogprobOptions, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not native.available(), reason="int4 needs the native kernels")]

TEXT = (
    "The lighthouse stood at the edge of the cliff, its white paint worn thin by a century of salt and wind. "
    "Every evening the keeper climbed the spiral stairs, one hundred and twelve of them, to light the lamp that "
    "warned ships away from the rocks below. He had done it for thirty years, through storms that shook the glass "
    "and calm nights when the sea lay flat as a mirror. The village below had grown from a handful of fishing huts "
    "into a small town with a school, a market and a harbour full of boats. Children sometimes walked up the path "
    "to ask him about the shipwrecks he had seen, and he told them the same stories each time, changing only the "
    "weather. When the lamp was finally replaced by an automatic light, the keeper stayed on, because he could not "
    "imagine falling asleep without first looking out over the water."
)


def start(dtype: str, quantization: str) -> AsyncEngine:
    return AsyncEngine.start(EngineConfig(
        model=ModelConfig(dtype=dtype, device="cpu", quantization=quantization),
        cache=CacheConfig(num_tokens=8192), scheduler=SchedulerConfig(), sampling_defaults="openai",
    ))


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[AsyncEngine, AsyncEngine]]:
    dense, int4 = start("float32", "none"), start("auto", "auto")
    assert dense.model_info.quantization == "none" and int4.model_info.quantization == "int4"
    assert int4.model_info.weight_formats == ("q4_1", "q8_0")
    yield dense, int4
    dense.shutdown()
    int4.shutdown()


_ids = iter(range(10**9))


async def outputs(engine: AsyncEngine, prompt: list[int], params: SamplingParams,
                  logprobs: LogprobOptions | None) -> list[EngineOutput]:
    rid = f"q{next(_ids)}"
    return [o async for o in engine.generate([EngineRequest(rid, rid, 0, tuple(prompt), params, logprobs)])]


def greedy(engine: AsyncEngine, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return [t for o in asyncio.run(outputs(engine, prompt, params, None)) for t in o.token_ids]


def scored(engine: AsyncEngine, tokens: list[int], start: int) -> list[tuple[float, int]]:
    """(logprob of the actual token, top-1 token) at every position from `start` (teacher forcing)."""
    params = SamplingParams(max_new_tokens=0, temperature=0.0)
    outs = asyncio.run(outputs(engine, tokens, params, LogprobOptions(start_len=start, top_k=1)))
    positions = [p for o in outs for p in o.input_logprobs]
    assert len(positions) == len(tokens) - start
    return [(p.chosen.logprob or 0.0, p.top[0].token_id) for p in positions]


def test_int4_top1_agrees_with_the_dense_model_under_teacher_forcing(
        engines: tuple[AsyncEngine, AsyncEngine]) -> None:
    dense, int4 = engines
    agree = total = 0
    for text in PROMPTS:
        prompt = chat(dense.tokenizer, text)
        tokens = prompt + greedy(dense, prompt, CONTINUATION)
        reference = scored(dense, tokens, len(prompt))
        ours = scored(int4, tokens, len(prompt))
        agree += sum(r[1] == o[1] for r, o in zip(reference, ours, strict=True))
        total += len(reference)
    rate = agree / total
    print(f"int4 top-1 = dense top-1 at {agree}/{total} positions ({rate:.1%})")
    assert total == len(PROMPTS) * CONTINUATION
    assert rate >= 0.97


def test_int4_perplexity_within_one_percent_of_dense(engines: tuple[AsyncEngine, AsyncEngine],
                                                     smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    dense, int4 = engines
    tokens = list(smollm2_tokenizer.encode(TEXT))
    ppl = {}
    for name, engine in (("dense", dense), ("int4", int4)):
        logprobs = [lp for lp, _ in scored(engine, tokens, 1)]
        ppl[name] = math.exp(-sum(logprobs) / len(logprobs))
    ratio = ppl["int4"] / ppl["dense"]
    print(f"perplexity over {len(tokens) - 1} tokens: dense {ppl['dense']:.4f}, int4 {ppl['int4']:.4f} "
          f"(ratio {ratio:.4f})")
    assert abs(ratio - 1) <= 0.01


"""What the multimodal tests share: media items as the service builds them (decoded, digested), engines on a tiny
multimodal checkpoint, requests from a model's `prepare`, runs collected into comparable results, our executor's
logits for one prompt in given chunks, and transformers' model as the reference."""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from lmrpc.server.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.executor import ModelExecutor
from lmrpc.server.engine.sequence import ScheduledBatch, ScheduledChunk, Sequence
from lmrpc.server.engine.types import EngineOutput, EngineRequest, LogprobOptions, SamplingParams
from lmrpc.server.media.types import Media, Modality, MultimodalPrompt
from lmrpc.server.models.loader import LoadedModel
from lmrpc.server.models.types import PromptMedia

TOP = 5  # logprob alternatives compared at every position
PAGE = 16


def image(seed: int, width: int = 40, height: int = 36, index: int = 0) -> Media:
    """A random RGB image as the service hands it over (digest of mode, size and pixels)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    img = Image.fromarray(pixels, "RGB")
    digest = hashlib.blake2b(b"RGB" + repr(img.size).encode() + img.tobytes(), digest_size=16).digest()
    return Media(Modality.IMAGE, f"image_data[0].items[{index}]", digest, image=img)


def audio(seed: int, samples: int = 12000, rate: int = 16000, index: int = 0) -> Media:
    """A random clip (float32 mono at `rate`) as the service hands it over."""
    clip = (np.random.default_rng(seed).standard_normal(samples) * 0.1).astype(np.float32)
    digest = hashlib.blake2b(rate.to_bytes(4, "little") + clip.tobytes(), digest_size=16).digest()
    return Media(Modality.AUDIO, f"audio_data[0].items[{index}]", digest, audio=clip, sampling_rate=rate)


def start(path: Path, *, kv_tokens: int = 8192, max_batched: int = 256, prefix_cache: bool = True) -> AsyncEngine:
    return AsyncEngine.start(config(path, kv_tokens=kv_tokens, max_batched=max_batched, prefix_cache=prefix_cache))


def config(path: Path, *, kv_tokens: int = 8192, max_batched: int = 256, prefix_cache: bool = True) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(path=str(path), dtype="float32", device="cpu", quantization="none"),
        cache=CacheConfig(page_size=PAGE, num_tokens=kv_tokens, enable_prefix_cache=prefix_cache),
        scheduler=SchedulerConfig(max_running_requests=16, max_batched_tokens=max_batched,
                                  max_prefill_chunk=max_batched),
        sampling_defaults="openai",
    )


_ids = itertools.count()


def request(prompt: MultimodalPrompt | list[int], new: int, rid: str | None = None) -> EngineRequest:
    """Greedy, new tokens exactly (EOS ignored), top logprobs at every output position."""
    rid = rid or f"m{next(_ids)}"
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    if isinstance(prompt, list):
        return EngineRequest(rid, rid, 0, tuple(prompt), params, LogprobOptions(top_k=TOP))
    assert isinstance(prompt.engine_media, PromptMedia)
    return EngineRequest(rid, rid, 0, prompt.token_ids, params, LogprobOptions(top_k=TOP),
                         prompt_media=prompt.engine_media)


@dataclass(frozen=True)
class Result:
    tokens: tuple[int, ...]
    logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...]  # per position: chosen, top (id, logprob)
    cached_tokens: int  # prompt positions served from the prefix cache


async def run(engine: AsyncEngine, requests: list[EngineRequest]) -> dict[str, Result]:
    outs: dict[str, list[EngineOutput]] = {r.request_id: [] for r in requests}
    async for o in engine.generate(requests):
        outs[o.request_id].append(o)
    results = {}
    for rid, pieces in outs.items():
        finish = pieces[-1].finish
        assert finish is not None and pieces[-1].usage is not None, rid
        assert not finish.message, finish.message
        lps = tuple((p.chosen.logprob or 0.0, tuple((t.token_id, t.logprob or 0.0) for t in p.top))
                    for o in pieces for p in o.output_logprobs)
        results[rid] = Result(tuple(t for o in pieces for t in o.token_ids), lps, pieces[-1].usage.cached_tokens)
    return results


def executor_logits(loaded: LoadedModel, prompt: MultimodalPrompt, cuts: list[int]) -> torch.Tensor:
    """Our executor's float32 logits [positions, vocab] of every prompt position, the prompt prefilled in chunks
    ending at each of `cuts` (the last is the prompt's length), on a fresh executor (its own KV cache)."""
    executor = ModelExecutor(loaded, config(Path(loaded.info.path)))
    request = EngineRequest("x", "x", 0, prompt.token_ids, SamplingParams(max_new_tokens=1),
                            LogprobOptions(start_len=1), prompt_media=prompt.engine_media)
    seq = Sequence(request)
    seq.page_table = list(range(-(-len(prompt.token_ids) // PAGE)))
    rows: list[torch.Tensor] = []
    start = 0
    for end in cuts:
        out = executor.forward(ScheduledBatch((ScheduledChunk(seq, start, end - start),)))
        rows.extend(p.logits for p in out.prompt_logits)
        start = end
    rows.append(out.logits)  # the last position's (the sampling row)
    return torch.cat(rows)


def hf_inputs(prompt: MultimodalPrompt) -> dict[str, torch.Tensor]:
    """The prompt as transformers' model takes it: the ids, and each tensor of the items stacked (items in order)."""
    media = prompt.engine_media
    assert isinstance(media, PromptMedia)
    names = media.spans[0].encoder_input.keys()
    out = {k: torch.from_numpy(np.concatenate([s.encoder_input[k] for s in media.spans])) for k in names}
    out["input_ids"] = torch.tensor([prompt.token_ids])
    return out


def hf_reference(hf: torch.nn.Module, prompt: MultimodalPrompt, new: int) -> tuple[torch.Tensor, list[int]]:
    """transformers' float32 logits [positions, vocab] of the prompt, and its `new` greedy tokens."""
    inputs = hf_inputs(prompt)
    with torch.inference_mode():
        logits = hf(**inputs).logits[0]
        generated = hf.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False,  # type: ignore[operator]
                                pad_token_id=0)
    return logits, generated[0, len(prompt.token_ids) :].tolist()

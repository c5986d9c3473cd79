"""The model executor: owns the model, its KV cache (through the model's attention backend) and one step's
forward: a ScheduledBatch -> page copies, flat token ids and positions, the backend's plan, the forward pass, and
the logits the sampler and prompt logprobs need (float32, only for the rows that need them)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from lmrpc.kernels.attention import PagedTorchAttention
from lmrpc.kernels.flashinfer_attention import FlashInferAttention
from lmrpc.kernels.paged import ChunkSpec
from lmrpc.server import memory
from lmrpc.server.config import EngineConfig
from lmrpc.server.engine import media_rows
from lmrpc.server.engine.cuda_graphs import CudaGraphRunner, default_buckets
from lmrpc.server.engine.sequence import ScheduledBatch, ScheduledChunk, Sequence
from lmrpc.server.engine.types import HiddenStatesMode
from lmrpc.server.lora.registry import LoadedAdapter
from lmrpc.server.models import ForwardContext
from lmrpc.server.models.llama import LlamaForCausalLM
from lmrpc.server.models.loader import LoadedModel
from lmrpc.server.models.lora_delta import RowGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptLogits:
    """Logits of one chunk's positions that predict prompt tokens asked for as prompt logprobs."""

    seq: Sequence  # whose prompt
    first_position: int  # position of row 0
    logits: torch.Tensor  # [k, vocab] float32: row j predicts the prompt token at first_position + j + 1


@dataclass(frozen=True)
class HiddenRows:
    """Final-layer normalized hidden states of some of one chunk's positions, for a request that asked for them."""

    seq: Sequence  # whose positions
    first_position: int  # position of row 0
    rows: torch.Tensor  # [k, hidden] float32, positions first_position .. first_position + k - 1


@dataclass(frozen=True)
class RoutedRows:
    """The experts some of one chunk's positions were routed to, for a request that asked for them."""

    seq: Sequence  # whose positions
    first_position: int  # position of row 0
    experts: torch.Tensor  # [k, moe layers, top_k] int32


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor  # [num_sampling_chunks, vocab] float32, one row per chunk with `samples`, batch order
    prompt_logits: tuple[PromptLogits, ...]  # for chunks of sequences asking for prompt logprobs
    hidden: tuple[HiddenRows, ...] = ()  # for chunks of sequences asking for hidden states
    routed: tuple[RoutedRows, ...] = ()  # for chunks of sequences asking for routed experts


class ModelExecutor:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        cache = config.cache
        self.model = loaded.model
        self.device: torch.device = loaded.model.device
        self.vocab_size = loaded.info.vocab_size
        self.page_size = cache.page_size
        bytes_per_token = self.model.kv_bytes_per_token
        # Sized from the tighter of host memory and the cgroup limit, after the model (memory.py).
        device_free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        pool = memory.kv_pool_tokens(cache.num_tokens, cache.memory_fraction, bytes_per_token,
                                     memory.memory_budget(), device_free)
        logger.info("KV cache: %d tokens (%.2f GiB), from %s", pool.tokens,
                    pool.tokens * bytes_per_token / (1 << 30), pool.reason)
        pages = max(1, pool.tokens // self.page_size)
        graphs = self._graph_batch(config)
        # With CUDA graphs, one more page: the scratch page padding rows write to, never handed to a sequence.
        self.attention = self.model.make_attention(pages + (1 if graphs else 0), self.page_size)  # the KV cache
        self.num_pages = pages  # what the KV-cache manager may hand out
        self.graphs: CudaGraphRunner | None = None
        if (graphs and isinstance(self.attention, PagedTorchAttention)
                and isinstance(self.attention.kernel, FlashInferAttention)):
            max_pages = -(-loaded.info.max_context_length // self.page_size)
            self.graphs = CudaGraphRunner(self.model, self.attention, default_buckets(graphs), scratch_page=pages,
                                          max_pages_per_seq=max_pages)
            self.graphs.capture()

    def _graph_batch(self, config: EngineConfig) -> int:
        """The largest decode batch to capture as a CUDA graph here (0: none)."""
        if self.device.type != "cuda":
            return 0
        limit = config.cuda_graph_max_batch
        batch = config.scheduler.max_running_requests if limit is None else limit
        if batch and not _has_flashinfer():
            logger.warning("no CUDA graphs: they need flashinfer's decode kernel")
            return 0
        return batch

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> ForwardOutput:
        for copy in batch.copies:  # partial prefix-cache hits: the matched head of a cached page, into its own page
            self.attention.copy_prefix(copy.src, copy.dst, copy.num_tokens)
        ids: list[int] = []
        positions: list[int] = []
        for c in batch.chunks:
            ids.extend(c.seq.token_ids[c.start : c.start + c.num_tokens])
            positions.extend(range(c.start, c.start + c.num_tokens))
        chunks = [ChunkSpec(c.start, c.num_tokens, c.seq.page_table) for c in batch.chunks]
        lora = _adapter_groups(batch, self.device)
        embedded = any(_embedded_span(c)[1] or media_rows.chunk_has_media(c) for c in batch.chunks)
        rope_positions = _rope_positions(batch)  # [3, T] when a request has M-RoPE positions
        # A captured graph gives logits only: steps that need embeddings or M-RoPE positions in, hidden states or
        # routing out run eagerly.
        extras = embedded or rope_positions is not None or any(c.seq.request.hidden_states is not None
                                 or c.seq.request.routed_experts_from is not None for c in batch.chunks)
        if (self.graphs is not None and not lora and not extras and len(ids) == len(chunks)
                and self.graphs.bucket_for(len(ids)) is not None):
            return ForwardOutput(self.graphs.run(ids, chunks), ())  # decodes only: a captured graph
        position_tensor = torch.tensor(positions, dtype=torch.int64)
        ctx = ForwardContext(self.attention, self.attention.plan(chunks, position_tensor, rope_positions))
        id_tensor = torch.tensor(ids, dtype=torch.int64, device=self.device)  # [T]
        inputs = self._input_embeds(batch, id_tensor) if embedded else None  # [T, hidden]
        routed: tuple[RoutedRows, ...] = ()
        if any(c.seq.request.routed_experts_from is not None for c in batch.chunks):
            forward_routed = getattr(self.model, "forward_routed")  # noqa: B009  (validation: an MoE model)
            hidden, experts = forward_routed(id_tensor, ctx, inputs)  # [T, hidden], [T, moe layers, top_k]
            routed = _routed_rows(batch, experts)
        elif lora:  # only our Llama family takes adapters (lora.registry loads none for another model)
            hidden = cast(LlamaForCausalLM, self.model).forward(id_tensor, ctx, inputs, lora)  # [T, hidden]
        else:
            hidden = self.model.forward(id_tensor, ctx, inputs)  # [T, hidden]
        rows, prompt_spans = self._rows(batch)
        projected = hidden if rows is None else hidden.index_select(0, rows)  # [len(rows), hidden]
        logits = self.model.compute_logits(projected)  # [len(rows), vocab]
        sampling = logits[: sum(c.samples for c in batch.chunks)]
        prompt = tuple(
            PromptLogits(seq, first, logits[offset : offset + n]) for seq, first, offset, n in prompt_spans
        )
        return ForwardOutput(sampling, prompt, self._hidden(batch, hidden), routed)

    def _hidden(self, batch: ScheduledBatch, hidden: torch.Tensor) -> tuple[HiddenRows, ...]:
        """hidden [T, hidden] -> the normalized rows of the chunks whose requests ask for hidden states: all their
        positions (the engine drops any it already sent, e.g. recomputed after preemption), or in LAST mode only the
        row that samples."""
        picks: list[tuple[Sequence, int, int, int]] = []  # (seq, first position, first row, count)
        row = 0
        for c in batch.chunks:
            mode = c.seq.request.hidden_states
            if mode is HiddenStatesMode.ALL:
                picks.append((c.seq, c.start, row, c.num_tokens))
            elif mode is HiddenStatesMode.LAST and c.samples:
                picks.append((c.seq, c.start + c.num_tokens - 1, row + c.num_tokens - 1, 1))
            row += c.num_tokens
        if not picks:
            return ()
        index = torch.tensor([r for _, _, first, n in picks for r in range(first, first + n)], dtype=torch.int64,
                             device=self.device)
        normed = self.model.final_norm(hidden.index_select(0, index)).cpu()  # [sum of counts, hidden]
        out: list[HiddenRows] = []
        offset = 0
        for seq, position, _, n in picks:
            out.append(HiddenRows(seq, position, normed[offset : offset + n]))
            offset += n
        return tuple(out)

    def _input_embeds(self, batch: ScheduledBatch, ids: torch.Tensor) -> torch.Tensor:
        """The first layer's rows [T, hidden] float32: the embedding lookup of ids, with the prompt positions given as
        embeddings replaced by the request's own rows (exactly as sent: the lookup's rows are float32 too), and image
        and audio positions by their items' rows (engine/media_rows.py)."""
        x = self.model.embed(ids)  # [T, hidden]
        row = 0
        for c in batch.chunks:
            first, count = _embedded_span(c)
            if count:
                embeds = c.seq.request.prompt_embeds
                assert embeds is not None
                width = embeds.hidden
                rows = np.frombuffer(embeds.data, dtype="<f4", count=count * width, offset=first * width * 4)
                x[row + first - c.start : row + first - c.start + count] = torch.from_numpy(
                    rows.reshape(count, width).copy()).to(self.device)  # [count, hidden]
            row += c.num_tokens
        if any(c.seq.request.prompt_media is not None for c in batch.chunks):
            media_rows.write_rows(cast(media_rows.MediaEncoder, self.model), batch, x)
        return x

    def _rows(self, batch: ScheduledBatch) -> tuple[torch.Tensor | None, list[tuple[Sequence, int, int, int]]]:
        """Hidden rows to project: the last row of each sampling chunk, then prompt-logprob rows; None when that is
        every row in order (a step of decodes alone), which needs no gather."""
        sample_rows: list[int] = []
        prompt_rows: list[int] = []
        spans: list[tuple[ScheduledChunk, int, int]] = []  # (chunk, first position, count)
        row = 0
        for c in batch.chunks:
            if c.samples:
                sample_rows.append(row + c.num_tokens - 1)
            first, count = _prompt_logprob_span(c)
            if count:
                spans.append((c, first, count))
                prompt_rows.extend(range(row + first - c.start, row + first - c.start + count))
            row += c.num_tokens
        offset = len(sample_rows)
        out: list[tuple[Sequence, int, int, int]] = []
        for c, first, count in spans:
            out.append((c.seq, first, offset, count))
            offset += count
        if not prompt_rows and len(sample_rows) == row:  # one row per chunk, each sampling: rows 0 .. row - 1
            return None, out
        return torch.tensor(sample_rows + prompt_rows, dtype=torch.int64, device=self.device), out


def _adapter_groups(batch: ScheduledBatch, device: torch.device) -> tuple[RowGroup, ...]:
    """The step's flat token rows that run under LoRA adapters, grouped by adapter (first appearance order)."""
    rows: dict[int, list[int]] = {}
    adapters: dict[int, LoadedAdapter] = {}
    row = 0
    for c in batch.chunks:
        adapter = c.seq.request.adapter
        if adapter is not None:
            assert isinstance(adapter, LoadedAdapter)
            adapters[adapter.uid] = adapter
            rows.setdefault(adapter.uid, []).extend(range(row, row + c.num_tokens))
        row += c.num_tokens
    return tuple(RowGroup(torch.tensor(r, dtype=torch.int64, device=device), adapters[uid].layers,
                          adapters[uid].stack) for uid, r in rows.items())


def _routed_rows(batch: ScheduledBatch, experts: torch.Tensor) -> tuple[RoutedRows, ...]:
    """experts [T, moe layers, top_k] -> the rows of the chunks whose requests ask for them (the engine keeps the
    positions from the request's start it has not had)."""
    out: list[RoutedRows] = []
    row = 0
    for c in batch.chunks:
        if c.seq.request.routed_experts_from is not None:
            out.append(RoutedRows(c.seq, c.start, experts[row : row + c.num_tokens].cpu()))
        row += c.num_tokens
    return tuple(out)


def _rope_positions(batch: ScheduledBatch) -> torch.Tensor | None:
    """The step's M-RoPE positions [3, T] int64 (temporal, height, width) when a request has them (a prompt with
    images, in Qwen2-VL), else None: every token then rotates by its position, which is what its three equal
    positions would give (so the step's other requests get the same rows either way)."""
    rope = [None if c.seq.request.prompt_media is None else c.seq.request.prompt_media.rope_positions
            for c in batch.chunks]
    if all(r is None for r in rope):
        return None
    parts: tuple[list[int], list[int], list[int]] = ([], [], [])
    for c, r in zip(batch.chunks, rope, strict=True):
        end = c.start + c.num_tokens
        span = r.span(c.start, end) if r is not None else (list(range(c.start, end)),) * 3
        for part, values in zip(parts, span, strict=True):
            part.extend(values)
    return torch.tensor(parts, dtype=torch.int64)


def _embedded_span(c: ScheduledChunk) -> tuple[int, int]:
    """(first position, count) of this chunk's prompt positions given as embeddings."""
    embeds = c.seq.request.prompt_embeds
    if embeds is None or c.start >= embeds.num_positions:
        return 0, 0
    return c.start, min(c.num_tokens, embeds.num_positions - c.start)


def _prompt_logprob_span(c: ScheduledChunk) -> tuple[int, int]:
    """(first position, count) of this chunk's positions whose logits predict requested prompt tokens."""
    options = c.seq.request.logprobs
    if options is None or options.start_len < 0:
        return 0, 0
    lo = max(max(options.start_len, 1) - 1, c.start)
    hi = min(c.seq.num_prompt_tokens - 1, c.start + c.num_tokens)
    return lo, max(0, hi - lo)


def _has_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401  (probe only)
    except (ImportError, OSError):
        return False
    return True

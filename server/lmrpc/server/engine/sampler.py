"""The engine side of sampling: per-sequence state, per-step tensors for the kernel, per-row results.

`SamplingState` lives with its sequence (not with a batch slot), so penalties' counts survive preemption. Each step
the `Sampler` turns the sampling rows into one `SamplingInputs` (only the features some row uses), runs the kernel
(lmrpc.kernels.sampling), feeds each sampled token back into its state and returns plain Python results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmrpc.kernels.sampling import (
    LogprobRequest,
    Penalties,
    SamplingInputs,
    SamplingOutput,
    row_argmax,
    sample,
    seed_key,
)
from lmrpc.server.engine.types import LogprobOptions, PositionLogprobs, SamplingParams, TokenLogprob
from lmrpc.server.logit_processors import LogitProcessor


class SamplingState:
    """Sampling state of one sequence: created at admission, kept across preemption."""

    def __init__(
        self, params: SamplingParams, logprobs: LogprobOptions | None, vocab_size: int, device: torch.device | str
    ) -> None:
        self.params = params  # resolved sampling parameters
        self.logprobs = logprobs  # what logprobs to report, or None
        # Occurrences of each generated token, only when a penalty needs them: a fixed [vocab] tensor, so the
        # per-step cost never grows with the output length.
        self.counts: torch.Tensor | None = (
            torch.zeros(vocab_size, dtype=torch.float32, device=device) if params.has_penalties else None
        )
        # Generated ids, only for a custom logit processor (its call signature takes them).
        self.output_ids: list[int] | None = [] if params.logit_processor else None

    def observe(self, token_id: int) -> None:
        """Record one sampled token."""
        if self.counts is not None:
            self.counts[token_id] += 1
        if self.output_ids is not None:
            self.output_ids.append(token_id)


@dataclass
class SamplingRow:
    """One sequence to sample in this step."""

    state: SamplingState  # its sampling state
    num_output_tokens: int  # tokens generated so far (the seed's position key; min_new_tokens)
    grammar_bitmask: torch.Tensor | None = None  # [ceil(V/32)] int32 packed allowed-token bits, or None
    processor: LogitProcessor | None = None  # a custom logit processor bound to its params, or None

    @property
    def plain_greedy(self) -> bool:
        """Greedy, and nothing changes its logits nor is asked of them: its token is the first maximum."""
        p = self.state.params
        return (p.greedy and self.state.counts is None and self.num_output_tokens >= p.min_new_tokens
                and self.grammar_bitmask is None and self.processor is None and not p.logit_bias
                and self.state.logprobs is None)


@dataclass
class SampleResultRow:
    """The token sampled for one row, and its logprobs when asked."""

    token_id: int  # the sampled token
    logprobs: PositionLogprobs | None  # text fields left None (the engine fills text)


class _BoundProcessor:
    """A LogitProcessor bound to its sequence's generated ids: the kernel's one-row callable."""

    def __init__(self, processor: LogitProcessor, output_ids: Sequence[int]) -> None:
        self.processor = processor
        self.output_ids = output_ids

    def __call__(self, row: torch.Tensor) -> torch.Tensor | None:
        return self.processor(row, self.output_ids)


class Sampler:
    """Samples one token per row of a batch of logits, with each row's own parameters."""

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids  # masked, with stop_token_ids, until min_new_tokens exist
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)  # shared by unseeded rows
        self.generator.seed()

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResultRow]:
        """logits [B, vocab] float32, one row per entry of `rows`. Pure: the caller records a token it keeps with
        `SamplingState.observe` (a row may be sampled again, e.g. after a grammar rejected its token)."""
        assert logits.shape[0] == len(rows), f"{logits.shape[0]} logits rows for {len(rows)} sampling rows"
        if logits.shape[1] > self.vocab_size:
            logits = logits[:, : self.vocab_size]  # padded embedding rows are not tokens: never sample them
        if all(r.plain_greedy for r in rows):
            # The whole pass would take each row's argmax of the logits as they are: taken without building its
            # per-step tensors first (after a one-stream decode step's forward on a 2-core host: 0.18 ms, not 0.38).
            return [SampleResultRow(token, None) for token in row_argmax(logits.float()).tolist()]
        inputs = self.build_inputs(rows, logits.shape[1])
        out = sample(logits, inputs)
        token_ids: list[int] = out.token_ids.tolist()
        logprobs = self._logprob_results(rows, token_ids, out)
        return [SampleResultRow(token, lp) for token, lp in zip(token_ids, logprobs, strict=True)]

    # ---- inputs ------------------------------------------------------------------------------------------------

    def build_inputs(self, rows: list[SamplingRow], vocab: int) -> SamplingInputs:
        """The kernel's per-row tensors; a feature no row uses stays None."""
        dev = self.device
        params = [r.state.params for r in rows]
        inputs = SamplingInputs(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
            generator=self.generator,
        )
        sampled = [not p.greedy for p in params]  # filters and seeds only matter for rows that sample
        if any(s and p.top_k not in (-1, 0) and p.top_k < vocab for s, p in zip(sampled, params, strict=True)):
            ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
            inputs.top_k = torch.tensor(ks, dtype=torch.int64, device=dev)
        if any(s and p.top_p < 1.0 for s, p in zip(sampled, params, strict=True)):
            inputs.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        if any(s and p.min_p > 0.0 for s, p in zip(sampled, params, strict=True)):
            inputs.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
        if any(s and p.seed is not None for s, p in zip(sampled, params, strict=True)):
            inputs.seeds = [
                None if p.seed is None else seed_key(p.seed, r.num_output_tokens)
                for p, r in zip(params, rows, strict=True)
            ]
        inputs.penalties = self._penalties(rows)
        self._banned(rows, inputs)
        self._bitmask(rows, inputs)
        self._bias(rows, inputs, vocab)
        inputs.processors = [
            (i, _BoundProcessor(r.processor, r.state.output_ids if r.state.output_ids is not None else ()))
            for i, r in enumerate(rows)
            if r.processor is not None
        ]
        inputs.logprobs = self._logprob_request(rows)
        return inputs

    def _penalties(self, rows: list[SamplingRow]) -> Penalties | None:
        idx = [i for i, r in enumerate(rows) if r.state.counts is not None]
        if not idx:
            return None
        counts = [rows[i].state.counts for i in idx]
        params = [rows[i].state.params for i in idx]
        dev = self.device
        return Penalties(
            rows=torch.tensor(idx, dtype=torch.int64, device=dev),
            counts=torch.stack([c for c in counts if c is not None]),
            frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=dev),
            presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=dev),
            repetition=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=dev),
            additive=any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params),
            multiplicative=any(p.repetition_penalty != 1.0 for p in params),
        )

    def _banned(self, rows: list[SamplingRow], inputs: SamplingInputs) -> None:
        """min_new_tokens: every stop id (EOS ids and stop_token_ids) of a row that is still short gets -inf."""
        row_idx: list[int] = []
        ids: list[int] = []
        for i, r in enumerate(rows):
            p = r.state.params
            if r.num_output_tokens < p.min_new_tokens:
                stop_ids = {t for t in (*self.eos_token_ids, *p.stop_token_ids) if 0 <= t < self.vocab_size}
                row_idx.extend([i] * len(stop_ids))
                ids.extend(stop_ids)
        if ids:
            inputs.banned_rows = torch.tensor(row_idx, dtype=torch.int64, device=self.device)
            inputs.banned_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)

    def _bitmask(self, rows: list[SamplingRow], inputs: SamplingInputs) -> None:
        idx = [i for i, r in enumerate(rows) if r.grammar_bitmask is not None]
        if idx:
            masks = [rows[i].grammar_bitmask for i in idx]
            inputs.bitmask_rows = torch.tensor(idx, dtype=torch.int64, device=self.device)
            inputs.bitmask = torch.stack([m for m in masks if m is not None]).to(self.device)

    def _bias(self, rows: list[SamplingRow], inputs: SamplingInputs, vocab: int) -> None:
        row_idx: list[int] = []
        ids: list[int] = []
        values: list[float] = []
        for i, r in enumerate(rows):
            for token, value in r.state.params.logit_bias.items():
                if 0 <= int(token) < vocab:
                    row_idx.append(i)
                    ids.append(int(token))
                    values.append(float(value))
        if ids:
            dev = self.device
            inputs.bias_rows = torch.tensor(row_idx, dtype=torch.int64, device=dev)
            inputs.bias_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
            inputs.bias_values = torch.tensor(values, dtype=torch.float32, device=dev)

    def _logprob_request(self, rows: list[SamplingRow]) -> LogprobRequest | None:
        opts = [r.state.logprobs for r in rows if r.state.logprobs is not None]
        if not opts:
            return None
        idx = [i for i, r in enumerate(rows) if r.state.logprobs is not None]
        width = max(len(o.token_ids) for o in opts)
        requested = None
        if width:
            padded = [[*o.token_ids, *([0] * (width - len(o.token_ids)))] for o in opts]
            requested = torch.tensor(padded, dtype=torch.int64, device=self.device)
        return LogprobRequest(
            rows=torch.tensor(idx, dtype=torch.int64, device=self.device),
            top_k=max(o.top_k for o in opts),
            requested=requested,
        )

    # ---- results -----------------------------------------------------------------------------------------------

    @staticmethod
    def _logprob_results(
        rows: list[SamplingRow], token_ids: list[int], out: SamplingOutput
    ) -> list[PositionLogprobs | None]:
        results: list[PositionLogprobs | None] = [None] * len(rows)
        if out.chosen_logprobs is None:
            return results
        chosen: list[float] = out.chosen_logprobs.tolist()
        top_ids: list[list[int]] = out.top_ids.tolist() if out.top_ids is not None else []
        top_lps: list[list[float]] = out.top_logprobs.tolist() if out.top_logprobs is not None else []
        req_lps: list[list[float]] = out.requested_logprobs.tolist() if out.requested_logprobs is not None else []
        j = 0
        for i, r in enumerate(rows):
            opts = r.state.logprobs
            if opts is None:
                continue
            k, n_req = opts.top_k, len(opts.token_ids)
            top = tuple(map(TokenLogprob, top_ids[j][:k], top_lps[j][:k])) if k else ()
            requested = tuple(map(TokenLogprob, opts.token_ids, req_lps[j][:n_req])) if n_req else ()
            results[i] = PositionLogprobs(TokenLogprob(token_ids[i], chosen[j]), top, requested)
            j += 1
        return results


def prompt_logprobs(logits: torch.Tensor, target_ids: list[int], opts: LogprobOptions) -> list[PositionLogprobs]:
    """Logprobs of the raw distribution: logits [k, vocab] of the positions predicting target_ids (in order).

    When the last position predicts a token not yet known (the chunk reaches the prompt's end), there are fewer
    targets than logits rows and the extra rows are ignored.
    """
    n = len(target_ids)
    if n == 0:
        return []
    logprobs = torch.log_softmax(logits[:n].float(), dim=-1)  # [n, vocab]
    targets = torch.tensor(target_ids, dtype=torch.int64, device=logits.device)
    chosen: list[float] = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
    top_ids: list[list[int]] = [[] for _ in range(n)]
    top_lps: list[list[float]] = [[] for _ in range(n)]
    if opts.top_k > 0:
        values, ids = logprobs.topk(min(opts.top_k, logprobs.shape[1]), dim=-1)
        top_ids, top_lps = ids.tolist(), values.tolist()
    req_lps: list[list[float]] = [[] for _ in range(n)]
    if opts.token_ids:
        req = torch.tensor(opts.token_ids, dtype=torch.int64, device=logits.device)
        req_lps = logprobs[:, req].tolist()
    return [
        PositionLogprobs(
            chosen=TokenLogprob(target_ids[i], chosen[i]),
            top=tuple(TokenLogprob(t, lp) for t, lp in zip(top_ids[i], top_lps[i], strict=True)),
            requested=tuple(TokenLogprob(t, lp) for t, lp in zip(opts.token_ids, req_lps[i], strict=True)),
        )
        for i in range(n)
    ]

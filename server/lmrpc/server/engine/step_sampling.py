"""What one step samples: each generating row's next token from its logits, with its sampling state, grammar mask
and logit processor; prompt-scoring rows (max_new_tokens == 0) get none. Rows sampled before their grammar's mask
was known (LiveRequest.lazy_grammar: the mask is filled only when needed) whose token the grammar rejects are
sampled again with the mask, which gives the token the mask would have given from the start."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmrpc.server.engine.grammar import GrammarMatcher, MaskFiller
from lmrpc.server.engine.live import LiveRequest
from lmrpc.server.engine.sampler import Sampler, SampleResultRow, SamplingRow

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class StepSampler:
    sampler: Sampler  # the batch sampler (temperature, top-k/p, penalties, processors, logprobs)
    masks: MaskFiller  # grammar bitmasks: filled while the model runs, or now for rejected rows
    device: torch.device  # where the logits are

    def sample(self, lives: list[LiveRequest], logits: torch.Tensor,
               masks: torch.Tensor | None) -> list[SampleResultRow | None]:
        """The next token of each row of `lives` (logits [len(lives), vocab] in the same order), None for a
        prompt-scoring row. masks: [len(lives), words] allowed-token bits, row i for lives[i] (None: no row is
        constrained)."""
        return self._resample_rejected(lives, logits, self._sample(lives, logits, masks))

    def _sample(self, lives: list[LiveRequest], logits: torch.Tensor,
                masks: torch.Tensor | None) -> list[SampleResultRow | None]:
        keep = [i for i, live in enumerate(lives) if live.request.params.max_new_tokens > 0]
        results: list[SampleResultRow | None] = [None] * len(lives)
        if not keep:
            return results
        rows_logits = logits if len(keep) == len(lives) else logits[keep]  # [rows, vocab]
        if masks is not None:
            masks = masks.to(self.device)
        rows = [
            SamplingRow(
                state=lives[i].sampling,
                num_output_tokens=lives[i].seq.num_output_tokens,
                grammar_bitmask=None if masks is None or lives[i].grammar is None else masks[i],
                processor=lives[i].processor,
            )
            for i in keep
        ]
        for i, row in zip(keep, self.sampler.sample(rows_logits, rows), strict=True):
            results[i] = row
        return results

    def _resample_rejected(self, lives: list[LiveRequest], logits: torch.Tensor,
                           results: list[SampleResultRow | None]) -> list[SampleResultRow | None]:
        rejected: list[int] = []
        grammars: list[GrammarMatcher] = []
        for i, (live, result) in enumerate(zip(lives, results, strict=True)):
            grammar = live.grammar
            if (result is not None and live.lazy_grammar and grammar is not None
                    and not grammar.allows(result.token_id)):
                rejected.append(i)
                grammars.append(grammar)
        if not rejected:
            return results
        masks = self.masks.fill_now(grammars).to(self.device)  # [rejected, words]
        rows = [SamplingRow(lives[i].sampling, lives[i].seq.num_output_tokens, masks[j], lives[i].processor)
                for j, i in enumerate(rejected)]
        for i, row in zip(rejected, self.sampler.sample(logits[rejected], rows), strict=True):
            results[i] = row
        return results

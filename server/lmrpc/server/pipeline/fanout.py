"""A call's prompts -> the engine's requests: the one fan-out every front door uses.

A service validates its wire request into `PromptPlan`s, one per prompt (sampling resolved, its constraint checked,
its media placed, its adapter resolved); `engine_requests` makes `samples` outputs of each, prompt-major. Sample s
is seeded seed + s (seeded samples must differ); samples 1.. reuse sample 0's prompt pages (its prefill shared
through the prefix cache); ids are the plan's id for one sample, else "id/s", so Abort by rid ends them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from lmrpc.server.engine.types import (
    AdapterRef,
    EngineRequest,
    HiddenStatesMode,
    LogprobOptions,
    PromptEmbeddings,
    SamplingParams,
)
from lmrpc.server.models.types import PromptMedia


@dataclass(frozen=True)
class PromptPlan:
    """One prompt of a call, validated: what all of its outputs share."""

    request_id: str  # its outputs' id: the one output's own, or the stem of "id/s" for more samples
    rid: str  # the user-facing request id (Abort by rid ends every output sharing it)
    prompt_ids: tuple[int, ...]  # the prompt's tokens (media placeholders expanded; embeddings: placeholder ids)
    params: SamplingParams  # resolved, its constraint checked (frontend.check_constraint)
    samples: int = 1  # outputs of this prompt (n; best_of for OpenAI's Complete)
    logprobs: LogprobOptions | None = None  # None: no logprobs
    adapter: AdapterRef | None = None  # the LoRA adapter; None: the base model
    prompt_embeds: PromptEmbeddings | None = None  # the prompt as embeddings, when sent so
    prompt_media: PromptMedia | None = None  # images and audio placed in the prompt, for the executor
    hidden_states: HiddenStatesMode | None = None  # return hidden states; None: don't
    routed_experts_from: int | None = None  # return routed experts from this position on; None: don't

    def __post_init__(self) -> None:
        assert self.samples >= 1, self.samples


def engine_requests(plans: Sequence[PromptPlan]) -> list[EngineRequest]:
    """Every plan's outputs in call order (the index an output is answered under)."""
    out: list[EngineRequest] = []
    for plan in plans:
        for s in range(plan.samples):
            seed = None if plan.params.seed is None else plan.params.seed + s
            out.append(EngineRequest(
                request_id=plan.request_id if plan.samples == 1 else f"{plan.request_id}/{s}", rid=plan.rid,
                index=len(out), prompt_ids=plan.prompt_ids, params=replace(plan.params, seed=seed, n=plan.samples),
                logprobs=plan.logprobs, share_prefill_with=None if s == 0 else f"{plan.request_id}/0",
                adapter=plan.adapter, prompt_embeds=plan.prompt_embeds, prompt_media=plan.prompt_media,
                hidden_states=plan.hidden_states, routed_experts_from=plan.routed_experts_from,
            ))
    return out

"""What a new user meets first, against the real server with the default model (bfloat16, the GGUF's own int4
blocks): a request's answer does not depend on what else the server is doing. Every prompt here is new to the
server, so the first call of each comparison computes it cold; nothing is warmed.

- the same greedy request twice (the second a prefix-cache hit) returns the same tokens and logprobs;
- a prompt alone and the same prompt inside a batch of three agree;
- with logprobs, the greedy token is the best reported token at every position, and logprobs are float32 values,
  not bfloat16 steps;
- a seeded sampled request alone and inside a busy batch agree.
"""

from __future__ import annotations

import threading
import uuid
from typing import TYPE_CHECKING

from lmrpc.client import Client, GenerateResult

if TYPE_CHECKING:
    from tests.e2e.conftest import RunningServer

NEW = 48


def fresh(prompt: str) -> str:
    """A prompt no earlier call sent (so its first computation is cold)."""
    return f"[{uuid.uuid4().hex[:8]}] {prompt}"


def greedy_with_logprobs(client: Client, prompts: list[str]) -> list[GenerateResult]:
    return client.generate(prompts, sampling_params={"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
                           return_logprob=True, top_logprobs_num=5)


def same(a: GenerateResult, b: GenerateResult) -> bool:
    return a.token_ids == b.token_ids and a.text == b.text and a.output_logprobs == b.output_logprobs


def test_the_same_greedy_request_twice_returns_the_same_answer(client: Client) -> None:
    prompt = fresh("Write a short story about a lighthouse keeper who finds a message in a bottle.")
    [cold] = greedy_with_logprobs(client, [prompt])
    [hit] = greedy_with_logprobs(client, [prompt])
    assert cold.usage is not None and hit.usage is not None
    assert cold.usage.cached_tokens == 0 and hit.usage.cached_tokens == hit.usage.prompt_tokens - 1
    assert same(cold, hit)


def test_a_prompt_alone_and_inside_a_batch_of_three_agree(client: Client) -> None:
    prompts = [fresh("The history of the printing press"), fresh("Explain photosynthesis to a child."),
               fresh("A recipe for pancakes:")]
    batch = greedy_with_logprobs(client, prompts)
    for i, prompt in enumerate(prompts):
        [alone] = greedy_with_logprobs(client, [prompt])  # now a prefix-cache hit, and alone
        assert same(alone, batch[i]), i


def test_the_greedy_token_is_the_best_logprob_at_every_position(client: Client) -> None:
    [r] = greedy_with_logprobs(client, [fresh("List the planets of the solar system in order:")])
    assert len(r.output_logprobs) == len(r.token_ids) == NEW
    values = set()
    for token, position in zip(r.token_ids, r.output_logprobs, strict=True):
        assert position.chosen is not None and position.top
        assert position.top[0].token_id == token and position.top[0].logprob == position.chosen.logprob
        values.update(t.logprob for t in position.top if t.logprob is not None)
    # float32 logits: logprobs are not confined to multiples of 1/8 as bfloat16 logits made them
    assert sum(1 for v in values if (v * 8) != round(v * 8)) > len(values) // 2


def test_a_seeded_request_alone_and_in_a_busy_batch_agree(client: Client, server: RunningServer) -> None:
    prompt = fresh("Invent a name for a new color and describe it:")
    params = {"max_new_tokens": NEW, "temperature": 0.9, "top_p": 0.95, "sampling_seed": 42, "ignore_eos": True}
    [alone] = client.generate(prompt, sampling_params=params, return_logprob=True, top_logprobs_num=3)
    results: dict[str, GenerateResult] = {}

    def busy(i: int) -> None:
        with Client(server.target) as other:
            [r] = other.generate(fresh(f"Tell me fact number {i} about octopuses."),
                                 sampling_params={"max_new_tokens": 64, "temperature": 1.0, "ignore_eos": True})
            results[f"busy{i}"] = r

    threads = [threading.Thread(target=busy, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    [batched] = client.generate(prompt, sampling_params=params, return_logprob=True, top_logprobs_num=3)
    for t in threads:
        t.join()
    assert len(results) == 6
    assert same(alone, batched)

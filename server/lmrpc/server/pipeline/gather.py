"""One output's deltas gathered: the one accumulator behind a merged Generate answer, an OpenAI choice and SMG's
GenerateComplete. The engine streams `EngineOutput` deltas; a service that answers once per output (or needs an
output's whole text, tokens or logprobs at its end) adds each delta here."""

from __future__ import annotations

from dataclasses import dataclass, field

from lmrpc.server.engine.types import EngineOutput, Finish, PositionLogprobs, RoutedExperts, Usage


@dataclass
class Gathered:
    """What one output has produced so far."""

    token_ids: list[int] = field(default_factory=list)  # generated ids, in order
    text_pieces: list[str] = field(default_factory=list)  # text pieces, in order
    output_logprobs: list[PositionLogprobs] = field(default_factory=list)  # one per generated token, when asked
    input_logprobs: list[PositionLogprobs] = field(default_factory=list)  # the prompt's, when asked
    hidden_states: list[bytes] = field(default_factory=list)  # hidden-state rows in position order, when asked
    routed: list[RoutedExperts] = field(default_factory=list)  # routed-expert pieces in position order, when asked
    finish: Finish | None = None  # set once finished
    usage: Usage | None = None  # the output's token counts (known once finished)

    def add(self, out: EngineOutput) -> None:
        self.token_ids.extend(out.token_ids)
        self.text_pieces.append(out.text)
        self.output_logprobs.extend(out.output_logprobs)
        self.input_logprobs.extend(out.input_logprobs)
        self.hidden_states.extend(out.hidden_states)
        if out.routed_experts is not None:
            self.routed.append(out.routed_experts)
        if out.finish is not None:
            self.finish = out.finish
        if out.usage is not None:
            self.usage = out.usage

    @property
    def text(self) -> str:
        return "".join(self.text_pieces)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (0 until finished)."""
        return self.usage.cached_tokens if self.usage is not None else 0

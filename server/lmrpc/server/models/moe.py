"""Mixture-of-experts decoder models: Qwen2-MoE, Qwen3-MoE, Mixtral and OLMoE.

Attention, norms, embeddings and the output projection are the Llama family's (`llama.py`); each sparse layer's MLP
is a router and experts. The router's logits (float32) go through a softmax; the top_k experts per token are kept,
their probabilities renormalized to sum to 1 where the config says (Mixtral always; Qwen's and OLMoE's
`norm_topk_prob`). A Qwen2-MoE layer adds a shared expert scaled by the sigmoid of its own gate. Layers that a config
keeps dense (`mlp_only_layers`, `decoder_sparse_step`) are ordinary Llama layers. OLMoE normalizes q and k with
RMSNorms over their full width (all heads at once, not per head as Qwen3-MoE) and may clip q, k and v (`clip_qkv`):
done here on the qkv product's rows, before attention.

Experts run grouped: the (token, slot) pairs are sorted by expert, and each active expert runs one product over its
tokens' rows (no Python loop over tokens). Every product is a `LinearLayer` whose rows do not depend on the row
count, the softmax and top-k are per row, and a token's expert outputs are summed in slot order, so a token's bits
do not depend on which other tokens share the step: route invariance holds as for the dense models.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig

from lmrpc.kernels.paged import QKNorm
from lmrpc.server.models import ForwardContext, register
from lmrpc.server.models.linear import LinearLayer
from lmrpc.server.models.llama import Layer, LlamaForCausalLM
from lmrpc.server.models.lora_delta import RowGroup
from lmrpc.server.models.quantized import LinearBuilder
from lmrpc.server.models.types import ExpertsInfo
from lmrpc.server.models.weights import WeightSource, stack_rows


@dataclass(frozen=True)
class MoEFamily:
    """How one architecture names and configures its experts."""

    block: str  # the sparse MLP's module name in a layer ("mlp", Mixtral's "block_sparse_moe")
    projections: tuple[str, str, str]  # an expert's gate, up and down weights ("gate_proj", ...; Mixtral w1, w3, w2)
    experts_key: str  # the config attribute with the number of experts
    always_normalize: bool  # renormalize top-k weights whatever the config says (Mixtral)
    qk_norm: bool  # per-head q/k RMSNorms (Qwen3-MoE)
    full_qk_norm: bool = False  # q/k RMSNorms over all heads at once (OLMoE)

    def __post_init__(self) -> None:
        assert len(self.projections) == 3 and self.block and self.experts_key


FAMILIES: dict[str, MoEFamily] = {
    "Qwen2MoeForCausalLM": MoEFamily("mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts", False, False),
    "Qwen3MoeForCausalLM": MoEFamily("mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts", False, True),
    "MixtralForCausalLM": MoEFamily("block_sparse_moe", ("w1", "w3", "w2"), "num_local_experts", True, False),
    "OlmoeForCausalLM": MoEFamily("mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts", False, False,
                                  full_qk_norm=True),
}


@dataclass(frozen=True)
class FullQKNorm:
    """OLMoE's attention prologue on the qkv product's rows: RMSNorms over the whole q and the whole k (every
    head at once), then q, k and v clipped to [-clip, clip] when the config sets clip_qkv. Per row."""

    q: torch.Tensor  # [heads * head_dim] float32
    k: torch.Tensor  # [kv_heads * head_dim] float32
    eps: float  # the RMSNorms' epsilon
    clip: float | None  # clip_qkv; None: no clipping

    def __call__(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [T, (heads + 2 kv_heads) * head_dim] -> the same, q and k normalized (and all clipped)."""
        q_width, k_width = self.q.numel(), self.k.numel()
        x = qkv.float()
        q, k, v = x[:, :q_width], x[:, q_width : q_width + k_width], x[:, q_width + k_width :]
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + self.eps) * self.q
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + self.eps) * self.k
        out = torch.cat([q, k, v], dim=-1)  # [T, (heads + 2 kv_heads) * head_dim]
        if self.clip is not None:
            out = out.clamp(-self.clip, self.clip)
        return out.to(qkv.dtype).contiguous()


@dataclass(frozen=True)
class ExpertsShape:
    """The expert layout of one model, read once from the HF config."""

    experts: int  # experts per sparse layer
    top_k: int  # experts each token is routed to
    normalize: bool  # renormalize the kept top-k probabilities to sum to 1
    sparse_layers: tuple[int, ...]  # indices of the layers with experts (the others are dense)

    def __post_init__(self) -> None:
        assert 1 <= self.top_k <= self.experts, f"top_k {self.top_k} must be in [1, {self.experts}]"

    @classmethod
    def from_hf(cls, config: PretrainedConfig, family: MoEFamily) -> ExpertsShape:
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        sparse = tuple(i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
        normalize = family.always_normalize or bool(getattr(config, "norm_topk_prob", False))
        return cls(int(getattr(config, family.experts_key)), int(config.num_experts_per_tok), normalize, sparse)


@dataclass(frozen=True)
class SparseMLP:
    """A layer's router and experts (and shared expert), on the post-attention RMSNorm's output."""

    router: LinearLayer  # [hidden] -> [experts (+ 1: the shared expert's gate logit, when there is one)]
    gate_up: tuple[LinearLayer, ...]  # per expert, [hidden] -> [2 * moe_intermediate] (gate rows, then up rows)
    down: tuple[LinearLayer, ...]  # per expert, [moe_intermediate] -> [hidden]
    shared_gate_up: LinearLayer | None  # the shared expert's, or None
    shared_down: LinearLayer | None
    top_k: int  # experts per token
    normalize: bool  # renormalize the top-k weights

    def __call__(self, x: torch.Tensor, norm: torch.Tensor, eps: float, routed: list[torch.Tensor] | None
                 ) -> torch.Tensor:
        """x [T, hidden] (the residual stream) -> x + the MLP's output [T, hidden]; appends this layer's chosen
        experts [T, top_k] int32 to `routed` when given."""
        num_experts = len(self.gate_up)
        tokens, hidden = x.shape
        logits = self.router(x, norm=norm, eps=eps).float()  # [T, experts (+1)]
        probs = torch.softmax(logits[:, :num_experts], dim=-1)  # [T, experts]
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [T, top_k] each, best first
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if routed is not None:
            routed.append(chosen.to(torch.int32))
        flat = chosen.reshape(-1)  # [T * top_k]: pair p is token p // top_k, slot p % top_k
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        counts = torch.bincount(flat, minlength=num_experts).tolist()
        outputs = torch.empty(tokens * self.top_k, hidden, dtype=torch.float32, device=x.device)  # [pairs, hidden]
        start = 0
        for expert, count in enumerate(counts):  # one product per active expert, over all of its tokens
            if count == 0:
                continue
            pairs = order[start : start + count]
            rows = x.index_select(0, pairs // self.top_k)  # [count, hidden]
            gate_up = self.gate_up[expert](rows, norm=norm, eps=eps)  # [count, 2 * moe_intermediate]
            outputs[pairs] = self.down[expert](gate_up, silu=True).float()
            start += count
        outputs = outputs.view(tokens, self.top_k, hidden)
        mixed = outputs[:, 0] * weights[:, :1]  # [T, hidden]; slots summed in order: a row's bits are its own
        for slot in range(1, self.top_k):
            mixed = mixed + outputs[:, slot] * weights[:, slot : slot + 1]
        if self.shared_gate_up is not None and self.shared_down is not None:
            shared = self.shared_down(self.shared_gate_up(x, norm=norm, eps=eps), silu=True).float()  # [T, hidden]
            mixed = mixed + torch.sigmoid(logits[:, num_experts:]) * shared
        return x + mixed

    def linears(self) -> list[LinearLayer]:
        shared = [lin for lin in (self.shared_gate_up, self.shared_down) if lin is not None]
        return [self.router, *self.gate_up, *self.down, *shared]


@dataclass(frozen=True)
class MoEDecoderLayer:
    """A decoder layer whose MLP is a SparseMLP."""

    index: int  # its KV cache in the attention backend
    input_norm: torch.Tensor  # [hidden] float32
    post_attention_norm: torch.Tensor  # [hidden] float32
    qk_norm: QKNorm | None  # Qwen3-MoE's per-head norms
    qkv: LinearLayer  # [hidden] -> [(heads + 2 kv_heads) * head_dim]
    o: LinearLayer  # [heads * head_dim] -> [hidden]
    mlp: SparseMLP  # router and experts
    # where forward appends the chosen experts [T, top_k] of each sparse layer, when the model records routing
    routed: list[list[torch.Tensor]] = field(default_factory=list)
    full_qk_norm: FullQKNorm | None = None  # OLMoE's whole-width q/k norms (and clipping)

    def __call__(self, x: torch.Tensor, ctx: ForwardContext, eps: float,
                 lora: tuple[RowGroup, ...] = ()) -> torch.Tensor:
        """x [T, hidden] float32 -> [T, hidden]."""
        assert not lora, "the LoRA registry loads no adapter for an MoE model (accepts_adapters is False)"
        qkv = self.qkv(x, norm=self.input_norm, eps=eps)  # [T, (heads + 2 kv_heads) * head_dim]
        if self.full_qk_norm is not None:
            qkv = self.full_qk_norm(qkv)
        attn = ctx.attention(self.index, qkv, ctx.plan, self.qk_norm)  # [T, heads * head_dim]
        x = self.o(attn, residual=x)
        return self.mlp(x, self.post_attention_norm, eps, self.routed[0] if self.routed else None)

    def linears(self) -> list[LinearLayer]:
        return [self.qkv, self.o, *self.mlp.linears()]


@register(*FAMILIES)
class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-family model whose sparse layers route each token to top_k experts (see the module doc)."""

    accepts_adapters = False  # expert products have no place for LoRA deltas yet

    QK_NORM_ARCHITECTURES = frozenset(a for a, f in FAMILIES.items() if f.qk_norm)

    def __init__(self, config: PretrainedConfig, weights: WeightSource, builder: LinearBuilder) -> None:
        arch = (config.architectures or ["MixtralForCausalLM"])[0]
        self.family = FAMILIES[arch]
        self.experts = ExpertsShape.from_hf(config, self.family)
        self._routing_sink: list[list[torch.Tensor]] = []  # shared by the sparse layers: [] or [this step's list]
        super().__init__(config, weights, builder)

    def _layer(self, w: WeightSource, builder: LinearBuilder, i: int) -> Layer:
        if i not in self.experts.sparse_layers:
            return super()._layer(w, builder, i)
        p = f"model.layers.{i}.{self.family.block}."
        gate, up, down = self.family.projections
        num = self.experts.experts
        router_rows = [w.matrix(p + "gate.weight")]  # [experts, hidden]
        shared = w.has(p + "shared_expert_gate.weight")
        if shared:
            router_rows.append(w.matrix(p + "shared_expert_gate.weight"))  # [1, hidden]: one product for both
        a = self.attention_parts(w, builder, i)
        mlp = SparseMLP(
            router=builder.build(stack_rows(router_rows)),
            gate_up=tuple(builder.build(stack_rows([w.matrix(p + f"experts.{e}.{gate}.weight"),
                                                    w.matrix(p + f"experts.{e}.{up}.weight")]))
                          for e in range(num)),
            down=tuple(builder.build(w.matrix(p + f"experts.{e}.{down}.weight"), gated_inputs=True)
                       for e in range(num)),
            shared_gate_up=builder.build(stack_rows([w.matrix(p + "shared_expert.gate_proj.weight"),
                                                     w.matrix(p + "shared_expert.up_proj.weight")]))
            if shared else None,
            shared_down=(builder.build(w.matrix(p + "shared_expert.down_proj.weight"), gated_inputs=True)
                         if shared else None),
            top_k=self.experts.top_k, normalize=self.experts.normalize,
        )
        full = None
        if self.family.full_qk_norm:
            clip = getattr(self.config, "clip_qkv", None)
            s = self.shape  # OLMoE's norms span all heads: [heads * head_dim], [kv_heads * head_dim]
            full = FullQKNorm(self._vector(w, f"model.layers.{i}.self_attn.q_norm.weight", s.heads * s.head_dim),
                              self._vector(w, f"model.layers.{i}.self_attn.k_norm.weight", s.kv_heads * s.head_dim),
                              self.shape.eps,
                              None if clip is None else float(clip))
        return MoEDecoderLayer(i, a.input_norm, a.post_attention_norm, a.qk_norm, a.qkv, a.o, mlp,
                               self._routing_sink, full)

    def experts_info(self) -> ExpertsInfo:
        return ExpertsInfo(len(self.experts.sparse_layers), self.experts.experts, self.experts.top_k)

    def forward_routed(self, input_ids: torch.Tensor, ctx: ForwardContext, input_embeds: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward, and the experts each token was routed to: [T, sparse layers, top_k] int32."""
        step: list[torch.Tensor] = []
        self._routing_sink.append(step)
        try:
            hidden = self.forward(input_ids, ctx, input_embeds)
        finally:
            self._routing_sink.clear()
        return hidden, torch.stack(step, dim=1)

"""Our Llama-family model (Llama/SmolLM2, Mistral, Qwen2 with qkv bias, Qwen3 with per-head q/k norms).

The forward pass takes a flat batch of tokens from many sequences with their positions; attention reads and
writes the paged KV cache described by `AttentionMetadata`. Projections are fused (qkv, gate_up) so a layer is
four matmuls, each through the `LinearLayer` interface.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from lmrpc.kernels.attention import AttentionFn, AttentionMetadata
from lmrpc.server.models import register
from lmrpc.server.models.linear import DenseLinear, Workspace, activation_dtype


@dataclass(frozen=True)
class LlamaShape:
    """The architecture's sizes and switches, read once from the HF config."""

    hidden: int  # model width
    layers: int  # decoder layers
    heads: int  # query heads
    kv_heads: int  # key/value heads (GQA when < heads)
    head_dim: int  # per-head width
    intermediate: int  # MLP width
    vocab: int  # embedding rows
    eps: float  # RMSNorm epsilon
    tie_embeddings: bool  # lm_head shares the embedding matrix
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k

    def __post_init__(self) -> None:
        assert self.heads % self.kv_heads == 0, "query heads must be a multiple of kv heads"

    @classmethod
    def from_hf(cls, config: PretrainedConfig, qk_norm: bool) -> LlamaShape:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            hidden=config.hidden_size, layers=config.num_hidden_layers, heads=config.num_attention_heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim, intermediate=config.intermediate_size, vocab=config.vocab_size,
            eps=config.rms_norm_eps, tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qk_norm=qk_norm,
        )


def rope_tables(config: PretrainedConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_positions, head_dim] float32, for any rope type transformers knows."""
    params = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        scale = 1.0
    else:
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())  # [pos, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)  # [pos, head_dim]: the rotate-half layout
    return angles.cos() * scale, angles.sin() * scale


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., head_dim] -> the table apply_rope takes: its first half negated."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, 1, head_dim], sin from `signed_sin`.

    rotate_half(x) * sin == roll(x, half) * signed_sin(sin): the same products, in three ops instead of six (a
    decode step's cost is mostly per-op overhead)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Spelled out: on this CPU, F.rms_norm of one 576-wide row costs ~25 us, these few ops ~10 us.
        # sum * (1 / n), not mean: mean is a sum and a division, one more op.
        inv_rms = x.square().sum(-1, keepdim=True).mul_(1.0 / x.shape[-1]).add_(self.eps).rsqrt_()  # [T, 1]
        return x * inv_rms * self.weight


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape, qkv: DenseLinear, o: DenseLinear, gate_up: DenseLinear,
                 down: DenseLinear) -> None:
        super().__init__()
        self.shape = shape
        self.input_norm = RMSNorm(shape.hidden, shape.eps)
        self.post_attention_norm = RMSNorm(shape.hidden, shape.eps)
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.q_norm = RMSNorm(shape.head_dim, shape.eps) if shape.qk_norm else None
        self.k_norm = RMSNorm(shape.head_dim, shape.eps) if shape.qk_norm else None
        self.scale = shape.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, attention: AttentionFn) -> torch.Tensor:
        """x [T, hidden] in the activation dtype; cos/sin [T, 1, head_dim] (sin signed, see apply_rope)."""
        s = self.shape
        t = x.shape[0]
        q_width, kv_width = s.heads * s.head_dim, s.kv_heads * s.head_dim
        qk, v = self.qkv(self.input_norm(x)).split([q_width + kv_width, kv_width], dim=-1)
        qk = qk.reshape(t, s.heads + s.kv_heads, s.head_dim)  # [T, heads + kv_heads, head_dim]
        v = v.reshape(t, s.kv_heads, s.head_dim)  # [T, kv_heads, head_dim]
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, : s.heads]), self.k_norm(qk[:, s.heads :])], dim=1)
        qk = apply_rope(qk, cos, sin)  # q and k rotated together: one pass instead of two
        q, k = qk[:, : s.heads], qk[:, s.heads :]  # [T, heads, head_dim], [T, kv_heads, head_dim]
        attn = attention(q, k, v, k_cache, v_cache, meta, self.scale)  # [T, heads, head_dim]
        x = x + self.o(attn.reshape(t, q_width))
        # SiLU * up stays in the activation dtype: keeping the o and gate_up -> down outputs in bf16 on CPU (bf16
        # element-wise ops, mixed-dtype residual sums) measured 0.9x at 32 sequences, conversions saved included
        gate, up = self.gate_up(self.post_attention_norm(x)).chunk(2, dim=-1)  # [T, intermediate] each
        return x + self.down(F.silu(gate) * up)


@register("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
class LlamaForCausalLM(nn.Module):
    """Built from an HF config and its safetensors weights (see `from_weights`)."""

    def __init__(self, config: PretrainedConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        arch = (config.architectures or ["LlamaForCausalLM"])[0]
        self.shape = shape = LlamaShape.from_hf(config, qk_norm=arch == "Qwen3ForCausalLM")
        self.max_positions = int(config.max_position_embeddings)
        # Matrices are stored in `dtype`; activations, norms and RoPE tables in `act` (see linear.py).
        self.act = act = activation_dtype(dtype, device)
        w = {name.removeprefix("model."): t.to(dtype) for name, t in weights.items()}
        workspace = Workspace.for_device(device, dtype)
        self.embed = nn.Embedding.from_pretrained(w["embed_tokens.weight"], freeze=True)
        self.layers = nn.ModuleList(self._layer(shape, w, i, act, workspace) for i in range(shape.layers))
        self.norm = RMSNorm(shape.hidden, shape.eps)
        self.norm.weight.data = w["norm.weight"].to(act)
        head = w["embed_tokens.weight"] if shape.tie_embeddings or "lm_head.weight" not in w else w["lm_head.weight"]
        self.lm_head = DenseLinear(head, workspace=workspace)
        cos, sin = rope_tables(config, self.max_positions)
        self.cos: torch.Tensor  # [max_positions, head_dim]
        self.sin: torch.Tensor  # [max_positions, head_dim], first half negated
        self.register_buffer("cos", cos.to(act), persistent=False)
        self.register_buffer("sin", signed_sin(sin).to(act), persistent=False)  # signed: see apply_rope
        self.to(device)

    @staticmethod
    def _layer(shape: LlamaShape, w: dict[str, torch.Tensor], i: int, act: torch.dtype,
               workspace: Workspace) -> DecoderLayer:
        p = f"layers.{i}."

        def cat(names: Iterable[str]) -> torch.Tensor:
            return torch.cat([w[p + n] for n in names], dim=0)

        qkv_names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        bias = cat(n + ".bias" for n in qkv_names).to(act) if p + "self_attn.q_proj.bias" in w else None
        layer = DecoderLayer(
            shape,
            qkv=DenseLinear(cat(n + ".weight" for n in qkv_names), bias, workspace),
            o=DenseLinear(w[p + "self_attn.o_proj.weight"], workspace=workspace),
            gate_up=DenseLinear(cat(("mlp.gate_proj.weight", "mlp.up_proj.weight")), workspace=workspace),
            down=DenseLinear(w[p + "mlp.down_proj.weight"], workspace=workspace),
        )
        layer.input_norm.weight.data = w[p + "input_layernorm.weight"].to(act)
        layer.post_attention_norm.weight.data = w[p + "post_attention_layernorm.weight"].to(act)
        if layer.q_norm is not None and layer.k_norm is not None:
            layer.q_norm.weight.data = w[p + "self_attn.q_norm.weight"].to(act)
            layer.k_norm.weight.data = w[p + "self_attn.k_norm.weight"].to(act)
        return layer

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim) of the cache this model needs."""
        return self.shape.layers, self.shape.kv_heads, self.shape.head_dim

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache is stored like the weights (half precision halves its memory)."""
        return self.embed.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        """input_ids, positions [T]; kv_cache [layers, 2, slots, kv_heads, head_dim] -> hidden [T, hidden]."""
        x = self.embed(input_ids).to(self.act)  # [T, hidden]
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[i, 0], kv_cache[i, 1], meta, attention)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        return self.lm_head(hidden).float()

"""Our Llama-family model (Llama/SmolLM2, Mistral, Qwen2 with qkv bias, Qwen3 with per-head q/k norms).

The forward pass takes a flat batch of tokens from many sequences; attention reads and writes the paged KV cache
through the step's `ForwardContext` (backend + plan). A decoder layer is five calls: the fused qkv product (the
input RMSNorm fused in), attention (q/k norms, RoPE, cache write), the output product (residual added), the fused
gate_up product (the post-attention RMSNorm fused in) and the down product (SiLU-and-multiply fused in, residual
added). Every product goes through `LinearLayer`, in whatever format `LinearBuilder` chose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from lmrpc.kernels import native
from lmrpc.kernels.attention import select_backend
from lmrpc.kernels.native_attention import NativeAttention
from lmrpc.kernels.paged import AttentionBackend, AttentionShape, QKNorm, Rope
from lmrpc.server.models import ForwardContext, register
from lmrpc.server.models.linear import LinearLayer
from lmrpc.server.models.lora_delta import RowGroup, add_delta
from lmrpc.server.models.quantized import LinearBuilder, NativeLinear
from lmrpc.server.models.weights import Matrix, WeightSource, expect_shape, matrix_shape, stack_rows


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


def rope_tables(config: PretrainedConfig, max_positions: int) -> Rope:
    """RoPE tables for any rope type transformers knows (float32, sin signed: see torch_attention.apply_rope), with
    the config's M-RoPE sections where it has them (Qwen2-VL's `mrope_section`: see paged.Rope)."""
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
    sin = angles.sin() * scale
    half = sin.shape[-1] // 2
    signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)  # rotate_half folded into the table
    sections = tuple(int(n) for n in params.get("mrope_section") or ())
    return Rope((angles.cos() * scale).contiguous(), signed.contiguous(), sections)


@dataclass(frozen=True)
class _NativeStack:
    """The native decoder stack and the attention backend whose caches it was built over."""

    backend: NativeAttention  # forwards with this backend's plan may use the stack
    # native DecoderStack: forward(x, rope_index, slots, block_table, token_seq, token_ctx, lora, rope_cos, rope_sin)
    stack: Any


@dataclass(frozen=True)
class AttentionParts:
    """A layer's norms and attention products, as read from the checkpoint (what every layer kind shares)."""

    input_norm: torch.Tensor  # [hidden] float32, fused into qkv
    post_attention_norm: torch.Tensor  # [hidden] float32, fused into the MLP's first products
    qk_norm: QKNorm | None  # Qwen3's per-head norms
    qkv: LinearLayer  # [hidden] -> [(heads + 2 kv_heads) * head_dim]
    o: LinearLayer  # [heads * head_dim] -> [hidden]


class Layer(Protocol):
    """One decoder layer as the model runs it (dense here; moe.py's have experts)."""

    def __call__(self, x: torch.Tensor, ctx: ForwardContext, eps: float,
                 lora: tuple[RowGroup, ...] = ()) -> torch.Tensor: ...  # [T, hidden] -> same

    def linears(self) -> list[LinearLayer]: ...  # every product, for weight_formats


@dataclass(frozen=True)
class DecoderLayer:
    """One layer's weights. Norm weights are float32 vectors fused into the products that read them."""

    index: int  # its KV cache in the attention backend
    input_norm: torch.Tensor  # [hidden]
    post_attention_norm: torch.Tensor  # [hidden]
    qk_norm: QKNorm | None  # Qwen3's per-head norms
    qkv: LinearLayer  # [hidden] -> [(heads + 2 kv_heads) * head_dim]
    o: LinearLayer  # [heads * head_dim] -> [hidden]
    gate_up: LinearLayer  # [hidden] -> [2 * intermediate]
    down: LinearLayer  # [intermediate] -> [hidden]

    def __call__(self, x: torch.Tensor, ctx: ForwardContext, eps: float,
                 lora: tuple[RowGroup, ...] = ()) -> torch.Tensor:
        """x [T, hidden] float32 -> [T, hidden]. lora: rows running under adapters get their deltas added to each
        product's output (lora/products.py); without, this is the base layer."""
        qkv = self.qkv(x, norm=self.input_norm, eps=eps)  # [T, (heads + 2 kv_heads) * head_dim]
        if lora:
            qkv = add_delta(qkv, x, lora, self.index, "qkv", norm=self.input_norm, eps=eps)
        attn = ctx.attention(self.index, qkv, ctx.plan, self.qk_norm)  # [T, heads * head_dim]
        h = self.o(attn, residual=x)  # [T, hidden]
        if lora:
            h = add_delta(h, attn, lora, self.index, "o")
        gate_up = self.gate_up(h, norm=self.post_attention_norm, eps=eps)  # [T, 2 * intermediate]
        if lora:
            gate_up = add_delta(gate_up, h, lora, self.index, "gate_up", norm=self.post_attention_norm, eps=eps)
        out = self.down(gate_up, silu=True, residual=h)  # [T, hidden]
        if lora:
            out = add_delta(out, gate_up, lora, self.index, "down", silu=True)
        return out

    def linears(self) -> list[LinearLayer]:
        return [self.qkv, self.o, self.gate_up, self.down]


@register("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
class LlamaForCausalLM:
    """Built from an HF config and a weight source, every product in the builder's format."""

    QK_NORM_ARCHITECTURES: frozenset[str] = frozenset({"Qwen3ForCausalLM"})  # per-head q/k RMSNorms

    def __init__(self, config: PretrainedConfig, weights: WeightSource, builder: LinearBuilder) -> None:
        arch = (config.architectures or ["LlamaForCausalLM"])[0]
        self.config = config
        self.shape = shape = LlamaShape.from_hf(config, qk_norm=arch in self.QK_NORM_ARCHITECTURES)
        self.device = builder.device
        self.dtype = builder.dtype
        self.builder = builder  # LoRA adapters' products are built in the same way (lora/products.py)
        self.max_positions = int(config.max_position_embeddings)
        self.rope = rope_tables(config, self.max_positions)
        head_name = "model.embed_tokens.weight"
        if not shape.tie_embeddings and weights.has("lm_head.weight"):
            head_name = "lm_head.weight"
        head = weights.matrix(head_name)
        expect_shape(head_name, matrix_shape(head)[1:], (shape.hidden,))  # rows: the vocabulary, padded or not
        self.lm_head = builder.build(head, output=True)
        self.norm = self._vector(weights, "model.norm.weight", shape.hidden)
        # Embedding rows: from the tied output projection when it can give rows (no second copy of the table).
        self._embed_rows = self.lm_head if head_name.startswith("model.embed") and isinstance(
            self.lm_head, NativeLinear) else None
        self.embed_table: torch.Tensor | None = None  # [vocab, hidden] in the model dtype, when not read from lm_head
        if self._embed_rows is None:
            self.embed_table = weights.tensor("model.embed_tokens.weight").to(device=self.device, dtype=self.dtype)
        self.layers: list[Layer] = [self._layer(weights, builder, i) for i in range(shape.layers)]
        self._stack: _NativeStack | None = None  # every layer in one native call, once a native cache exists

    def _vector(self, weights: WeightSource, name: str, size: int) -> torch.Tensor:
        """A norm's weight [size] float32."""
        vector = weights.tensor(name)
        expect_shape(name, vector.shape, (size,))
        return vector.to(device=self.device, dtype=torch.float32).contiguous()

    @staticmethod
    def _matrix(weights: WeightSource, name: str, out: int, inputs: int) -> Matrix:
        """A linear layer's weight [out, inputs], checked against the config."""
        m = weights.matrix(name)
        expect_shape(name, matrix_shape(m), (out, inputs))
        return m

    def _layer(self, w: WeightSource, builder: LinearBuilder, i: int) -> Layer:
        p, s = f"model.layers.{i}.", self.shape
        return self._decoder_layer(w, builder, i, gate_up=builder.build(stack_rows(
            [self._matrix(w, p + f"mlp.{n}_proj.weight", s.intermediate, s.hidden) for n in ("gate", "up")])),
            down=builder.build(self._matrix(w, p + "mlp.down_proj.weight", s.hidden, s.intermediate),
                               gated_inputs=True))

    def _decoder_layer(self, w: WeightSource, builder: LinearBuilder, i: int, gate_up: LinearLayer,
                       down: LinearLayer) -> DecoderLayer:
        """Layer i's attention and norms from the checkpoint, with the given MLP products."""
        a = self.attention_parts(w, builder, i)
        return DecoderLayer(i, a.input_norm, a.post_attention_norm, a.qk_norm, a.qkv, a.o, gate_up, down)

    def attention_parts(self, w: WeightSource, builder: LinearBuilder, i: int) -> AttentionParts:
        """Layer i's norms and attention products."""
        p, s = f"model.layers.{i}.", self.shape
        qkv_names = [p + f"self_attn.{n}_proj" for n in ("q", "k", "v")]
        qkv_rows = [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim]
        bias = None
        if w.has(qkv_names[0] + ".bias"):
            bias = torch.cat([w.tensor(n + ".bias") for n in qkv_names]).float()
        qk_norm = None
        if self.shape.qk_norm:
            qk_norm = QKNorm(self._vector(w, p + "self_attn.q_norm.weight", s.head_dim),
                             self._vector(w, p + "self_attn.k_norm.weight", s.head_dim))
        return AttentionParts(
            input_norm=self._vector(w, p + "input_layernorm.weight", s.hidden),
            post_attention_norm=self._vector(w, p + "post_attention_layernorm.weight", s.hidden),
            qk_norm=qk_norm,
            qkv=builder.build(stack_rows([self._matrix(w, n + ".weight", rows, s.hidden)
                                          for n, rows in zip(qkv_names, qkv_rows, strict=True)]), bias),
            o=builder.build(self._matrix(w, p + "self_attn.o_proj.weight", s.hidden, s.heads * s.head_dim)),
        )

    def linear_layers(self) -> list[LinearLayer]:
        """Every product: the output head, then each layer's."""
        linears: list[LinearLayer] = [self.lm_head]
        for layer in self.layers:
            linears += layer.linears()
        return linears

    def weight_formats(self) -> tuple[str, ...]:
        """The storage formats among the linear layers (sorted), e.g. ("q4_1", "q8_0")."""
        return tuple(sorted({f for lin in self.linear_layers() for f in _formats_of(lin, self.dtype)}))

    @property
    def kv_bytes_per_token(self) -> int:
        s = self.shape
        return s.layers * 2 * s.kv_heads * s.head_dim * self.dtype.itemsize

    def make_attention(self, num_pages: int, page_size: int) -> AttentionBackend:
        """The KV cache in the model dtype, with the backend this device and build allow (attention.select_backend).
        With the native backend and native products, every layer then runs in one native call (`_stack`)."""
        backend = select_backend(self.attention_shape, self.rope, self.dtype, self.device, num_pages, page_size)
        self._stack = self._native_stack(backend)
        return backend

    def _native_stack(self, backend: AttentionBackend) -> _NativeStack | None:
        if not isinstance(backend, NativeAttention):
            return None
        ops = []
        for layer in self.layers:
            if not isinstance(layer, DecoderLayer):
                return None  # layers the native stack does not know (experts) run one by one
            linears = [lin for lin in (layer.qkv, layer.o, layer.gate_up, layer.down) if isinstance(lin, NativeLinear)]
            if len(linears) != 4:
                return None
            q_norm, k_norm = (layer.qk_norm.q, layer.qk_norm.k) if layer.qk_norm is not None else (None, None)
            ops.append(native.load().StackLayer(*(lin.op for lin in linears), layer.input_norm,
                                                layer.post_attention_norm, q_norm, k_norm))
        s = self.attention_shape
        stack = native.load().DecoderStack(ops, backend.keys, backend.values, backend.rope.cos, backend.rope.sin,
                                           s.heads, self.shape.eps, s.qk_norm_eps, s.scale)
        return _NativeStack(backend, stack)

    @property
    def attention_shape(self) -> AttentionShape:
        s = self.shape
        return AttentionShape(s.layers, s.heads, s.kv_heads, s.head_dim, s.head_dim ** -0.5, s.eps)

    accepts_embeddings = True
    accepts_adapters = True  # LoRA deltas on the fused products (moe.py's experts take none)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the embedding rows [T, hidden] float32 the first layer reads."""
        return self._embed_rows.rows(input_ids) if self._embed_rows is not None else self.embed_rows(input_ids)

    def forward(
        self, input_ids: torch.Tensor, ctx: ForwardContext, input_embeds: torch.Tensor | None = None,
        lora: tuple[RowGroup, ...] = (),
    ) -> torch.Tensor:
        """input_ids [T] -> hidden [T, hidden] float32 (before the final norm, which compute_logits applies).
        input_embeds [T, hidden] float32, when given, are the rows the first layer reads instead of input_ids'.

        lora: the rows running under adapters, grouped by adapter. The native stack adds their deltas when it has
        every group's adapter in its form (RowGroup.stack); else the step runs layer by layer in Python, with the
        same kernels in the same order (the same bits)."""
        x = self.embed(input_ids) if input_embeds is None else input_embeds.contiguous()
        if (self._stack is not None and ctx.attention is self._stack.backend
                and all(group.stack is not None for group in lora)):
            plan = ctx.plan
            args = (x, plan.rope_index, plan.slots, plan.block_table, plan.token_seq, plan.token_ctx,
                    [(group.rows, group.stack) for group in lora])
            if plan.rope is None:  # the stack's own tables at the tokens' positions
                return self._stack.stack.forward(*args)
            return self._stack.stack.forward(*args, rope_cos=plan.rope.cos, rope_sin=plan.rope.sin)  # M-RoPE rows
        for layer in self.layers:
            x = layer(x, ctx, self.shape.eps, lora)
        return x

    def lora_features(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each projection an adapter may target, by PEFT's module name."""
        s = self.shape
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        return {"q_proj": (s.hidden, q), "k_proj": (s.hidden, kv), "v_proj": (s.hidden, kv), "o_proj": (q, s.hidden),
                "gate_proj": (s.hidden, s.intermediate), "up_proj": (s.hidden, s.intermediate),
                "down_proj": (s.intermediate, s.hidden)}

    __call__ = forward

    def embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.embed_table is not None
        return self.embed_table.index_select(0, input_ids).float()  # [T, hidden]

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> [N, hidden] float32 after the final RMSNorm: what the output projection reads (which
        fuses the same norm into its product). Per row, so a row's bits do not depend on the others."""
        x = hidden.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.shape.eps) * self.norm

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32 (final RMSNorm fused into the output projection)."""
        return self.lm_head(hidden.contiguous(), norm=self.norm, eps=self.shape.eps).float()



def _formats_of(linear: LinearLayer, dtype: torch.dtype) -> tuple[str, ...]:
    if isinstance(linear, NativeLinear):
        return linear.labels
    return ({torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[dtype],)

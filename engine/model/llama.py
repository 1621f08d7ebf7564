"""The Llama decoder, which also serves its relatives: Mistral and Qwen2 (they differ in
biases and sliding windows), Qwen3 (a norm over each query and key head), Gemma 2 and 3
(Gemma's norms, GeGLU, a scaled embedding, sliding-window layers between full-attention
ones; Gemma 2 caps attention and final logits, Gemma 3 normalises queries and keys and
rotates its sliding layers with their own RoPE) and the mixture-of-experts Mixtral and
Qwen3-MoE (moe.py's experts in place of the MLP)."""

from __future__ import annotations

import torch
from torch import nn

from tidegate.engine.attention.backend import AttentionBackend, AttentionMetadata
from tidegate.engine.attention.custom_op import (
    KVCache,
    attention_context,
    layer_attention_op,
    paged_attention,
)
from tidegate.engine.distributed.parallel_state import (
    is_first_stage,
    is_last_stage,
    stage_layers,
)
from tidegate.engine.model.config import ModelConfig
from tidegate.engine.model.layers import (
    GATES,
    Linear,
    LMHead,
    MergedLinear,
    QKVLinear,
    RowParallelLinear,
    VocabEmbedding,
    rms_norm,
)
from tidegate.engine.model.moe import SparseMoE
from tidegate.engine.model.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    """Self-attention with fused q/k/v, RoPE, and keys/values kept in the paged cache."""

    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, layer: int, cache_index: int
    ) -> None:
        super().__init__()
        self.layer = cache_index  # which KV cache is this layer's
        self.head_dim = config.head_dim
        self.scale = config.attention_scale or self.head_dim**-0.5
        self.sliding_window = config.window(layer)  # 0: every earlier key
        self.logits_soft_cap = config.attn_logit_softcapping or 0.0  # Gemma 2
        self.qkv_proj = QKVLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.qkv_bias,
        )
        # This rank's heads: all of them, or its share under tensor parallelism.
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.qkv_sizes = list(self.qkv_proj.output_sizes.values())
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, config.o_proj_bias
        )
        # Qwen3, Gemma 3: each query and key head RMS-normalised (weights [head_dim]) before
        # RoPE.
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = rms_norm(self.head_dim, config.rms_norm_eps, config.gemma_layout)
            self.k_norm = rms_norm(self.head_dim, config.rms_norm_eps, config.gemma_layout)
        self.rotary = rotary  # one cos/sin cache shared by the layers of its kind
        # The attention backend's own op for a whole layer, when it has one (set by the
        # model from its backend): called directly instead of `paged_attention`.
        self.layer_op = None
        # An FP8 cache's calibrated (k_scale, v_scale) (`use_kv_cache_scales`); None: unscaled.
        self.kv_scales: tuple[float, float] | None = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Attend each new token to its sequence's cached and new tokens."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.qkv_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        scale = self.scale
        if self.kv_scales is not None:
            # The cache holds k / k_scale and v / v_scale. Every backend attends as if to k and
            # v: q . k * scale is q . (k / k_scale) * (scale * k_scale), and the softmax's
            # weighted sum of v / v_scale times v_scale is that of v (a cap takes the scaled
            # score, so it too is unchanged).
            k_scale, v_scale = self.kv_scales
            k, v, scale = k / k_scale, v / v_scale, scale * k_scale
        attend = self.layer_op if self.layer_op is not None else paged_attention
        out = attend(q, k, v, self.layer, scale, self.sliding_window, self.logits_soft_cap)
        if self.kv_scales is not None:
            out = out * self.kv_scales[1]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU (Gemma: GeGLU) feed-forward with gate and up projections fused into one matmul."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(
            config.hidden_size, {"gate": size, "up": size}, config.mlp_bias
        )
        self.act = GATES[config.hidden_act]()
        self.down_proj = RowParallelLinear(size, config.hidden_size, config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the feed-forward block."""
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP (or experts), each with a residual connection.

    Gemma's layout also normalises each block's output before its residual add: there
    post_attention_layernorm is attention's output norm, and the MLP has a norm on each side
    (pre_ and post_feedforward_layernorm).
    """

    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, layer: int, cache_index: int
    ) -> None:
        super().__init__()
        size, eps, gemma = config.hidden_size, config.rms_norm_eps, config.gemma_layout
        self.gemma_layout = gemma
        self.input_layernorm = rms_norm(size, eps, gemma)
        self.self_attn = LlamaAttention(config, rotary, layer, cache_index)
        self.post_attention_layernorm = rms_norm(size, eps, gemma)
        if gemma:
            self.pre_feedforward_layernorm = rms_norm(size, eps, gemma)
            self.post_feedforward_layernorm = rms_norm(size, eps, gemma)
        self.mlp: nn.Module
        if config.is_sparse_layer(layer):
            assert config.moe is not None
            self.mlp = SparseMoE(config.hidden_size, config.moe)
        else:
            self.mlp = LlamaMLP(config)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Run one layer; same order of additions as transformers so bf16 rounds alike."""
        attended = self.self_attn(positions, self.input_layernorm(hidden))
        if not self.gemma_layout:
            hidden = hidden + attended
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attended)
        fed = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(fed)


class MissingLayer(nn.Module):
    """A place held for a layer another pipeline stage runs: it has no weights, so the layers
    this stage runs keep their checkpoint names (model.layers.<i>)."""

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this layer runs on another pipeline stage")


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm: the part torch.compile takes whole.

    Under pipeline parallelism it holds its stage's share: the embedding on the first stage,
    the norm on the last, and the layers `stage_layers` names (a MissingLayer elsewhere).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.first_stage, self.last_stage = is_first_stage(), is_last_stage()
        self.stage_layers = stage_layers(
            config.num_hidden_layers, head_layers=config.lm_head_layers
        )
        self.embed_tokens = (
            VocabEmbedding(config.vocab_size, config.hidden_size) if self.first_stage else None
        )
        # Gemma multiplies the embedding by sqrt(hidden_size) rounded to the model's dtype (the
        # default dtype while the model is built), as transformers does.
        self.embed_scale = None
        if config.gemma_layout:
            scale = torch.tensor(config.hidden_size**0.5, dtype=torch.get_default_dtype())
            self.embed_scale = scale.item()
        positions = config.max_position_embeddings
        rotary = RotaryEmbedding(
            config.head_dim, positions, config.rope_theta, config.rope_scaling, config.rotary_dim
        )
        # Gemma 3's sliding-window layers rotate with their own base frequency.
        local_rotary = rotary
        if config.local_rope is not None:
            local_rotary = RotaryEmbedding(config.head_dim, positions, *config.local_rope)
        first = self.stage_layers.start
        self.layers = nn.ModuleList(
            # Each layer indexes this stage's KV caches, which start at its first layer.
            LlamaDecoderLayer(config, local_rotary if config.window(i) else rotary, i, i - first)
            if i in self.stage_layers
            else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = None
        if self.last_stage:
            self.norm = rms_norm(config.hidden_size, config.rms_norm_eps, config.gemma_layout)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden]: after the final norm on the last stage, else what the next
        stage takes. A stage after the first starts from the previous one's `hidden`."""
        if self.first_stage:
            hidden = self.embed_tokens(input_ids)
            if self.embed_scale is not None:
                hidden = hidden * self.embed_scale
        assert hidden is not None
        for i in self.stage_layers:
            hidden = self.layers[i](positions, hidden)
        return self.norm(hidden) if self.last_stage else hidden


class LlamaForCausalLM(nn.Module):
    """The whole model (or one pipeline stage of it): what the model runner calls each step."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.model = LlamaModel(config)
        layer_op = layer_attention_op(backend)
        for module in self.model.modules():
            if isinstance(module, LlamaAttention):
                module.layer_op = layer_op
        last = is_last_stage()
        self.lm_head = None
        if last and not config.is_classifier:
            self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        # A sequence classifier's head (transformers' `score`): small, whole on every rank,
        # and never FP8 (quantizers leave it alone, as they leave the LM head).
        self.score: Linear | None = None
        if last and config.is_classifier:
            self.score = Linear(config.hidden_size, len(config.labels))
            if self.score.weight_scale is not None:
                self.score.hold_full_precision()
        if self.lm_head is not None and config.tie_word_embeddings and self.model.first_stage:
            self.lm_head.tie(self.model.embed_tokens)

    def use_kv_cache_scales(self, scales: dict[str, tuple[float, float]]) -> None:
        """Have the attention modules named in `scales` store k / k_scale and v / v_scale in
        their (FP8) cache: a checkpoint's calibrated (k_scale, v_scale). Other stages' layers
        are not here."""
        for name, module in self.named_modules():
            if isinstance(module, LlamaAttention) and name in scales:
                module.kv_scales = scales[name]

    @property
    def num_local_layers(self) -> int:
        """Decoder layers this stage runs (and keeps KV caches for)."""
        return len(self.model.stage_layers)

    def holds(self, name: str) -> bool:
        """True when checkpoint tensor `name` (in our module names) belongs to this stage."""
        if name.startswith("model.layers."):
            return int(name.split(".", 3)[2]) in self.model.stage_layers
        if name.startswith("model.embed_tokens."):
            # A tied embedding is also the last stage's LM head.
            return self.model.first_stage or (
                self.lm_head is not None and self.config.tie_word_embeddings
            )
        if name.startswith("model.norm."):
            return self.model.last_stage
        if name.startswith("lm_head."):
            return self.lm_head is not None
        if name.startswith("score."):
            return self.score is not None
        return True

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run a flat batch of T tokens; returns hidden states [T, hidden]."""
        if len(kv_caches) != self.num_local_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for {self.num_local_layers} layers")
        with attention_context(self.backend, kv_caches, meta):
            return self.model(input_ids, positions, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for the rows of hidden that need sampling (last stage)."""
        if self.config.is_classifier:
            raise RuntimeError("a sequence classifier has no LM head: it samples no token")
        assert self.lm_head is not None, "logits are computed on the last pipeline stage"
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """A sequence classifier's float32 logits [N, labels] of pooled final hidden states
        [N, hidden] (last stage), computed in the model's dtype as transformers does."""
        assert self.score is not None, "only a sequence classifier's last stage classifies"
        return self.score(hidden.to(self.score.dtype)).float()

"""What the engine needs to know about a model, read from its Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "Phi3ForCausalLM",
)
# Sequence classifiers (transformers' *ForSequenceClassification): the causal model's decoder
# with a `score` head, [num_labels, hidden], on the last token's final hidden state in place
# of the LM head. Rerankers (cross-encoders) are such models with one label.
SEQUENCE_CLASSIFIERS = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "MixtralForSequenceClassification": "MixtralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
    "Qwen3MoeForSequenceClassification": "Qwen3MoeForCausalLM",
    "Gemma2ForSequenceClassification": "Gemma2ForCausalLM",
    "Phi3ForSequenceClassification": "Phi3ForCausalLM",
}
# Multimodal architectures whose language model is served on its own: text in, text out, and
# their vision tower and projector left unread.
TEXT_OF_MULTIMODAL = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# The modules of such a checkpoint that are not its language model (under model. in
# transformers 5's names): the loader skips their tensors, and an adapter of them is refused.
MULTIMODAL_PARTS = ("vision_tower", "multi_modal_projector")
# Gemma's configuration classes' defaults, which a config.json may leave out (a Gemma 3 4B
# folder's text_config names only what differs from them).
_GEMMA_SHARED_DEFAULTS = {
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "eos_token_id": 1,
}
_GEMMA_DEFAULTS = {
    "Gemma2ForCausalLM": {
        **_GEMMA_SHARED_DEFAULTS,
        "vocab_size": 256_000,
        "max_position_embeddings": 8192,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    "Gemma3ForCausalLM": {
        **_GEMMA_SHARED_DEFAULTS,
        "vocab_size": 262_208,
        "max_position_embeddings": 131_072,
    },
}
# Qwen3's attention normalises each query and key head (q_norm, k_norm) before RoPE.
_QWEN3 = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_MOE = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
# RoPE variants rotary.py computes exactly as transformers does; "default" means no scaling.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# config.json's activation names -> ours: SwiGLU's silu, or Gemma's tanh-approximated GELU.
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class MoEConfig:
    """The sparse feed-forward of a mixture-of-experts model (Mixtral, Qwen3-MoE)."""

    num_experts: int
    top_k: int  # experts each token is routed to
    intermediate_size: int  # each expert's
    # Whether the top-k routing weights are rescaled to sum to 1 (Mixtral always; Qwen3-MoE
    # by norm_topk_prob); else they are the softmax over all experts, as picked.
    renormalize: bool
    sparse_layers: frozenset[int]  # the decoder layers whose MLP is the experts

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.top_k} must be between 1 and the "
                f"{self.num_experts} experts"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a decoder-only model of the Llama family: Llama, Mistral, Qwen2,
    Qwen3, Gemma 2 and 3, Phi-3 and 4, and the mixture-of-experts Mixtral and Qwen3-MoE."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None, or a dict with "rope_type" in SUPPORTED_ROPE_TYPES
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    torch_dtype: str | None  # as written in config.json, e.g. "bfloat16"; None if absent
    # Per decoder layer, how many keys each query sees: 0 all before it (full attention), W
    # the last W, itself included (a sliding window: every layer of Mistral v0.1, five in six
    # of Gemma 3's).
    layer_windows: tuple[int, ...] = ()
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each query and key head before RoPE
    moe: MoEConfig | None = None  # mixture of experts; None for a dense model
    hidden_act: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (Gemma's)
    # Softmax scale of attention scores; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar).
    attention_scale: float | None = None
    # Gemma's layout: every RMSNorm weight is stored as w - 1 and applied in float32, the
    # embedding is multiplied by sqrt(hidden_size), and attention's and the MLP's outputs are
    # normalised too before their residual adds (post_attention_layernorm is that norm, and
    # pre_feedforward_layernorm the MLP's input norm).
    gemma_layout: bool = False
    # RoPE of the sliding-window layers when it differs from the others' (Gemma 3's local
    # base frequency): (theta, scaling), as rope_theta and rope_scaling.
    local_rope: tuple[float, dict[str, Any] | None] | None = None
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # Gemma 2: each attention score s becomes cap * tanh(s / cap) before the softmax.
    attn_logit_softcapping: float | None = None
    # An FP8 checkpoint's scale layout (config.json quantization_config); None: unquantized.
    fp8: Fp8Checkpoint | None = None
    # Leading dims of each head that RoPE rotates (Phi-4-mini's partial_rotary_factor 0.75);
    # None: all of them.
    rotary_dim: int | None = None
    # A sequence classifier's labels, by index (id2label); empty for a causal LM.
    labels: tuple[str, ...] = ()

    @property
    def is_classifier(self) -> bool:
        """Whether the model ends in a classification head (SEQUENCE_CLASSIFIERS), not an LM
        head: it scores prompts and generates nothing."""
        return bool(self.labels)

    def window(self, layer: int) -> int:
        """Decoder layer `layer`'s sliding window (0: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer`'s MLP is a mixture of experts."""
        return self.moe is not None and layer in self.moe.sparse_layers

    @property
    def max_model_len(self) -> int:
        """Longest sequence the model's positions cover."""
        return self.max_position_embeddings

    def at_context_length(self, max_model_len: int) -> ModelConfig:
        """This config for an engine serving up to `max_model_len` tokens. LongRoPE (Phi-3)
        rotates with its long factors when that is beyond the pretraining length, as vLLM
        does, and with its short ones otherwise, as transformers does for such sequences (it
        switches per batch, which a KV cache cannot follow)."""
        scaling = self.rope_scaling
        if not scaling or scaling.get("rope_type") != "longrope":
            return self
        long = max_model_len > scaling["original_max_position_embeddings"]
        return dataclasses.replace(self, rope_scaling={**scaling, "long_context": long})

    def check_tensor_parallel(self, size: int) -> None:
        """Refuse a tensor-parallel size this model's shapes cannot be split by."""
        kv = self.num_key_value_heads
        problems = []
        if self.num_attention_heads % size:
            problems.append(f"{self.num_attention_heads} attention heads")
        if kv % size and size % kv:
            problems.append(f"{kv} key/value heads (nor is it a multiple of them)")
        if self.intermediate_size % size and (
            self.moe is None or len(self.moe.sparse_layers) < self.num_hidden_layers
        ):  # a dense layer's MLP is split too
            problems.append(f"intermediate size {self.intermediate_size:,}")
        if self.moe is not None and self.moe.intermediate_size % size:
            problems.append(f"expert intermediate size {self.moe.intermediate_size:,}")
        if problems:
            raise ValueError(
                f"tensor_parallel_size {size} does not divide this model's "
                f"{' and '.join(problems)}; choose a size that divides the number of "
                f"attention heads ({self.num_attention_heads})"
            )

    @property
    def lm_head_layers(self) -> float:
        """The LM head's weights in decoder layers (its compute per sampled token is in the
        same ratio): what the last pipeline stage runs beside its layers."""
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        attention = self.hidden_size * self.head_dim * (2 * heads + 2 * kv)  # q, k, v, o
        mlp = 3 * self.hidden_size * self.intermediate_size  # gate, up, down
        if self.moe is not None:  # the experts a token runs through (compute, not weights)
            mlp = 3 * self.hidden_size * self.moe.intermediate_size * self.moe.top_k
        return self.vocab_size * self.hidden_size / (attention + mlp)

    def check_pipeline_parallel(self, size: int) -> None:
        """Refuse more pipeline stages than this model has layers."""
        if size > self.num_hidden_layers:
            raise ValueError(
                f"pipeline_parallel_size {size} is more than this model's "
                f"{self.num_hidden_layers} layers; each stage needs at least one"
            )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """Read config.json (and eos ids from generation_config.json) in a model folder."""
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise ValueError(
                f"{model_dir} is not a Hugging Face model folder: it has no config.json "
                "(models are loaded from local folders only)"
            )
        raw = json.loads(path.read_text())
        return cls.from_dict(raw, _generation_eos(model_dir))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], extra_eos: list[int] | None = None) -> ModelConfig:
        """Build from the parsed config.json; extra_eos come from generation_config.json."""
        names = raw.get("architectures") or []
        causal = next((SEQUENCE_CLASSIFIERS[n] for n in names if n in SEQUENCE_CLASSIFIERS), None)
        if causal is not None:
            config = cls.from_dict({**raw, "architectures": [causal]}, extra_eos)
            return dataclasses.replace(config, labels=_labels(raw))
        architecture = _architecture(raw)
        if architecture in TEXT_OF_MULTIMODAL:
            text = cls.from_dict(_language_model_config(architecture, raw), extra_eos)
            fp8 = read_fp8_checkpoint(raw.get("quantization_config"))
            return dataclasses.replace(text, architecture=architecture, fp8=fp8)
        is_gemma = architecture in _GEMMA_DEFAULTS
        if is_gemma:
            raw = {**_GEMMA_DEFAULTS[architecture], **raw}
        # Gemma names its activation hidden_activation (its hidden_act is a legacy key).
        act_name = raw.get("hidden_activation") if is_gemma else None
        act_name = act_name or raw.get("hidden_act") or "silu"
        if act_name not in _ACTIVATIONS or (act_name != "silu" and architecture in _MOE):
            raise ValueError(
                f"hidden_act {act_name!r} is not supported for {architecture}; "
                f"supported: {', '.join(_ACTIVATIONS)} (silu only with experts)"
            )
        if is_gemma:
            _check_gemma(raw)
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        is_qwen = is_qwen2 or architecture in _QWEN3
        heads = raw["num_attention_heads"]
        attention_bias = bool(raw.get("attention_bias", False))
        # Qwen3's configuration class defaults head_dim to 128, not hidden_size / heads.
        default_head_dim = (
            128 if architecture == "Qwen3ForCausalLM" else raw["hidden_size"] // heads
        )
        head_dim = raw.get("head_dim") or default_head_dim
        rotary_dim = None
        partial = raw.get("partial_rotary_factor") or (raw.get("rope_parameters") or {}).get(
            "partial_rotary_factor"
        )
        if partial is not None and partial != 1.0:
            rotary_dim = int(head_dim * partial)
        if architecture == "Gemma3ForCausalLM":
            (rope_theta, rope_scaling), local_rope = _gemma3_rope(raw)
        else:
            (rope_theta, rope_scaling), local_rope = _rope(raw), None
        eos = _as_list(raw.get("eos_token_id"))
        eos += [t for t in extra_eos or [] if t not in eos]
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and no o_proj bias; Llama's, Qwen3's and Gemma's
            # flag covers all four (Mixtral has none).
            qkv_bias=is_qwen2 or attention_bias,
            o_proj_bias=not is_qwen2 and attention_bias,
            mlp_bias=not is_qwen and not is_gemma and bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos,
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            layer_windows=_layer_windows(architecture, raw),
            qk_norm=architecture in (*_QWEN3, "Gemma3ForCausalLM"),
            moe=_moe(architecture, raw),
            hidden_act=_ACTIVATIONS[act_name],
            attention_scale=raw["query_pre_attn_scalar"] ** -0.5 if is_gemma else None,
            gemma_layout=is_gemma,
            local_rope=local_rope,
            final_logit_softcapping=raw.get("final_logit_softcapping") if is_gemma else None,
            attn_logit_softcapping=raw.get("attn_logit_softcapping") if is_gemma else None,
            fp8=read_fp8_checkpoint(raw.get("quantization_config")),
            rotary_dim=rotary_dim,
        )


def _architecture(raw: dict[str, Any]) -> str:
    names = raw.get("architectures") or []
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    raise ValueError(
        f"model architecture {names or raw.get('model_type')!r} is not supported; "
        f"supported: {', '.join((*SUPPORTED_ARCHITECTURES, *SEQUENCE_CLASSIFIERS))}"
    )


def _labels(raw: dict[str, Any]) -> tuple[str, ...]:
    """A classifier's labels in index order, as transformers reads them: id2label, else
    num_labels (default 2) named LABEL_0, LABEL_1, ..."""
    id2label = raw.get("id2label")
    if id2label:
        by_index = {int(index): str(label) for index, label in id2label.items()}
        if sorted(by_index) != list(range(len(by_index))):
            raise ValueError(f"config.json's id2label must number its labels 0 to n-1: {id2label}")
        return tuple(by_index[i] for i in range(len(by_index)))
    count = raw.get("num_labels", 2)
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"config.json's num_labels must be a positive integer, got {count!r}")
    return tuple(f"LABEL_{i}" for i in range(count))


def _language_model_config(architecture: str, raw: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config.json's language model as a config.json of its own: its
    text_config, with the token ids, dtype and tying the whole model's top level names."""
    text = dict(raw.get("text_config") or {})
    text["architectures"] = [TEXT_OF_MULTIMODAL[architecture]]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        if key in raw:
            text[key] = raw[key]
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    if dtype is not None:
        text["dtype"] = dtype
    return text


def _layer_windows(architecture: str, raw: dict[str, Any]) -> tuple[int, ...]:
    """Each decoder layer's sliding window (0: none), as transformers reads config.json.

    Mistral, Mixtral and Qwen3-MoE window every layer when they have a window; Qwen2, Qwen3
    and Gemma the layers `layer_types` calls sliding_attention, whose default is Qwen's
    layers from max_window_layers on, every other layer of Gemma 2 and five in every six of
    Gemma 3 (sliding_window_pattern).
    Llama has none; Qwen's window counts only with use_sliding_window.
    """
    layers = raw["num_hidden_layers"]
    window = raw.get("sliding_window") if architecture != "LlamaForCausalLM" else None
    if window and window >= raw.get("max_position_embeddings", window + 1):
        window = None  # no sequence is longer (Phi-3.5's 262,144 over 131,072 positions)
    if architecture in ("Qwen2ForCausalLM", *_QWEN3) and not raw.get("use_sliding_window"):
        window = None
    if not window:
        return (0,) * layers
    if architecture not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", *_GEMMA_DEFAULTS):
        return (window,) * layers
    types = raw.get("layer_types")
    if types is None:
        if architecture in _GEMMA_DEFAULTS:
            # Gemma 2 alternates; Gemma 3 windows five layers in six.
            default = 2 if architecture == "Gemma2ForCausalLM" else 6
            pattern = raw.get("sliding_window_pattern", default)
            sliding = [bool((i + 1) % pattern) for i in range(layers)]
        else:
            first = raw.get("max_window_layers", 28)
            sliding = [i >= first for i in range(layers)]
    else:
        if len(types) != layers:
            raise ValueError(f"layer_types names {len(types)} layers, not {layers}")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"layer_types {sorted(unknown)} are not supported")
        sliding = [t == "sliding_attention" for t in types]
    return tuple(window if s else 0 for s in sliding)


def _check_gemma(raw: dict[str, Any]) -> None:
    """Refuse the Gemma options the engine does not compute, saying which."""
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported: the engine is causal")


def _gemma3_rope(
    raw: dict[str, Any],
) -> tuple[tuple[float, dict[str, Any] | None], tuple[float, dict[str, Any] | None]]:
    """Gemma 3's RoPE of full-attention layers and of sliding ones, from transformers 5's
    `rope_parameters` keyed by layer type or the older rope_theta, rope_scaling (full layers
    only) and rope_local_base_freq; their defaults are 1e6 and 1e4."""
    params = raw.get("rope_parameters") or {}
    length = {"max_position_embeddings": raw.get("max_position_embeddings", 131072)}
    if "full_attention" in params or "sliding_attention" in params:
        full = {"rope_theta": 1e6, **(params.get("full_attention") or {})}
        local = {"rope_theta": 1e4, **(params.get("sliding_attention") or {})}
    else:
        full = {**(raw.get("rope_scaling") or {}), "rope_theta": raw.get("rope_theta", 1e6)}
        local = {"rope_theta": raw.get("rope_local_base_freq", 1e4)}
    return (
        _rope({**length, "rope_parameters": full}),
        _rope({**length, "rope_parameters": local}),
    )


def _moe(architecture: str, raw: dict[str, Any]) -> MoEConfig | None:
    """The experts of Mixtral (every layer) or Qwen3-MoE (as decoder_sparse_step and
    mlp_only_layers say, as transformers reads them); None for a dense model."""
    layers = raw["num_hidden_layers"]
    if architecture == "MixtralForCausalLM":
        return MoEConfig(
            num_experts=raw["num_local_experts"],
            top_k=raw["num_experts_per_tok"],
            intermediate_size=raw["intermediate_size"],
            renormalize=True,
            sparse_layers=frozenset(range(layers)),
        )
    if architecture != "Qwen3MoeForCausalLM":
        return None
    num_experts, step = raw.get("num_experts", 128), raw.get("decoder_sparse_step", 1)
    dense = set(raw.get("mlp_only_layers") or [])
    sparse = frozenset(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    if num_experts <= 0 or not sparse:
        return None  # every layer dense: a dense model
    return MoEConfig(
        num_experts=num_experts,
        top_k=raw.get("num_experts_per_tok", 8),
        intermediate_size=raw.get("moe_intermediate_size", 768),
        renormalize=bool(raw.get("norm_topk_prob", False)),
        sparse_layers=sparse,
    )


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Theta and scaling from either the transformers 4 keys or the 5 `rope_parameters` dict."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    params.pop("type", None)
    params.pop("partial_rotary_factor", None)  # ModelConfig.rotary_dim
    # As transformers: a top-level original length wins, else max_position_embeddings.
    if rope_type in ("llama3", "yarn", "longrope"):
        if "original_max_position_embeddings" in raw:
            params["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
    return theta, params


def checkpoint_files(model_dir: str | Path) -> list[str]:
    """The safetensors files that hold a folder's weights, in the order the index (or the file
    names) gives; empty when there are none."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    # Mistral folders also hold consolidated.safetensors, the same weights in its own names.
    return sorted(
        p.name for p in model_dir.glob("*.safetensors") if not p.name.startswith("consolidated")
    )


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _generation_eos(model_dir: Path) -> list[int]:
    path = model_dir / "generation_config.json"
    if not path.exists():
        return []
    return _as_list(json.loads(path.read_text()).get("eos_token_id"))


# --- FP8 checkpoints (quantization.py holds the weights) ----------------------------------

_SUPPORTED_QUANTIZATION = (
    "FP8 checkpoints (quant_method fp8, fbgemm_fp8, or compressed-tensors with 8-bit float weights)"
)


@dataclass(frozen=True)
class Fp8Checkpoint:
    """How an FP8 checkpoint's scales are laid out."""

    method: str  # quant_method as config.json writes it
    # (rows, columns) of the weight one scale covers; None: per tensor or per output channel,
    # which the scale's shape tells apart.
    block: tuple[int, int] | None


def read_fp8_checkpoint(config: dict[str, Any] | None) -> Fp8Checkpoint | None:
    """The layout of config.json's `quantization_config`, None when its weights are not
    quantized; a ValueError names what is not supported. A `kv_cache_scheme` only checked
    here: its scales are tensors of the checkpoint (quantization.KV_SCALE_NAME)."""
    if not config:
        return None
    _check_kv_cache_scheme(config.get("kv_cache_scheme"))
    method = config.get("quant_method")
    if (
        method == "compressed-tensors"
        and config.get("kv_cache_scheme")
        and not config.get("config_groups")
    ):
        return None  # llm-compressor quantized only the KV cache: the weights are as trained
    if method == "fp8":
        if config.get("fmt", "e4m3") != "e4m3":
            raise ValueError(
                f"FP8 format {config.get('fmt')!r} is not supported; only e4m3 weights are"
            )
        return Fp8Checkpoint(method, _block(config.get("weight_block_size")))
    if method == "fbgemm_fp8":
        return Fp8Checkpoint(method, None)
    if method == "compressed-tensors":
        return Fp8Checkpoint(method, _compressed_tensors_block(config))
    raise ValueError(
        f"quantization method {method!r} (config.json quantization_config) is not supported; "
        f"supported: {_SUPPORTED_QUANTIZATION}"
    )


def _check_kv_cache_scheme(scheme: Any) -> None:
    """A compressed-tensors kv_cache_scheme must be FP8 with one scale per layer (AutoFP8
    writes a string, "static", for the same)."""
    if not isinstance(scheme, dict):
        return
    if scheme.get("num_bits") != 8 or scheme.get("type") != "float":
        raise ValueError(
            f"kv_cache_scheme quantizes the KV cache to {scheme.get('num_bits')}-bit "
            f"{scheme.get('type')}; only 8-bit float (--kv-cache-dtype fp8) is supported"
        )
    if scheme.get("strategy", "tensor") != "tensor":
        raise ValueError(
            f"kv_cache_scheme strategy {scheme.get('strategy')!r} is not supported; only "
            "tensor (one k_scale and one v_scale per layer) is"
        )


def _block(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if (
        not isinstance(value, list | tuple)
        or len(value) != 2
        or not all(isinstance(v, int) and v > 0 for v in value)
    ):
        raise ValueError(f"weight block size {value!r} is not two positive integers")
    return int(value[0]), int(value[1])


def _compressed_tensors_block(config: dict[str, Any]) -> tuple[int, int] | None:
    groups = config.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    blocks = set()
    for name, group in groups.items():
        weights = group.get("weights") or {}
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise ValueError(
                f"compressed-tensors group {name!r} quantizes weights to "
                f"{weights.get('num_bits')}-bit {weights.get('type')}; supported: {_SUPPORTED_QUANTIZATION}"
            )
        activations = group.get("input_activations")
        if activations and (activations.get("num_bits") != 8 or activations.get("type") != "float"):
            raise ValueError(
                f"compressed-tensors group {name!r} quantizes activations to "
                f"{activations.get('num_bits')}-bit {activations.get('type')}; supported: "
                f"{_SUPPORTED_QUANTIZATION}"
            )
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(
                f"compressed-tensors weight strategy {strategy!r} is not supported; supported: "
                "tensor, channel, block"
            )
        blocks.add(_block(weights.get("block_structure")) if strategy == "block" else None)
    if len(blocks) > 1:
        raise ValueError(f"compressed-tensors groups mix weight layouts {sorted(map(str, blocks))}")
    return blocks.pop()

"""LoRA adapters in the engine: the same greedy tokens as transformers + PEFT, any mix of
adapters in one batch, adapter-keyed prefix caching, and refusals that leave nothing loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tidegate.engine.llm import LLM
from tidegate.engine.lora.adapter import LoRAError, model_targets, read_adapter
from tidegate.engine.lora.registry import LoRAConflict, LoRARegistry, parse_lora_modules
from tidegate.engine.lora.tiny_adapter import make_tiny_adapter
from tidegate.engine.model.config import ModelConfig
from tidegate.engine.sampling_params import SamplingParams

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
# Prompts as token ids; the second is longer than a KV block (16), the third crosses two.
PROMPTS = [
    [1, 5, 6, 7, 8],
    [1, *range(40, 60)],
    [1, *range(100, 140)],
]


def adapters_for(model_dir: Path, root: Path) -> dict[str, Path]:
    """Three adapters of different ranks, targets, alphas (one rsLoRA) for one model folder."""
    # PEFT adapts the modules the model has: Phi-3's q/k/v and gate/up are fused.
    fused = "qkv_proj" in model_targets(ModelConfig.from_pretrained(model_dir))
    attn = ["qkv_proj"] if fused else ["q_proj", "v_proj", "o_proj"]
    mlp = ["gate_up_proj", "o_proj"] if fused else ["gate_proj", "up_proj", "down_proj", "k_proj"]
    return {
        "all-r8": make_tiny_adapter(model_dir, root / "all-r8", rank=8, seed=1),
        "attn-r4": make_tiny_adapter(
            model_dir,
            root / "attn-r4",
            rank=4,
            alpha=8,
            seed=2,
            targets=attn,
        ),
        "mlp-r16": make_tiny_adapter(
            model_dir,
            root / "mlp-r16",
            rank=16,
            alpha=4,
            seed=3,
            targets=mlp,
            use_rslora=True,
        ),
    }


@pytest.fixture(scope="module")
def llama_adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    return adapters_for(tiny_llama_dir, tmp_path_factory.mktemp("llama-adapters"))


def peft_greedy(model_dir: Path, adapter: Path | None, prompts=PROMPTS) -> list[list[int]]:
    """Greedy continuations from transformers, with the adapter applied by PEFT (fp32)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter))
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(ids[0, len(prompt) :].tolist())
    return outputs


def token_ids(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


# Gemma 2: its capped attention, with the adapters' deltas. Phi-3: fused adapters.
@pytest.mark.parametrize(
    "arch",
    ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_gemma2_dir", "tiny_gemma3_dir", "tiny_phi3_dir"],
)
def test_adapter_output_equals_transformers_with_peft(arch, request, tmp_path):
    model_dir = request.getfixturevalue(arch)
    adapters = adapters_for(model_dir, tmp_path)
    greedy = GREEDY  # both stop at EOS
    # Within Phi-3's pretraining length (512), where transformers uses LongRoPE's short
    # factors for these prompts as the engine does.
    engine = dict(dtype="float32", max_model_len=512, enable_lora=True, max_loras=3)
    with LLM(str(model_dir), **engine) as llm:
        loaded = {name: llm.load_lora(name, str(path)) for name, path in adapters.items()}
        for name, lora in loaded.items():
            got = token_ids(llm.generate(PROMPTS, greedy, lora_request=lora))
            assert got == peft_greedy(model_dir, adapters[name]), name
        base = token_ids(llm.generate(PROMPTS, greedy))
    assert base == peft_greedy(model_dir, None)
    assert got != base  # the adapters change the output


def test_a_moe_models_adapter_equals_its_merged_weights_and_never_adapts_experts(
    tiny_qwen3_moe_dir, tmp_path
):
    """Qwen3-MoE's first layer is dense and its second has experts: an adapter of k_proj and
    the MLP adapts both layers' attention and the first layer's MLP, and gives the tokens of
    the base model with B @ A * scaling added to those weights. (PEFT is no reference here:
    on transformers 5 it wraps the stacked experts instead of the dense layer's MLP.)"""
    from safetensors.torch import load_file, save_file

    targets = ["k_proj", "gate_proj", "up_proj", "down_proj"]
    adapter = make_tiny_adapter(tiny_qwen3_moe_dir, tmp_path / "a", rank=8, seed=4, targets=targets)
    info = read_adapter(adapter, ModelConfig.from_pretrained(tiny_qwen3_moe_dir), 16)
    assert info.modules == {(0, p) for p in targets} | {(1, "k_proj")}
    merged = tmp_path / "merged"
    merged.mkdir()
    for file in tiny_qwen3_moe_dir.iterdir():
        (merged / file.name).write_bytes(file.read_bytes())
    weights = load_file(merged / "model.safetensors")
    lora = load_file(adapter / "adapter_model.safetensors")
    for layer, proj in info.modules:
        group = "self_attn" if proj == "k_proj" else "mlp"
        prefix = f"base_model.model.model.layers.{layer}.{group}.{proj}"
        delta = lora[f"{prefix}.lora_B.weight"] @ lora[f"{prefix}.lora_A.weight"]
        weights[f"model.layers.{layer}.{group}.{proj}.weight"] += delta * info.scaling
    save_file(weights, str(merged / "model.safetensors"), metadata={"format": "pt"})
    with LLM(str(tiny_qwen3_moe_dir), dtype="float32", enable_lora=True) as llm:
        lora_request = llm.load_lora("a", str(adapter))
        got = token_ids(llm.generate(PROMPTS, GREEDY, lora_request=lora_request))
        base = token_ids(llm.generate(PROMPTS, GREEDY))
    with LLM(str(merged), dtype="float32") as llm:
        assert got == token_ids(llm.generate(PROMPTS, GREEDY)) != base

    # An adapter of the experts' layer's MLP (as one written for a dense model) is refused.
    other = make_tiny_adapter(all_dense_config(tiny_qwen3_moe_dir, tmp_path), tmp_path / "b")
    with pytest.raises(LoRAError, match="layer 1, a mixture-of-experts layer"):
        read_adapter(other, ModelConfig.from_pretrained(tiny_qwen3_moe_dir), 16)


def all_dense_config(model_dir: Path, tmp_path: Path) -> Path:
    """model_dir's config.json with every layer dense: adapters made for it have MLP weights
    in each layer."""
    dense = tmp_path / "dense-config"
    dense.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    config["mlp_only_layers"] = list(range(config["num_hidden_layers"]))
    (dense / "config.json").write_text(json.dumps(config))
    return dense


def test_mixed_batch_of_three_adapters_and_the_base_model_equals_each_alone(
    tiny_llama_dir, llama_adapters
):
    """Every request of a mixed batch gets what it gets alone, with fewer slots than adapters
    (max_loras 2 for three adapters) and a host LRU of two: adapters take turns in the slots
    and are read again from their folders."""
    with LLM(
        str(tiny_llama_dir), dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=2
    ) as llm:
        loras = [None] + [llm.load_lora(n, str(p)) for n, p in llama_adapters.items()]
        alone = {
            (i, lora.name if lora else None): token_ids(
                llm.generate([prompt], GREEDY, lora_request=lora)
            )[0]
            for lora in loras
            for i, prompt in enumerate(PROMPTS)
        }
        mixed_prompts, mixed_loras = [], []
        for round_ in range(2):
            for prompt in PROMPTS:
                for lora in loras[round_:] + loras[:round_]:
                    mixed_prompts.append(prompt)
                    mixed_loras.append(lora)
        mixed = token_ids(llm.generate(mixed_prompts, GREEDY, lora_request=mixed_loras))
        prompt_index = [PROMPTS.index(p) for p in mixed_prompts]
        for got, i, lora in zip(mixed, prompt_index, mixed_loras, strict=True):
            assert got == alone[(i, lora.name if lora else None)]
        assert len({tuple(alone[(0, lora.name if lora else None)]) for lora in loras}) == 4
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]


def test_preemption_on_a_tight_pool_keeps_adapter_outputs(tiny_llama_dir, llama_adapters):
    """Requests under adapters preempted by recompute resume with their adapter."""
    prompts = [[1, *range(10 + 7 * i, 40 + 7 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    kwargs = {"dtype": "float32", "enable_lora": True, "max_loras": 3}
    with LLM(str(tiny_llama_dir), **kwargs) as roomy:
        loras = [roomy.load_lora(n, str(p)) for n, p in llama_adapters.items()]
        per_prompt = [loras[i % 3] for i in range(6)]
        expected = token_ids(roomy.generate(prompts, params, lora_request=per_prompt))
    with LLM(str(tiny_llama_dir), num_gpu_blocks=14, max_model_len=128, **kwargs) as tight:
        loras = [tight.load_lora(n, str(p)) for n, p in llama_adapters.items()]
        per_prompt = [loras[i % 3] for i in range(6)]
        got = token_ids(tight.generate(prompts, params, lora_request=per_prompt))
        assert tight.stats()["num_preemptions"] > 0
    assert got == expected


def test_a_prefix_cached_under_one_adapter_is_never_a_hit_for_another(
    tiny_llama_dir, llama_adapters
):
    prompt = PROMPTS[2]  # two full blocks and more
    with LLM(str(tiny_llama_dir), dtype="float32", enable_lora=True, max_loras=2) as llm:
        a = llm.load_lora("a", str(llama_adapters["all-r8"]))
        b = llm.load_lora("b", str(llama_adapters["attn-r4"]))
        same_files = llm.load_lora("a-again", str(llama_adapters["all-r8"]))

        def cached(lora) -> int:
            return llm.generate([prompt], GREEDY, lora_request=lora)[0].num_cached_tokens

        assert cached(a) == 0
        assert cached(b) == 0  # same prompt, another adapter
        assert cached(None) == 0  # nor the base model
        assert cached(a) == 32  # its own prefix: two full blocks
        assert cached(same_files) == 32  # the same weights under another name share it
        assert cached(None) == 32


def test_compiled_model_serves_every_mix_without_recompiling(tiny_llama_dir, llama_adapters):
    """Level 1: the LoRA op is opaque to the compiler, so mixes of adapters reuse the graphs
    compiled at warm-up, and the tokens equal eager ones."""
    from torch._dynamo.utils import counters

    def mix(loras, rotation: int) -> list:
        return [None, *loras[rotation:], *loras[:rotation], None, loras[rotation]]

    kwargs = {"dtype": "float32", "enable_lora": True, "max_loras": 3}
    with LLM(str(tiny_llama_dir), compilation_level=0, **kwargs) as eager:
        loras = [eager.load_lora(n, str(p)) for n, p in llama_adapters.items()]
        expected = [
            token_ids(eager.generate(PROMPTS * 2, GREEDY, lora_request=mix(loras, r)))
            for r in range(3)
        ]
    with LLM(str(tiny_llama_dir), compilation_level=1, **kwargs) as compiled:
        loras = [compiled.load_lora(n, str(p)) for n, p in llama_adapters.items()]
        compiled.generate(PROMPTS, GREEDY)  # the base model alone first
        graphs = counters["stats"]["unique_graphs"]
        for rotation in range(3):
            got = compiled.generate(PROMPTS * 2, GREEDY, lora_request=mix(loras, rotation))
            assert token_ids(got) == expected[rotation]
        assert counters["stats"]["unique_graphs"] == graphs


# -- adapter folders and the registry ---------------------------------------------------------


@pytest.fixture
def good_adapter(tiny_llama_dir, tmp_path) -> Path:
    return make_tiny_adapter(tiny_llama_dir, tmp_path / "good", rank=8)


def broken(adapter: Path, **config_changes) -> Path:
    settings = json.loads((adapter / "adapter_config.json").read_text())
    settings.update(config_changes)
    (adapter / "adapter_config.json").write_text(json.dumps(settings))
    return adapter


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda a: broken(a, r=32), "exceeds this server's max_lora_rank 16"),
        (lambda a: broken(a, r=4), "need [4,"),  # config and tensors disagree
        (lambda a: broken(a, use_dora=True), "use_dora"),
        (lambda a: broken(a, bias="all"), "bias 'all'"),
        (lambda a: broken(a, peft_type="PREFIX_TUNING"), "only LORA"),
        (lambda a: (a / "adapter_config.json").unlink() or a, "no adapter_config.json"),
        (lambda a: _write(a / "adapter_config.json", "{") or a, "cannot be read"),
        (lambda a: (a / "adapter_model.safetensors").unlink() or a, "no adapter_model"),
        (lambda a: _truncate(a / "adapter_model.safetensors") or a, "truncated"),
        (lambda a: a / "missing", "is not a directory"),
        (lambda a: _vision_tensor(a), "adapts the vision tower"),
        (lambda a: _fused_beside_its_part(a), "adapts layer 1 q_proj twice: on its own and in"),
    ],
    ids=[
        "rank-too-large",
        "rank-mismatch",
        "dora",
        "bias",
        "not-lora",
        "no-config",
        "bad-json",
        "no-weights",
        "truncated",
        "no-folder",
        "vision-tower",
        "adapted-twice",
    ],
)
def test_a_broken_adapter_is_refused_by_name_and_nothing_is_registered(
    tiny_llama_dir, good_adapter, damage, message
):
    config = ModelConfig.from_pretrained(tiny_llama_dir)
    registry = LoRARegistry(config, max_lora_rank=16, reserved_names=["base"])
    path = damage(good_adapter)
    with pytest.raises(LoRAError, match=None) as error:
        registry.load("x", path)
    assert message in str(error.value)
    assert len(registry) == 0 and registry.get("x") is None


def _write(file: Path, text: str) -> None:
    file.write_text(text)


def _vision_tensor(adapter: Path) -> Path:
    """One tensor renamed as a multimodal adapter names its vision tower's layers."""
    from safetensors.torch import load_file, save_file

    file = adapter / "adapter_model.safetensors"
    tensors = load_file(file)
    name = next(iter(tensors))
    vision = name.replace("model.layers.", "model.vision_tower.vision_model.encoder.layers.", 1)
    assert vision != name
    tensors[vision] = tensors.pop(name)
    save_file(tensors, file)
    return adapter


def _fused_beside_its_part(adapter: Path) -> Path:
    """A layer's q, k and v adapted again as one fused qkv_proj (Phi-3's name)."""
    import torch
    from safetensors.torch import load_file, save_file

    file = adapter / "adapter_model.safetensors"
    tensors = load_file(file)
    prefix = "base_model.model.model.layers.1.self_attn"
    parts = [tensors[f"{prefix}.{p}_proj.lora_B.weight"] for p in "qkv"]
    tensors[f"{prefix}.qkv_proj.lora_A.weight"] = tensors[f"{prefix}.q_proj.lora_A.weight"].clone()
    tensors[f"{prefix}.qkv_proj.lora_B.weight"] = torch.cat(parts)
    save_file(tensors, file)
    return adapter


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])


def test_adapter_for_another_model_is_refused(tiny_llama_dir, tmp_path):
    from tidegate.engine.tiny_model import make_tiny_model

    other = make_tiny_model(tmp_path / "other", size="tiny")
    config = json.loads((other / "config.json").read_text())
    config["intermediate_size"] = 256
    (other / "config.json").write_text(json.dumps(config))
    adapter = make_tiny_adapter(other, tmp_path / "a", rank=4, targets=["down_proj"])
    with pytest.raises(LoRAError, match=r"down_proj.*shape \[4, 256\].*need \[4, 384\]"):
        read_adapter(adapter, ModelConfig.from_pretrained(tiny_llama_dir), 16)


def test_registry_names_and_ids(tiny_llama_dir, good_adapter):
    registry = LoRARegistry(
        ModelConfig.from_pretrained(tiny_llama_dir), max_lora_rank=16, reserved_names=["base"]
    )
    first = registry.load("a", good_adapter)
    with pytest.raises(LoRAConflict, match="already loaded"):
        registry.load("a", good_adapter)
    with pytest.raises(LoRAConflict, match="base model's name"):
        registry.load("base", good_adapter)
    registry.unload("a")
    again = registry.load("a", good_adapter)
    assert again.lora_id != first.lora_id  # workers read it afresh
    assert again.digest == first.digest  # same files: same prefix-cache key
    assert parse_lora_modules(["x=/a", "y=/b=c"]) == {"x": "/a", "y": "/b=c"}
    with pytest.raises(ValueError, match="not name=path"):
        parse_lora_modules(["x"])


def test_adapters_need_enable_lora(tiny_llama_dir, good_adapter):
    with (
        LLM(str(tiny_llama_dir), dtype="float32") as llm,
        pytest.raises(ValueError, match="enable_lora"),
    ):
        llm.load_lora("a", str(good_adapter))


def test_async_scheduling_gives_adapters_the_tokens_of_synchronous_steps(
    tiny_llama_dir, llama_adapters
):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=3)
    outputs = []
    for async_scheduling in (False, True):
        with LLM(
            str(tiny_llama_dir),
            dtype="float32",
            enable_lora=True,
            max_loras=2,
            async_scheduling=async_scheduling,
        ) as llm:
            loras = [llm.load_lora(n, str(p)) for n, p in llama_adapters.items()]
            mix = [loras[0], None, loras[1], loras[2], loras[0], None]
            outputs.append(token_ids(llm.generate(PROMPTS * 2, params, lora_request=mix)))
    assert outputs[1] == outputs[0]

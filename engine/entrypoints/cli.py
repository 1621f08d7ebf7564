"""The engine's subcommands of `tidegate`: make-tiny-model, make-tiny-adapter, generate, serve,
fetch-model.

`tidegate.cli` imports this module only when one of these commands runs; each handler
imports what its command needs when it runs, so `tidegate serve` loads neither the operator
nor the benchmark client.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from tidegate.engine.config import EngineArgs, ServerArgs
from tidegate.engine.entrypoints.args import add_engine_args, engine_args_from


def _make_tiny_model(ns: argparse.Namespace) -> int:
    from tidegate.engine.tiny_model import make_tiny_model

    path = make_tiny_model(
        ns.dir,
        arch=ns.arch,
        size=ns.size,
        seed=ns.seed,
        quantize=ns.quantize,
        num_labels=ns.num_labels,
    )
    print(path)
    return 0


def _make_tiny_adapter(ns: argparse.Namespace) -> int:
    from tidegate.engine.lora.tiny_adapter import make_tiny_adapter

    path = make_tiny_adapter(
        ns.model, ns.dir, rank=ns.rank, alpha=ns.alpha, seed=ns.seed, targets=ns.targets
    )
    print(path)
    return 0


def _generate(ns: argparse.Namespace) -> int:
    from tidegate.engine.llm import LLM
    from tidegate.engine.sampling_params import SamplingParams

    args = engine_args_from(ns)
    llm = LLM(**args.model_dump())
    params = SamplingParams(
        max_tokens=ns.max_tokens, temperature=ns.temperature, seed=ns.sampling_seed
    )
    start = time.perf_counter()
    outputs = llm.generate(ns.prompt, params)
    elapsed = time.perf_counter() - start
    for output in outputs:
        completion = output.outputs[0]
        print(f"--- prompt: {output.prompt!r}")
        print(f"    output: {completion.text!r} ({completion.finish_reason})")
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{generated} tokens in {elapsed:.2f}s; stats: {llm.stats()}")
    return 0


def _serve(ns: argparse.Namespace) -> int:
    if ns.node_rank > 0:
        # A node of a model spread over nodes: the leader sends it everything else.
        from tidegate.engine.executor.node_agent import run_node

        return run_node(ns.nnodes, ns.node_rank, ns.master_addr, ns.master_port, ns.log_level)
    take_model_tag(ns)
    if ns.model is None:
        raise SystemExit(
            "tidegate serve: the model is required: tidegate serve MODEL, or --model MODEL "
            "(on the leader: --node-rank 0)"
        )
    from tidegate.engine.entrypoints.serve import run_server

    engine_args = engine_args_from(ns)
    return run_server(engine_args, engine_args_from(ns, ServerArgs))


def take_model_tag(ns: argparse.Namespace) -> None:
    """`tidegate serve MODEL`, as `vllm serve MODEL`: the positional fills --model, and the two
    (or a --config file's model) must not name different folders."""
    if ns.model_tag is None:
        return
    if ns.model is not None and ns.model != ns.model_tag:
        raise SystemExit(
            f"tidegate serve: the model is given twice, as {ns.model_tag!r} and as --model "
            f"{ns.model!r}; give it once"
        )
    ns.model = ns.model_tag


def _fetch_model(ns: argparse.Namespace) -> int:
    from tidegate.engine.entrypoints.fetch_model import fetch_model, fetch_model_shared

    fetch = fetch_model_shared if ns.shared else fetch_model
    print(fetch(ns.uri, ns.dest))
    return 0


def add_make_tiny_model(parser: argparse.ArgumentParser, config: dict[str, Any] | None) -> None:
    parser.add_argument("dir")
    # engine/tiny_model.py's ARCHITECTURES, spelled out: importing it here would load torch.
    archs = [
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma2",
        "gemma3",
        "phi3",
        "qwen3_moe",
        "mixtral",
    ]
    parser.add_argument("--arch", choices=archs, default="llama")
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quantize",
        choices=["fp8-block", "fp8-channel", "fp8-tensor"],  # tiny_model.QUANTIZATIONS
        default=None,
        help="write an FP8 checkpoint: 32 x 32 blocks (128 x 128 for small) as transformers' "
        "fp8, or per channel / per tensor as compressed-tensors",
    )
    parser.add_argument(
        "--num-labels",
        type=int,
        default=0,
        help="write a sequence classifier of this many labels (1: a reranker) instead of a "
        "causal LM: the same decoder with a score head (*ForSequenceClassification)",
    )
    parser.set_defaults(handler=_make_tiny_model)


def add_make_tiny_adapter(parser: argparse.ArgumentParser, config: dict[str, Any] | None) -> None:
    from tidegate.engine.lora.adapter import TARGETS

    parser.add_argument("model", help="the base model folder (tidegate make-tiny-model)")
    parser.add_argument("dir", help="folder to write the adapter to")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=None, help="default: the rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--targets",
        nargs="+",
        choices=TARGETS,
        default=None,
        help="default: every projection, as the model names its modules (Phi-3: fused)",
    )
    parser.set_defaults(handler=_make_tiny_adapter)


def add_generate(parser: argparse.ArgumentParser, config: dict[str, Any] | None) -> None:
    add_engine_args(parser)
    parser.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--sampling-seed", type=int, default=None)
    parser.set_defaults(handler=_generate)


def add_serve(parser: argparse.ArgumentParser, config: dict[str, Any] | None) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML file of flag: value (e.g. max-num-seqs: 64); flags given here win",
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model folder, as an alternative to --model (vLLM's `vllm serve MODEL`)",
    )
    # The model may be left out on a node above rank 0, which takes the leader's.
    add_engine_args(parser, defaults={"model": None, **(config or {})})
    add_engine_args(parser, ServerArgs, defaults=config)
    parser.set_defaults(handler=_serve)


def add_fetch_model(parser: argparse.ArgumentParser, config: dict[str, Any] | None) -> None:
    parser.add_argument("uri", help="http(s):// or file:// .tar/.tar.gz of the folder, or a dir")
    parser.add_argument("dest", help="folder to fill")
    parser.add_argument(
        "--shared",
        action="store_true",
        help="DEST is in a cache other pods fill too: fetch once under DEST.lock and rename "
        "the finished folder into place (DEST itself must not be a mount point)",
    )
    parser.set_defaults(handler=_fetch_model)


COMMANDS: dict[str, Callable[[argparse.ArgumentParser, dict[str, Any] | None], None]] = {
    "make-tiny-model": add_make_tiny_model,
    "make-tiny-adapter": add_make_tiny_adapter,
    "generate": add_generate,
    "serve": add_serve,
    "fetch-model": add_fetch_model,
}
# The config models whose flags a command's --config file may set.
CONFIG_MODELS = {"serve": [EngineArgs, ServerArgs]}

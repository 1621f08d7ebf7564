"""The `tidegate` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys
import time
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from tidegate.engine.config import EngineArgs, RouterArgs, ServerArgs

M = typing.TypeVar("M", bound=BaseModel)


def add_engine_args(
    parser: argparse.ArgumentParser,
    model: type[BaseModel] = EngineArgs,
    defaults: dict[str, Any] | None = None,
) -> None:
    """Add one --flag per field of a config model, named and documented from the model itself.

    `defaults` (field name -> value, e.g. from --config) replace the model's defaults, so that
    a flag on the command line still wins over the file.
    """
    defaults = defaults or {}
    for name, field in model.model_fields.items():
        flag = "--" + name.replace("_", "-")
        annotation = field.annotation
        default = defaults.get(name, field.default)
        # argparse formats help with %: a literal one ("90% of") must be doubled.
        help_text = (field.description or "").replace("%", "%%")
        kwargs: dict[str, Any] = {"help": help_text, "dest": name}
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
            kwargs["default"] = default
        elif typing.get_origin(_strip_none(annotation)) is list:
            kwargs["nargs"] = "+"
            if field.is_required() and name not in defaults:
                kwargs["required"] = True
            else:
                kwargs["default"] = default
        else:
            choices, cast = _argparse_type(annotation)
            kwargs.update(type=cast, choices=choices)
            if field.is_required() and name not in defaults:
                kwargs["required"] = True
            else:
                kwargs["default"] = default
        parser.add_argument(flag, **kwargs)


def flag_name(field_name: str) -> str:
    """The command-line spelling of a config field: max_num_seqs -> max-num-seqs."""
    return field_name.replace("_", "-")


def load_config_file(path: str, models: Sequence[type[BaseModel]]) -> dict[str, Any]:
    """Flag values from a YAML (or JSON) mapping whose keys are flag names, as vLLM's --config."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as error:
        raise SystemExit(f"tidegate: cannot read --config {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise SystemExit(f"tidegate: --config {path} is not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"tidegate: --config {path} must hold a mapping of flag: value")
    known = {name for model in models for name in model.model_fields}
    values = {str(key).replace("-", "_"): value for key, value in data.items()}
    unknown = sorted(flag_name(key) for key in values if key not in known)
    if unknown:
        raise SystemExit(f"tidegate: --config {path} names unknown flags: {', '.join(unknown)}")
    return values


def _strip_none(annotation: Any) -> Any:
    """The X of `X | None`."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return inner[0]
    return annotation


def _argparse_type(annotation: Any) -> tuple[list[Any] | None, Any]:
    """(choices, converter) for a field annotation such as int | None or Literal[...]."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        words = [a for a in inner if typing.get_origin(a) is typing.Literal]
        if words and len(inner) == 2:  # e.g. int | Literal["auto"]: a number or the word
            keywords = set(typing.get_args(words[0]))
            other = next(a for a in inner if a is not words[0])
            return None, lambda text: text if text in keywords else other(text)
    annotation = _strip_none(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        choices = list(typing.get_args(annotation))
        return choices, type(choices[0])
    return None, annotation


def engine_args_from(namespace: argparse.Namespace, model: type[M] = EngineArgs) -> M:  # type: ignore[assignment]
    """A config model from parsed flags; a bad combination exits with the validator's message."""
    values = {name: getattr(namespace, name) for name in model.model_fields}
    try:
        return model(**values)
    except ValidationError as error:
        raise SystemExit(f"tidegate: invalid arguments:\n{error}") from None


def _make_tiny_model(ns: argparse.Namespace) -> int:
    from tidegate.engine.tiny_model import make_tiny_model

    path = make_tiny_model(ns.dir, arch=ns.arch, size=ns.size, seed=ns.seed)
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
    from tidegate.engine.entrypoints.serve import run_server

    engine_args = engine_args_from(ns)
    return run_server(engine_args, engine_args_from(ns, ServerArgs))


def _router(ns: argparse.Namespace) -> int:
    from tidegate.engine.router.server import run_router

    return run_router(engine_args_from(ns, RouterArgs))


def _up(ns: argparse.Namespace) -> int:
    import logging

    from tidegate.operator.up import run_up

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run_up(ns.file, ns.model_dir, ns.port)


def _demo(ns: argparse.Namespace) -> int:
    from tidegate.engine.entrypoints.demo import run_demo

    try:
        return run_demo(ns.model, ns.port, ns.file)
    except RuntimeError as error:
        print(f"tidegate demo: {error}", file=sys.stderr)
        return 1


def _fetch_model(ns: argparse.Namespace) -> int:
    from tidegate.engine.entrypoints.fetch_model import fetch_model

    print(fetch_model(ns.uri, ns.dest))
    return 0


def _plan(ns: argparse.Namespace) -> int:
    from tidegate.operator.manifest import load_llm_deployments
    from tidegate.operator.plan import plan, write_table, write_yaml
    from tidegate.operator.render import RenderOptions
    from tidegate.operator.spec import SpecError

    try:
        resources = load_llm_deployments(ns.file)
        for resource in resources:
            if ns.namespace:
                resource["metadata"]["namespace"] = ns.namespace
        plans = plan(resources, RenderOptions(default_image=ns.engine_image))
    except SpecError as error:
        print(f"tidegate plan: {error}", file=sys.stderr)
        return 1
    (write_yaml if ns.output == "yaml" else write_table)(resources, plans, sys.stdout)
    return 0


def _operator(ns: argparse.Namespace) -> int:
    import logging

    from tidegate.operator.handlers import OperatorOptions, run_operator
    from tidegate.operator.render import RenderOptions

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    options = OperatorOptions(render=RenderOptions(default_image=ns.engine_image))
    run_operator(options, namespaces=ns.namespace or [], liveness_endpoint=ns.liveness or None)
    return 0


def _bench_serve(ns: argparse.Namespace) -> int:
    from tidegate.engine.bench.serve import main as bench_serve

    return bench_serve(ns)


def _bench_throughput(ns: argparse.Namespace) -> int:
    from tidegate.engine.bench.throughput import main as bench_throughput

    return bench_throughput(ns, engine_args_from(ns))


def build_parser(config: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    """The whole command line, subcommands included; `config` holds `--config` values."""
    parser = argparse.ArgumentParser(prog="tidegate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny-model", help="write a random-weight model folder for tests")
    tiny.add_argument("dir")
    tiny.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    tiny.add_argument("--size", choices=["tiny", "small"], default="tiny")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(handler=_make_tiny_model)

    gen = sub.add_parser("generate", help="generate text offline from prompts")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.set_defaults(handler=_generate)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    serve.add_argument(
        "--config",
        metavar="FILE",
        help="YAML file of flag: value (e.g. max-num-seqs: 64); flags given here win",
    )
    add_engine_args(serve, defaults=config)
    add_engine_args(serve, ServerArgs, defaults=config)
    serve.set_defaults(handler=_serve)

    router = sub.add_parser("router", help="route requests to prefill and decode instances")
    router.add_argument(
        "--config",
        metavar="FILE",
        help="YAML file of flag: value (e.g. prefill: [URL]); flags given here win",
    )
    add_engine_args(router, RouterArgs, defaults=config)
    router.set_defaults(handler=_router)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    bench_serve = bench.add_parser("serve", help="load an OpenAI-compatible server")
    from tidegate.engine.bench.serve import add_arguments

    add_arguments(bench_serve)
    bench_serve.set_defaults(handler=_bench_serve)
    bench_tp = bench.add_parser("throughput", help="offline throughput through LLM")
    add_engine_args(bench_tp)
    bench_tp.add_argument("--input-len", type=int, default=128)
    bench_tp.add_argument("--output-len", type=int, default=64)
    bench_tp.add_argument("--num-prompts", type=int, default=64)
    bench_tp.add_argument("--out", default=None)
    bench_tp.set_defaults(handler=_bench_throughput)

    from tidegate.operator.render import DEFAULT_ENGINE_IMAGE

    fetch = sub.add_parser("fetch-model", help="put a model folder in place (init containers)")
    fetch.add_argument("uri", help="http(s):// or file:// .tar/.tar.gz of the folder, or a dir")
    fetch.add_argument("dest", help="folder to fill")
    fetch.set_defaults(handler=_fetch_model)

    plan = sub.add_parser("plan", help="what the operator would create for a manifest, and why")
    plan.add_argument("-f", "--file", required=True, help="YAML with LLMDeployment resources")
    plan.add_argument("-o", "--output", choices=["table", "yaml"], default="table")
    plan.add_argument("-n", "--namespace", help="namespace to render into (default: the file's)")
    plan.add_argument(
        "--engine-image", default=DEFAULT_ENGINE_IMAGE, help="when spec.image is unset"
    )
    plan.set_defaults(handler=_plan)

    up = sub.add_parser("up", help="run an LLMDeployment's pods on this machine, as in a cluster")
    up.add_argument("-f", "--file", required=True, help="YAML with one LLMDeployment")
    up.add_argument(
        "--model-dir", type=Path, help="local model folder (default: the hostPath source)"
    )
    up.add_argument("--port", type=int, default=8000, help="port of the public endpoint")
    up.set_defaults(handler=_up)

    operator = sub.add_parser("operator", help="run the Kubernetes operator (kopf)")
    operator.add_argument(
        "-n",
        "--namespace",
        action="append",
        help="watch this namespace (repeat for several); default: the whole cluster",
    )
    operator.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="URL of the liveness endpoint to serve ('' for none)",
    )
    operator.add_argument(
        "--engine-image", default=DEFAULT_ENGINE_IMAGE, help="when spec.image is unset"
    )
    operator.set_defaults(handler=_operator)

    demo = sub.add_parser("demo", help="run the tiny disaggregated example, ask it one question")
    demo.add_argument("--model", required=True)
    demo.add_argument("--port", type=int, default=8000)
    demo.add_argument(
        "-f", "--file", default="examples/disaggregated-tiny.yaml", help="the LLMDeployment to run"
    )
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run the subcommand."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config = None
    config_models = {"serve": [EngineArgs, ServerArgs], "router": [RouterArgs]}
    if argv[:1] and argv[0] in config_models:
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--config")
        path = pre.parse_known_args(argv[1:])[0].config
        if path is not None:
            config = load_config_file(path, config_models[argv[0]])
    ns = build_parser(config).parse_args(argv)
    try:
        return ns.handler(ns)
    except ValueError as error:
        print(f"tidegate: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

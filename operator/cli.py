"""The operator's subcommands of `tidegate`: plan, up, operator and demo.

`tidegate.cli` imports this module only when one of them runs. Rendering a plan imports no
engine internals; `tidegate up` starts engine processes through the `tidegate` command, never
by importing the engine.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidegate.operator.render import DEFAULT_ENGINE_IMAGE

if TYPE_CHECKING:
    from tidegate.operator.handlers import OperatorOptions

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _plan(ns: argparse.Namespace) -> int:
    from tidegate.operator.manifest import load_llm_deployments
    from tidegate.operator.plan import plan, write_table, write_yaml
    from tidegate.operator.render import RenderOptions
    from tidegate.operator.rollout import role_changes, rollout_steps
    from tidegate.operator.spec import SpecError

    options = RenderOptions(default_image=ns.engine_image)

    def load(path: str) -> list[dict[str, Any]]:
        resources = load_llm_deployments(path)
        for resource in resources:
            if ns.namespace:
                resource["metadata"]["namespace"] = ns.namespace
        return resources

    try:
        resources = load(ns.file)
        plans = plan(resources, options)
        changes = steps = None
        if ns.from_file:
            before = {r["metadata"]["name"]: r for r in load(ns.from_file)}
            olds = {
                resource["metadata"]["name"]: (plan([old], options)[0], rendered)
                for resource, rendered in zip(resources, plans, strict=True)
                if (old := before.get(resource["metadata"]["name"])) is not None
            }
            changes = {name: role_changes(*pair) for name, pair in olds.items()}
            steps = {name: rollout_steps(name, *pair) for name, pair in olds.items()}
    except SpecError as error:
        print(f"tidegate plan: {error}", file=sys.stderr)
        return 1
    if ns.output == "yaml":
        write_yaml(resources, plans, sys.stdout)
    else:
        write_table(resources, plans, sys.stdout, changes, steps)
    return 0


def _up(ns: argparse.Namespace) -> int:
    from tidegate.operator.up import run_up

    logging.basicConfig(level=logging.INFO, format=_LOG_FORMAT)
    return run_up(ns.file, ns.model_dir, ns.port, dict(ns.claim_dir or []))


def _operator(ns: argparse.Namespace) -> int:
    from tidegate.operator.handlers import run_operator

    logging.basicConfig(level=logging.INFO, format=_LOG_FORMAT)
    try:
        options = operator_options(ns)
    except ValueError as error:
        print(f"tidegate operator: {error}", file=sys.stderr)
        return 2
    run_operator(options, namespaces=ns.namespace or [], liveness_endpoint=ns.liveness or None)
    return 0


def operator_options(ns: argparse.Namespace) -> OperatorOptions:
    """The OperatorOptions of `tidegate operator`'s flags; ValueError for lists that overlap."""
    from tidegate.operator.handlers import OperatorOptions
    from tidegate.operator.host_paths import HostPathPolicy
    from tidegate.operator.render import RenderOptions

    # Always a policy: with neither flag, it allows no hostPath at all.
    host_paths = HostPathPolicy(
        read_only=tuple(ns.allowed_host_path), cache=tuple(ns.allowed_cache_host_path)
    )
    return OperatorOptions(
        render=RenderOptions(default_image=ns.engine_image, host_paths=host_paths),
        autoscale_period_s=ns.autoscale_period,
        metrics_port=ns.metrics_port or None,
        adapter_period_s=ns.adapter_period,
        rollout_period_s=ns.rollout_period,
        peering=ns.peering,
        peering_lifetime_s=ns.peering_lifetime,
    )


def _demo(ns: argparse.Namespace) -> int:
    from tidegate.operator.demo import run_demo

    try:
        return run_demo(ns.model, ns.port, ns.file)
    except RuntimeError as error:
        print(f"tidegate demo: {error}", file=sys.stderr)
        return 1


def add_plan(parser: argparse.ArgumentParser, config: dict[str, Any] | None) -> None:
    parser.add_argument("-f", "--file", required=True, help="YAML with LLMDeployment resources")
    parser.add_argument("-o", "--output", choices=["table", "yaml"], default="table")
    parser.add_argument("-n", "--namespace", help="namespace to render into (default: the file's)")
    parser.add_argument(
        "--engine-image", default=DEFAULT_ENGINE_IMAGE, help="when spec.image is unset"
    )
    parser.add_argument(
        "--from",
        dest="from_file",
        help="the manifest as it runs now: also show which pods the change restarts, and why",
    )
    parser.set_defaults(handler=_plan)


def add_up(parser: argparse.ArgumentParser, config: dict[str, Any] | None) -> None:
    parser.add_argument("-f", "--file", required=True, help="YAML with one LLMDeployment")
    parser.add_argument(
        "--model-dir", type=Path, help="local model folder (default: the hostPath source)"
    )
    parser.add_argument("--port", type=int, default=8000, help="port of the public endpoint")
    parser.add_argument(
        "--claim-dir",
        type=_claim_dir,
        action="append",
        metavar="CLAIM=DIR",
        help="local folder standing for a PersistentVolumeClaim that adapters are on (repeat)",
    )
    parser.set_defaults(handler=_up)


def _claim_dir(text: str) -> tuple[str, Path]:
    claim, sep, folder = text.partition("=")
    if not sep or not claim or not folder:
        raise argparse.ArgumentTypeError(f"{text!r} is not CLAIM=DIR")
    return claim, Path(folder)


def add_operator(parser: argparse.ArgumentParser, config: dict[str, Any] | None) -> None:
    from tidegate.operator.cluster_scaler import PERIOD_S

    parser.add_argument(
        "-n",
        "--namespace",
        action="append",
        help="watch this namespace (repeat for several); default: the whole cluster",
    )
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="URL of the liveness endpoint to serve ('' for none)",
    )
    parser.add_argument(
        "--engine-image", default=DEFAULT_ENGINE_IMAGE, help="when spec.image is unset"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=8081,
        help="port of the operator's /metrics (the autoscaler's gauges); 0 for none",
    )
    parser.add_argument(
        "--autoscale-period",
        type=_positive_seconds,
        default=PERIOD_S,
        help="seconds between two decisions of the autoscaler (driver: operator)",
    )
    parser.add_argument(
        "--adapter-period",
        type=_positive_seconds,
        default=PERIOD_S,
        help="seconds between two reads of which pods serve each LoRA adapter (status.adapters)",
    )
    parser.add_argument(
        "--rollout-period",
        type=_positive_seconds,
        default=PERIOD_S,
        help="seconds between two comparisons of a canary with its stable pods",
    )
    parser.add_argument(
        "--peering",
        metavar="NAME",
        help="elect one of several operators through kopf's peering object NAME (a "
        "ClusterKopfPeering, or a KopfPeering in each --namespace), which must exist; the one "
        "started first reconciles, the others stand by; default: standalone, the only operator",
    )
    parser.add_argument(
        "--peering-lifetime",
        type=_positive_whole_seconds,
        default=60,
        metavar="SECONDS",
        help="with --peering: how long a crashed operator's standby waits before taking over",
    )
    parser.add_argument(
        "--allowed-host-path",
        action="append",
        default=[],
        type=_node_folder,
        metavar="PREFIX",
        help="a node folder under which model and adapter hostPath sources may lie, mounted "
        "read-only (repeat); none by default",
    )
    parser.add_argument(
        "--allowed-cache-host-path",
        action="append",
        default=[],
        type=_node_folder,
        metavar="FOLDER",
        help="a node folder that spec.model.cache.hostPath may name, exactly (repeat); pods "
        "write there, so it may not overlap an --allowed-host-path; none by default",
    )
    parser.set_defaults(handler=_operator)


def _node_folder(text: str) -> str:
    from tidegate.operator.host_paths import normalised

    try:
        return normalised(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def _positive_whole_seconds(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive whole number of seconds")
    return value


def add_demo(parser: argparse.ArgumentParser, config: dict[str, Any] | None) -> None:
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "-f", "--file", default="examples/disaggregated-tiny.yaml", help="the LLMDeployment to run"
    )
    parser.set_defaults(handler=_demo)


COMMANDS: dict[str, Callable[[argparse.ArgumentParser, dict[str, Any] | None], None]] = {
    "plan": add_plan,
    "up": add_up,
    "operator": add_operator,
    "demo": add_demo,
}

"""A prefill pod declares exactly the ports its engine's KV producer listens on.

The engine side is real: the rendered config file is loaded as `tidegate serve --config`
loads it, and each engine core's connector and each rank's block server bind their sockets.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from tidegate.engine.config import EngineArgs, ServerArgs
from tidegate.engine.entrypoints.args import load_config_file
from tidegate.engine.kv_transfer.zmq_scheduler import ZmqConnectorScheduler
from tidegate.engine.kv_transfer.zmq_worker import ZmqConnectorWorker
from tidegate.operator.kv_keys import write_key_dir
from tidegate.operator.labels import COMPONENT_LABEL
from tidegate.operator.render import render
from tidegate.operator.spec import API_VERSION, KIND

HEADS = 8


def prefill_pod(dp: int, tp: int, tmp_path: Path) -> tuple[EngineArgs, set[int]]:
    """The prefill pool's engine flags and the KV containerPorts its pods declare."""
    resource = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": "llm", "namespace": "ml"},
        "spec": {
            "model": {
                "name": "tiny-llama",
                "source": {"hostPath": {"path": "/models/t"}},
                "parameterCount": 1e9,
                "numAttentionHeads": HEADS,
                "numKeyValueHeads": HEADS,
            },
            "accelerator": {"count": dp * tp, "memoryGiB": 80},
            "parallelism": {"tensorParallelSize": tp, "dataParallelSizeLocal": dp},
            "topology": {"mode": "disaggregated", "prefill": {}, "decode": {}},
        },
    }
    rendered = render(resource)
    (config_map,) = [o for o in rendered.objects if o["kind"] == "ConfigMap"]
    path = tmp_path / "prefill.yaml"
    path.write_text(config_map["data"]["prefill.yaml"], encoding="utf-8")
    values = load_config_file(str(path), [EngineArgs, ServerArgs])
    args = EngineArgs(**{k: v for k, v in values.items() if k in EngineArgs.model_fields})
    if args.kv_curve_key_dir is not None:
        # The pod reads the key pair from its Secret; here, a pair made the way `tidegate up` does.
        write_key_dir(tmp_path / "kv-curve")
        args = args.model_copy(update={"kv_curve_key_dir": str(tmp_path / "kv-curve")})
    (deployment,) = [
        o
        for o in rendered.objects
        if o["kind"] == "Deployment" and o["metadata"]["labels"][COMPONENT_LABEL] == "prefill"
    ]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    # The KV transfer ports: kv, kv-1, ... (http and the KV-events port serve other clients).
    declared = {p["containerPort"] for p in container["ports"] if p["name"].startswith("kv")}
    return args, declared


@pytest.mark.parametrize(("dp", "tp"), [(1, 1), (2, 1), (1, 2), (2, 4)])
def test_a_prefill_pod_declares_every_port_its_engine_listens_on(
    dp: int, tp: int, tmp_path: Path
) -> None:
    args, declared = prefill_pod(dp, tp, tmp_path)
    assert (args.data_parallel_size_local, args.tensor_parallel_size) == (dp, tp)
    assert args.kv_role == "producer"
    listening: list[int] = []
    with contextlib.ExitStack() as stack:
        for engine_index in range(dp):
            connector = ZmqConnectorScheduler(args, engine_index)
            stack.callback(connector.shutdown)
            listening.append(connector.side_port)
            config = connector.worker_config()
            for rank in range(tp):
                worker = ZmqConnectorWorker(config, rank, tp, HEADS, torch.device("cpu"))
                stack.callback(worker.shutdown)
                listening.append(worker.data_port)
    assert len(listening) == len(set(listening))
    assert set(listening) == declared

"""`tidegate serve`: the API server process, its engine cores, and an orderly life cycle.

Exit codes: 0 after SIGTERM/SIGINT (in-flight requests drained up to --shutdown-timeout),
1 when the engine could not start or an engine process died (Kubernetes restarts the pod).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING

import uvicorn

from tidegate.engine.async_llm import AsyncLLM
from tidegate.engine.config import EngineArgs, ServerArgs
from tidegate.engine.http_server import STOP_SIGNALS, Drain, StoppableServer
from tidegate.engine.metrics import PrometheusMetrics
from tidegate.engine.process import LOG_FORMAT, name_process

if TYPE_CHECKING:
    from tidegate.engine.entrypoints.openai.auth import APIKeys

logger = logging.getLogger("tidegate.serve")


def run_server(engine_args: EngineArgs, server_args: ServerArgs) -> int:
    """Run until stopped; returns the process exit code."""
    name_process("tidegate::api")
    os.environ.setdefault("TIDEGATE_LOG_LEVEL", server_args.log_level.upper())
    logging.basicConfig(level=server_args.log_level.upper(), format=LOG_FORMAT)
    return asyncio.run(_serve(engine_args, server_args))


async def _serve(engine_args: EngineArgs, server_args: ServerArgs) -> int:
    started = time.monotonic()
    from tidegate.engine.entrypoints.openai.auth import load_api_keys

    try:
        _check_roles(engine_args, server_args)
        api_keys = load_api_keys(server_args)
    except ValueError as error:
        logger.error("tidegate serve could not start: %s", error)
        return 1
    names = server_args.served_model_name or [engine_args.model]
    metrics = PrometheusMetrics(
        names[0],
        compat=server_args.metrics_compat,
        num_engines=engine_args.data_parallel_size_local,
    )
    # Routers read the track from the start, before the model has loaded.
    metrics.record_revision(engine_args.track, engine_args.canary_weight)
    # A Ctrl-C or SIGTERM while the model loads stops the start-up cleanly.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.ensure_future(
        AsyncLLM.start(
            engine_args,
            max_waiting_requests=server_args.max_waiting_requests,
            max_waiting_per_tenant=server_args.max_waiting_per_tenant,
            metrics=metrics,
            request_timeout=server_args.request_timeout,
        )
    )
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    for sig in STOP_SIGNALS:
        loop.remove_signal_handler(sig)
    if not starting.done():
        logger.info("stopped while starting")
        starting.cancel()
        with contextlib.suppress(BaseException):
            await starting
        return 0
    stopping.cancel()
    try:
        engine = starting.result()
    except (ValueError, RuntimeError) as error:
        logger.error("tidegate serve could not start: %s", error)
        return 1

    from tidegate.engine.entrypoints.openai.api_server import build_app

    metrics.record_cache_config(
        engine_args.block_size,
        engine_args.enable_prefix_caching,
        # vLLM's label: "fp8", or with auto the model's dtype, as the engine cores resolved it.
        engine_args.kv_cache_dtype
        if engine_args.kv_cache_dtype != "auto"
        else engine.dtype or engine_args.dtype,
    )
    if server_args.prefill_via_header:
        metrics.enable_prefill_via_header()
    try:
        loras = _lora_serving(engine_args, server_args, engine, names, metrics, api_keys)
    except ValueError as error:
        logger.error("tidegate serve could not start: %s", error)
        await engine.shutdown()
        return 1
    # SIGTERM: /health turns 503 at once and new requests are refused while those in flight
    # finish, up to --shutdown-timeout (engine/http_server.py).
    drain = Drain(server_args.shutdown_timeout)
    app = build_app(
        engine,
        served_model_names=names,
        model_path=engine_args.model,
        api_key=api_keys,
        metrics=metrics,
        cache_salt_header=server_args.cache_salt_header,
        drain=drain,
        loras=loras,
        allow_runtime_lora_updates=server_args.allow_runtime_lora_updates,
        tool_call_parser=server_args.tool_call_parser,
        prefill_via_header=server_args.prefill_via_header,
        on_prefill_fallback=metrics.record_prefill_header_fallback,
        prefill_hosts=server_args.prefill_hosts,
        pooling=server_args.pooling,
    )
    config = uvicorn.Config(
        app,
        host=server_args.host,
        port=server_args.port,
        log_level=server_args.log_level,
        timeout_graceful_shutdown=server_args.shutdown_timeout,
        # The app's lifespan holds what lives as long as it serves (the prefill leg's client).
        lifespan="on",
        access_log=False,
    )
    server = StoppableServer(config, drain)
    exit_code = 0

    def on_dead(reason: str) -> None:
        nonlocal exit_code
        exit_code = 1
        logger.error("shutting down: %s", reason)
        server.should_exit = True

    engine.on_dead = on_dead
    if engine.is_dead:
        on_dead(engine.dead_reason or "the engine died while starting")
    logger.info(
        "engine ready in %.1f s; serving %s on http://%s:%d",
        time.monotonic() - started,
        ", ".join(names),
        server_args.host,
        server_args.port,
    )
    watcher = None
    if loras is not None and server_args.lora_modules_file:
        watcher = asyncio.ensure_future(loras.watch_file(server_args.lora_modules_file))
    try:
        await server.serve()
    finally:
        if watcher is not None:
            watcher.cancel()
        await engine.shutdown()
    if server.started is False and exit_code == 0:
        return 1  # could not bind the port; uvicorn said why
    return exit_code


def _check_roles(engine_args: EngineArgs, server_args: ServerArgs) -> None:
    """Refuse, before the model loads, flags that this server's KV role cannot serve, and
    KV keys it cannot use."""
    if server_args.prefill_via_header and engine_args.kv_role != "consumer":
        raise ValueError(
            "--prefill-via-header needs --kv-role consumer: only a decode instance has a "
            "prefill instance compute its prompts and pulls their KV; this server has "
            f"--kv-role {engine_args.kv_role}"
        )
    if engine_args.kv_role != "none" and engine_args.kv_curve_key_dir is not None:
        from tidegate.engine.kv_transfer.zmq_curve import load_curve_keys

        load_curve_keys(engine_args.kv_curve_key_dir)


def _lora_serving(
    engine_args: EngineArgs,
    server_args: ServerArgs,
    engine: AsyncLLM,
    names: list[str],
    metrics: PrometheusMetrics,
    api_keys: APIKeys | None,
):
    """The server's adapters (--lora-modules, then the file), or None without enable_lora."""
    lora_flags = {
        "lora_modules": server_args.lora_modules,
        "lora_modules_file": server_args.lora_modules_file,
        "allow_runtime_lora_updates": server_args.allow_runtime_lora_updates,
    }
    if not engine_args.enable_lora:
        given = [name for name, value in lora_flags.items() if value]
        if given:
            raise ValueError(
                f"{', '.join('--' + n.replace('_', '-') for n in given)} needs --enable-lora"
            )
        return None
    if server_args.allow_runtime_lora_updates and api_keys is None:
        raise ValueError(
            "--allow-runtime-lora-updates needs an API key (--api-key-file): the routes "
            "make the server read any path it can"
        )
    from tidegate.engine.entrypoints.openai.serving_lora import LoRAServing
    from tidegate.engine.lora.registry import LoRARegistry

    metrics.enable_lora(engine_args.max_loras)
    registry = LoRARegistry(engine.model_config, engine_args.max_lora_rank, reserved_names=names)
    loras = LoRAServing(registry, names, on_change=metrics.record_lora_adapters)
    loras.load_flags(server_args.lora_modules)
    if server_args.lora_modules_file:
        loras.sync_file(server_args.lora_modules_file)
    return loras

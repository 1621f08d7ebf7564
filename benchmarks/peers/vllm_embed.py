"""Offline embedding throughput of vLLM's CPU build: the peer to Tidegate's LLM.embed.

Runs inside the venv of benchmarks/peers/setup_vllm.sh (never imports tidegate), with the
environment it writes:

    source .cache/peers/vllm-env.sh
    $PEER_VLLM_PYTHON benchmarks/peers/vllm_embed.py --model DIR \
        --prompts-json prompts.json --out vllm.json

Last-token pooling, normalised (what Tidegate does for a folder without modules.json).
Writes each repeat's time and throughput, and the vectors of the first inputs, to check that
the two engines agree.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import vllm
from vllm.inputs import TokensPrompt

CHECKED_INPUTS = 4  # inputs whose vectors go into the record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompts-json", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=1024)
    args = parser.parse_args()
    prompts = json.loads(args.prompts_json.read_text())
    model, out = args.model.resolve(), args.out.resolve()
    # vLLM starts helpers with `python -m`: in the repository root its operator/ package would
    # shadow the standard library's (vllm_common.py says more).
    os.chdir(tempfile.gettempdir())
    from vllm import LLM
    from vllm.config import PoolerConfig

    llm = LLM(
        model=str(model),
        runner="pooling",
        dtype="bfloat16",
        max_model_len=args.max_model_len,
        seed=0,
        pooler_config=PoolerConfig(pooling_type="LAST", use_activation=True),  # normalised
    )
    batch = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
    llm.embed(batch[:2], use_tqdm=False)  # warm-up
    seconds, vectors = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        outputs = llm.embed(batch, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        vectors = [list(o.outputs.embedding) for o in outputs[:CHECKED_INPUTS]]
    tokens = sum(map(len, prompts))
    record = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "seconds": seconds,
        "inputs_per_s": [len(prompts) / s for s in seconds],
        "tokens_per_s": [tokens / s for s in seconds],
        "vectors": vectors,
    }
    out.write_text(json.dumps(record) + "\n")
    # vLLM 0.32's CPU build may abort in its teardown at exit ("terminate called without an
    # active exception", SIGABRT: a C++ thread left joinable): its engine-core and worker
    # processes are stopped first, and with the record written the process leaves without the
    # rest (run_peer_script ends whatever is left of its process group).
    llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

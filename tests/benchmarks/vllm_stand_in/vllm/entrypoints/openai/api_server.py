"""Stand-in for `python -m vllm.entrypoints.openai.api_server`: its flags, served by Tidegate."""

from __future__ import annotations

import argparse
import os

from tidegate.common.local_server import serve_command


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", required=True)
    args = parser.parse_args()
    flags = ["--served-model-name", args.served_model_name, "--dtype", args.dtype]
    command = serve_command(
        args.model, *flags, "--max-model-len", args.max_model_len, port=args.port
    )
    print("stand-in for vLLM's server:", " ".join(command), flush=True)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()

"""The tidegate command, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "tidegate.cli"]


def test_make_tiny_model_and_generate(tmp_path):
    model_dir = tmp_path / "m"
    made = subprocess.run(
        [*CLI, "make-tiny-model", str(model_dir), "--arch", "qwen2", "--seed", "3"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert made.stdout.strip() == str(model_dir)
    assert (model_dir / "model.safetensors").is_file()
    generated = subprocess.run(
        [*CLI, "generate", "--model", str(model_dir), "--prompt", "Hello", "--max-tokens", "5"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "prompt: 'Hello'" in generated.stdout
    assert "num_free_blocks" in generated.stdout


def test_an_fp8_tiny_model_generates_with_each_quantization(tmp_path):
    """make-tiny-model --quantize writes an FP8 checkpoint; generate serves it dequantized
    (auto on CPU), and held in FP8 under --quantization fp8."""
    model_dir = tmp_path / "fp8"
    subprocess.run(
        [*CLI, "make-tiny-model", str(model_dir), "--quantize", "fp8-block"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert '"quant_method": "fp8"' in (model_dir / "config.json").read_text()
    generate = [*CLI, "generate", "--model", str(model_dir), "--max-tokens", "3"]
    for quantization in ("auto", "fp8"):
        generated = subprocess.run(
            [*generate, "--prompt", "Hello", "--quantization", quantization],
            capture_output=True,
            text=True,
            check=True,
        )
        assert "prompt: 'Hello'" in generated.stdout
    bad = subprocess.run(
        [*generate, "--prompt", "x", "--quantization", "awq"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_bad_engine_flag_values_exit_with_a_message(tmp_path):
    result = subprocess.run(
        [*CLI, "generate", "--model", "/nonexistent", "--prompt", "x", "--dtype", "int3"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "invalid choice" in result.stderr
    result = subprocess.run(
        [*CLI, "generate", "--model", str(tmp_path), "--prompt", "x", "--block-size", "0"],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "block_size" in result.stderr
    result = subprocess.run(
        [*CLI, "generate", "--model", str(tmp_path / "missing"), "--prompt", "x"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "has no config.json" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    from tidegate.cli import build_parser
    from tidegate.engine.config import EngineArgs, ServerArgs
    from tidegate.engine.entrypoints.args import engine_args_from, load_config_file

    config = tmp_path / "engine.yaml"
    config.write_text(
        "model: /models/x\nmax-num-seqs: 7\nenable-prefix-caching: false\n"
        "served-model-name: [a, b]\nlong-prefill-token-threshold: auto\nport: 9000\n"
    )
    values = load_config_file(str(config), [EngineArgs, ServerArgs])
    ns = build_parser(values).parse_args(["serve", "--config", str(config), "--port", "9100"])
    engine = engine_args_from(ns)
    server = engine_args_from(ns, ServerArgs)
    assert engine.model == "/models/x"  # a required flag may come from the file
    assert engine.max_num_seqs == 7
    assert engine.enable_prefix_caching is False
    assert engine.long_prefill_token_threshold == "auto"
    assert server.served_model_name == ["a", "b"]
    assert server.port == 9100  # the command line wins over the file


def test_serve_config_file_with_an_unknown_flag_is_refused(tmp_path):
    config = tmp_path / "engine.yaml"
    config.write_text("model: /m\nmax-num-sequences: 7\n")
    result = subprocess.run(
        [*CLI, "serve", "--config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert "names unknown flags: max-num-sequences" in result.stderr


def test_engine_shapes_this_build_cannot_run_are_refused_before_anything_starts(tmp_path):
    from tidegate.cli import main

    for flag, value in [("--data-parallel-size-local", "2"), ("--kv-role", "producer")]:
        try:
            code = main(["generate", "--model", str(tmp_path), "--prompt", "x", flag, value])
        except SystemExit as exit:  # pragma: no cover - argparse errors
            code = exit.code
        assert code == 2


def test_every_subcommand_has_working_help():
    from tidegate.cli import build_parser

    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for name, sub in subcommands.items():
        assert sub.format_help(), name  # formatting raises on a stray % in a help text


def test_the_rollout_track_and_weight_come_from_the_command_line_or_a_config_file(tmp_path):
    from tidegate.cli import build_parser
    from tidegate.engine.config import DEFAULT_CANARY_WEIGHT, EngineArgs, ServerArgs
    from tidegate.engine.entrypoints.args import engine_args_from, load_config_file

    def serve(argv: list[str], config: str | None = None) -> EngineArgs:
        values = {}
        if config is not None:
            (tmp_path / "engine.yaml").write_text(config)
            values = load_config_file(str(tmp_path / "engine.yaml"), [EngineArgs, ServerArgs])
            argv = ["--config", str(tmp_path / "engine.yaml"), *argv]
        return engine_args_from(build_parser(values).parse_args(["serve", "--model", "/m", *argv]))

    plain = serve([])
    assert (plain.track, plain.traffic_weight, plain.canary_weight) == ("stable", None, None)
    flagged = serve(["--track", "canary", "--traffic-weight", "0.3"])
    assert (flagged.track, flagged.traffic_weight, flagged.canary_weight) == ("canary", 0.3, 0.3)
    filed = serve([], "track: canary\ntraffic-weight: 0.05\n")
    assert (filed.track, filed.canary_weight) == ("canary", 0.05)
    # A canary without a weight takes the default, and says so in --help.
    assert serve(["--track", "canary"]).canary_weight == DEFAULT_CANARY_WEIGHT == 0.1
    assert "Default for a canary: 0.1" in EngineArgs.model_fields["traffic_weight"].description
    # The command line wins over the file.
    assert (
        serve(["--traffic-weight", "0.2"], "track: canary\ntraffic-weight: 0.05\n").canary_weight
        == 0.2
    )


def test_a_weight_without_a_canary_or_outside_zero_to_one_is_refused(tmp_path):
    from tidegate.cli import build_parser
    from tidegate.engine.config import EngineArgs
    from tidegate.engine.entrypoints.args import engine_args_from

    def refusal(*flags: str) -> str:
        ns = build_parser().parse_args(["serve", "--model", "/m", *flags])
        with pytest.raises(SystemExit) as refused:
            engine_args_from(ns)
        return str(refused.value)

    assert "track 'stable' takes no weight" in refusal("--traffic-weight", "0.2")
    assert "track 'stable' takes no weight" in refusal(
        "--track", "stable", "--traffic-weight", "0.2"
    )
    for weight, message in [
        ("0", "greater than 0"),
        ("-0.1", "greater than 0"),
        ("1", "less than 1"),
        ("1.5", "less than 1"),
        ("nan", "finite number"),
        ("inf", "finite number"),
    ]:
        text = refusal("--track", "canary", "--traffic-weight", weight)
        assert "traffic_weight" in text and message in text, (weight, text)
    with pytest.raises(SystemExit):  # argparse: not a track
        build_parser().parse_args(["serve", "--model", "/m", "--track", "beta"])
    # Offline and in a config file alike: the same model refuses the same values.
    with pytest.raises(ValueError, match="track 'stable' takes no weight"):
        EngineArgs(model="/m", traffic_weight=0.5)
    canary = EngineArgs(model="/m", track="canary", traffic_weight=0.5)
    with pytest.raises(ValueError, match="takes no weight"):
        canary.track = "stable"


def test_the_chunk_slack_and_step_target_come_from_the_command_line_with_auto_chunks_only():
    from tidegate.cli import build_parser
    from tidegate.engine.entrypoints.args import engine_args_from

    def serve(*flags: str):
        return engine_args_from(build_parser().parse_args(["serve", "--model", "/m", *flags]))

    # Every flag reaches the model with its default: the plain command must still validate.
    assert serve().long_prefill_step_slack is None  # auto then takes 0.25
    auto = ("--long-prefill-token-threshold", "auto")
    assert serve(*auto, "--long-prefill-step-slack", "0.5").long_prefill_step_slack == 0.5
    for threshold in ([], ["--long-prefill-token-threshold", "512"]):
        # Without auto the flag is refused, even at the value auto would take.
        for value in ("0.5", "0.25"):
            with pytest.raises(
                SystemExit, match="sizes the chunks of long_prefill_token_threshold"
            ):
                serve(*threshold, "--long-prefill-step-slack", value)
    for value in ("0", "-1", "nan", "inf", "11"):
        with pytest.raises(SystemExit, match="long_prefill_step_slack"):
            serve(*auto, "--long-prefill-step-slack", value)
    # The step target likewise.
    assert serve().long_prefill_step_ms is None
    assert serve(*auto, "--long-prefill-step-ms", "50").long_prefill_step_ms == 50.0
    with pytest.raises(SystemExit, match="long_prefill_step_ms sizes the chunks"):
        serve("--long-prefill-step-ms", "50")
    for value in ("0", "nan", "inf"):
        with pytest.raises(SystemExit, match="long_prefill_step_ms"):
            serve(*auto, "--long-prefill-step-ms", value)


def test_serve_takes_the_model_as_vllm_serve_does():
    from tidegate.cli import build_parser
    from tidegate.engine.entrypoints.args import engine_args_from
    from tidegate.engine.entrypoints.cli import take_model_tag

    def model(*argv: str, config: str | None = None) -> str:
        values = {"model": config} if config else None
        ns = build_parser(values, only=["serve"]).parse_args(["serve", *argv])
        take_model_tag(ns)
        return engine_args_from(ns).model

    assert model("/m") == "/m"
    assert model("/m", "--port", "9000") == model("--port", "9000", "/m") == "/m"
    assert model("--model", "/m") == model("/m", "--model", "/m") == "/m"
    assert model("/m", config="/m") == model(config="/m") == "/m"
    for argv, config in ((["/m", "--model", "/other"], None), (["/m"], "/other")):
        with pytest.raises(SystemExit, match="the model is given twice, as '/m'"):
            model(*argv, config=config)
    # Without either, serve says how to name it.
    result = subprocess.run(
        [*CLI, "serve", "--port", "9000"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert "tidegate serve MODEL, or --model MODEL" in result.stderr

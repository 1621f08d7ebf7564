"""The tidegate command, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys

CLI = [sys.executable, "-m", "tidegate.engine.entrypoints.cli"]


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

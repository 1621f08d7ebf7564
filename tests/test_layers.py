"""The import contracts in .importlinter hold, and they would catch a wrong-way import.

`make test` also runs `lint-imports`; these tests run the same contracts in-process, show
that an import added against the layers breaks them, and check at run time what the
`tidegate` command's subcommands load.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from importlinter.application import use_cases
from importlinter.application.app_config import settings
from importlinter.configuration import configure

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / ".importlinter")

configure()
# What `lint-imports` does before it reads the contracts (the built-in contract types).
use_cases._register_built_in_contract_types()


def _report(extra_imports: tuple[tuple[str, str], ...] = ()):
    """The contracts' report on the real import graph, with extra imports added to it."""
    builder = settings.GRAPH_BUILDER

    class WithExtraImports:
        def build(self, **kwargs):
            graph = builder.build(**kwargs)
            for importer, imported in extra_imports:
                graph.add_import(
                    importer=importer, imported=imported, line_number=1, line_contents="import"
                )
            return graph

    settings.configure(GRAPH_BUILDER=WithExtraImports())
    try:
        options = use_cases.read_user_options(config_filename=CONFIG)
        return use_cases.create_report(options, cache_dir=None)
    finally:
        settings.configure(GRAPH_BUILDER=builder)


def _broken(report) -> set[str]:
    """The names of the contracts the report found broken."""
    return {
        contract.name for contract, check in report.get_contracts_and_checks() if not check.kept
    }


def test_every_contract_is_kept() -> None:
    report = _report()
    assert report.contains_failures is False, _broken(report)
    assert report.kept_count >= 6


@pytest.mark.parametrize(
    ("importer", "imported", "contract_word"),
    [
        # The wire messages reaching up into the scheduler.
        ("tidegate.engine.messages", "tidegate.engine.core.scheduler", "layers"),
        # A worker importing the engine core that drives it.
        ("tidegate.engine.worker.worker", "tidegate.engine.core.engine_core", "layers"),
        # The engine importing the operator.
        ("tidegate.engine.entrypoints.serve", "tidegate.operator.render", "operator"),
        # The operator importing torch through an engine module.
        ("tidegate.operator.render", "tidegate.engine.model.llama", "operator"),
        ("tidegate.operator.tuning", "torch", "torch"),
        # `tidegate serve` pulling in the benchmark client.
        ("tidegate.engine.entrypoints.serve", "tidegate.engine.bench.serve", "bench"),
        # The shared helpers reaching into the engine.
        ("tidegate.common.local_server", "tidegate.engine.config", "common"),
    ],
)
def test_a_wrong_way_import_breaks_a_contract(
    importer: str, imported: str, contract_word: str
) -> None:
    report = _report(((importer, imported),))
    broken = _broken(report)
    assert any(contract_word in name.lower() for name in broken), (importer, imported, broken)


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code`."""
    done = subprocess.run(
        [sys.executable, "-c", code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO.parent,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_tidegate_help_imports_no_subcommand() -> None:
    modules = _modules_after(
        "import contextlib, io\nfrom tidegate.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])"
    )
    assert not {m for m in modules if m.startswith(("tidegate.engine", "tidegate.operator"))}
    assert not modules & {"torch", "kopf", "httpx", "fastapi"}


def test_serve_loads_neither_the_operator_nor_the_bench_client() -> None:
    modules = _modules_after(
        "from tidegate.cli import build_parser\n"
        "build_parser(only=['serve']).parse_args(['serve', '--model', 'm'])\n"
        "import tidegate.engine.entrypoints.serve, tidegate.engine.entrypoints.openai.api_server"
    )
    assert "tidegate.engine.entrypoints.serve" in modules
    assert not {m for m in modules if m.startswith(("tidegate.operator", "tidegate.engine.bench"))}
    assert "kopf" not in modules


def test_the_operator_command_never_imports_torch() -> None:
    modules = _modules_after(
        "from tidegate.cli import build_parser\n"
        "build_parser(only=['operator', 'plan', 'up']).parse_args(['operator'])\n"
        "import tidegate.operator.handlers, tidegate.operator.up, tidegate.operator.plan"
    )
    assert "kopf" in modules
    assert not modules & {"torch", "triton", "transformers"}

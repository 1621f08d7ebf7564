"""Structured outputs in the engine core: grammars compiled off the step loop, one matcher per
request, and the bitmask of each step.

A constrained request waits in WAITING_FOR_GRAMMAR until its grammar is compiled (on the
manager's thread, cached by schema); then it is scheduled like any other. Its matcher follows
exactly its output tokens: each sampled token is accepted when the step's output is applied.
Preemption recomputes a request's KV but keeps its tokens, so the matcher keeps its state
(nothing in this engine drops a token once accepted). Before a step samples, `fill_bitmask`
writes which tokens each constrained row may take, and the sampler masks every other token in
one batched op. Speculative decoding walks a matcher through a request's guesses and back
(`allowed_prefix` keeps the guesses the grammar takes; `fill_guessed_rows` gives each guessed
position its row), so that between steps a matcher holds exactly the output tokens.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tidegate.engine.sampling_params import StructuredOutputsParams
from tidegate.engine.structured_output.backend import require_library

if TYPE_CHECKING:
    from tidegate.engine.structured_output import GrammarMatcher, StructuredOutputManager

logger = logging.getLogger(__name__)


class GrammarCompiler:
    """Compiles the grammars of one engine core; the library loads on the first request.

    Building a backend reads the tokenizer's whole vocabulary (about a second), so it happens
    on a thread of its own when the first constrained request arrives, never in the step loop
    and never for an engine that serves no constrained request.
    """

    def __init__(
        self,
        backend: str,
        tokenizer_folder: str | Path,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        max_cached_grammars: int = 256,
    ) -> None:
        if backend != "auto":
            # Asked for by name: refuse to start rather than refuse every constrained request.
            require_library(backend)
        self.backend_name = backend
        self.tokenizer_folder = tokenizer_folder
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.max_cached_grammars = max_cached_grammars
        self._manager: Future[StructuredOutputManager] | None = None
        self._lock = threading.Lock()
        # Called (from a compile thread) when a grammar is ready: wakes an idle loop.
        self.wakeup: Callable[[], None] | None = None

    def _build_manager(self) -> StructuredOutputManager:
        from tidegate.engine.structured_output import StructuredOutputManager, create_backend

        backend = create_backend(
            self.backend_name, self.tokenizer_folder, self.vocab_size, self.eos_token_ids
        )
        logger.info("structured outputs: %s grammars", backend.name)
        return StructuredOutputManager(backend, max_cached_grammars=self.max_cached_grammars)

    def _manager_future(self) -> Future[StructuredOutputManager]:
        with self._lock:
            if self._manager is None:
                self._manager = Future()
                threading.Thread(
                    target=_run_into,
                    args=(self._manager, self._build_manager),
                    daemon=True,
                    name="grammar-backend",
                ).start()
            return self._manager

    @property
    def manager(self) -> StructuredOutputManager:
        """The manager (blocks until the library has loaded; raises if it failed to)."""
        return self._manager_future().result()

    def compile(self, params: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar (a GrammarError when it does not compile)."""
        manager = self._manager_future()
        if manager.done() and manager.exception() is None:
            compiled = manager.result().compile_async(params)
        else:
            compiled = Future()
            manager.add_done_callback(lambda done: _chain(done, params, compiled))
        if self.wakeup is not None:
            wakeup = self.wakeup
            compiled.add_done_callback(lambda _: wakeup())
        return compiled

    def shutdown(self) -> None:
        """Stop the compile threads (a build still running is left to finish on its own)."""
        if self._manager is not None and self._manager.done() and not self._manager.exception():
            self._manager.result().shutdown()


def _run_into(future: Future, fn: Callable[[], object]) -> None:
    try:
        future.set_result(fn())
    except BaseException as error:
        future.set_exception(error)


def _chain(manager: Future, params: StructuredOutputsParams, into: Future) -> None:
    """Once the manager exists, compile with it and pass the outcome on to `into`."""
    if manager.exception() is not None:
        into.set_exception(manager.exception())
        return
    compiled = manager.result().compile_async(params)

    def copy(done: Future) -> None:
        if done.exception() is not None:
            into.set_exception(done.exception())
        else:
            into.set_result(done.result())

    compiled.add_done_callback(copy)


class RequestGrammar:
    """One request's grammar: a compile in flight, then a matcher over its output tokens."""

    def __init__(self, compiled: Future, compiler: GrammarCompiler) -> None:
        self.compiled = compiled  # done once compiled (or failed)
        self._compiler = compiler
        self.matcher: GrammarMatcher | None = None

    def poll(self) -> bool:
        """True once the matcher is ready; False while compiling; raises when it failed."""
        if self.matcher is not None:
            return True
        if not self.compiled.done():
            return False
        compiled = self.compiled.result()  # raises the compile's error
        self.matcher = self._compiler.manager.new_matcher(compiled)
        return True

    def accept(self, token_id: int) -> bool:
        """Advance over one sampled token; False if the grammar forbids it."""
        assert self.matcher is not None
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """True when the output is complete and the grammar can take nothing more."""
        return self.matcher is not None and self.matcher.is_terminated()


def build_bitmask(compiler: GrammarCompiler, grammars: list[RequestGrammar | None]) -> bytes:
    """Each row's allowed next tokens, as GrammarBitmask.bitmask bytes (None: every token)."""
    return bitmask_array(compiler, grammars).tobytes()


def allowed_prefix(grammar: RequestGrammar, token_ids: list[int]) -> int:
    """How many of token_ids, from the first, the grammar takes after the output so far (the
    matcher goes through them and back)."""
    assert grammar.matcher is not None
    taken = 0
    for token_id in token_ids:
        if not grammar.matcher.accept_token(token_id):
            break
        taken += 1
    grammar.matcher.rollback(taken)
    return taken


def fill_guessed_rows(
    bitmask: np.ndarray, rows: list[int], grammar: RequestGrammar, guesses: list[int]
) -> None:
    """Speculative decoding: row rows[j] of `bitmask` gets what may follow the output and the
    first j + 1 guesses (which the grammar took when they were scheduled)."""
    matcher = grammar.matcher
    assert matcher is not None
    taken = 0
    try:
        for row, guess in zip(rows, guesses, strict=True):
            if not matcher.accept_token(guess):
                raise RuntimeError(f"guess {guess} no longer fits its grammar")
            taken += 1
            matcher.fill_bitmask(bitmask, row)
    finally:
        matcher.rollback(taken)


def bitmask_array(compiler: GrammarCompiler, grammars: list[RequestGrammar | None]) -> np.ndarray:
    """build_bitmask's rows as int32 words [rows, words]."""
    manager = compiler.manager
    bitmask = manager.allocate_bitmask(len(grammars))  # every token allowed until filled
    live = [i for i, g in enumerate(grammars) if g is not None]
    if len(live) == len(grammars):
        manager.fill_bitmasks([g.matcher for g in grammars], bitmask)
    elif live:
        rows = manager.allocate_bitmask(len(live))
        manager.fill_bitmasks([grammars[i].matcher for i in live], rows)
        bitmask[live] = rows
    return bitmask

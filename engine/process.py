"""How every Tidegate process behaves: a name operators can see, and no orphans."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading

import setproctitle

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(processName)s %(levelname)s %(name)s: %(message)s"


def name_process(title: str) -> None:
    """Show `title` in ps (cmdline), top (comm) and in log lines."""
    setproctitle.setproctitle(title)
    multiprocessing.current_process().name = title


def become_child_process(title: str) -> None:
    """Set up a spawned engine process: named, logging, deaf to Ctrl-C, dies with its parent.

    Ctrl-C in a terminal signals the whole process group; only the API server acts on it
    and stops its children in order. SIGTERM ends a child at once (its parent sends it
    only when the orderly shutdown did not finish).
    """
    name_process(title)
    logging.basicConfig(level=os.environ.get("TIDEGATE_LOG_LEVEL", "INFO"), format=LOG_FORMAT)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(
            target=_exit_when_gone, args=(parent.sentinel, title), name="parent-watch", daemon=True
        ).start()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _exit_when_gone(sentinel: int, title: str) -> None:
    """Block until the parent process is gone, then leave at once (no orphaned workers)."""
    multiprocessing.connection.wait([sentinel])
    logger.error("%s: parent process died; exiting", title)
    os._exit(1)

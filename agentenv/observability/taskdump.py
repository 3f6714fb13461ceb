"""What a running process is waiting on: SIGUSR1 logs every asyncio task and where it is suspended.

A thread profiler (py-spy) shows an asyncio server idle in its selector however many calls hang;
the answer is in the tasks. `kill -USR1 <pid>` of `agentenv serve` or any cluster role writes one
log record per task (its name and stack), then goes on serving (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import io
import logging

log = logging.getLogger("agentenv.tasks")

MAX_FRAMES = 12


def dump_tasks(loop: asyncio.AbstractEventLoop | None = None) -> int:
    """Log every pending task of `loop` (the running one by default); returns how many."""
    tasks = sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name())
    log.warning("SIGUSR1: %d asyncio task(s)", len(tasks))
    for task in tasks:
        out = io.StringIO()
        task.print_stack(limit=MAX_FRAMES, file=out)
        log.warning("task %s:\n%s", task.get_name(), out.getvalue().rstrip())
    return len(tasks)


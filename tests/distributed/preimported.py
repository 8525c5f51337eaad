"""A server that has imported the worker once and forks a ``python -m tests.distributed.worker`` per launch.

A new interpreter per launch spends about 3 s of one core importing torch, Lightning and this package before it
forks its ranks (through :mod:`lightning_bfpp.measure.launcher`), while the other core idles; the suite
launches dozens of times. ``python -m tests.distributed.preimported`` (started by the harness, once per test
session, with the environment every launch gets) imports the worker, then reads one request per line on stdin:
a JSON object with the worker's arguments, the launch's environment and its output files. For each it forks a
child, answers the child's pid, waits for it and answers its exit status.

The child takes the launch's environment, working folder and output files, starts a session of its own (so a
hang is killed with every rank it forks) and leaves the server's loop to run the worker's ``main`` at the top
level of this module: an exception then ends it as it ends ``python -m tests.distributed.worker``, through the
interpreter's own traceback and exit, whose pace the failure tests observe (a failed rank's peers read the
watchdog's message before its connections close). The server only imports, forks and waits; a launch starts
from the state a fresh worker has after its imports.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys

from tests.distributed import worker


def serve() -> dict | None:
    """Answer requests until stdin closes (returns None), or, in a forked child, return its request."""
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return request
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()
        _, status = os.waitpid(pid, 0)
        sys.stdout.write(f"{os.waitstatus_to_exitcode(status)}\n")
        sys.stdout.flush()
    return None


def become_worker(request: dict) -> None:
    """In a forked child: the process ``python -m tests.distributed.worker ARGS`` would be after its imports."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    # every local rank forked from this process inherits the lock and holds it until it exits: the harness
    # waits for the last (a pipe's reader waits for every writer the same way)
    alive = os.open(request["alive"], os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(alive, fcntl.LOCK_SH)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = [worker.__file__, *request["args"]]


if __name__ == "__main__":
    request = serve()
    if request is not None:
        become_worker(request)
        worker.main()

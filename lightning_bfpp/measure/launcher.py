"""Start a job's ranks as processes on this machine and watch them: the one launcher of the calibration, the
benchmarks and the tests.

Each rank gets the environment Lightning's own launcher gives the processes it starts (``MASTER_ADDR``,
``MASTER_PORT``, ``NODE_RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``), so Lightning sees processes created outside it,
as under torchrun, and a hand-written job reads its rank from the same variables. The ranks start either

- ``"fork"``: forked from this process, which has imported what they need already (torch, Lightning and this
  package cost about 3-7 s of one core per interpreter; a 4-process job on 2 cores pays it four times). The
  caller must not have run tensor operations or process groups yet: their thread pools do not survive a fork.
- ``"spawn"``: each a new interpreter, ``python -m lightning_bfpp.measure.launcher`` running ``module:function``;
  for a caller that has used torch already (``plan calibrate``, a measurement inside a training process).

``torch.multiprocessing.spawn`` and torchrun start processes too, but neither gives what a measurement and a
test need together: a failed rank stops the others after a short grace (one left waiting in a collective
otherwise waits for its timeout), a hang is ended with every rank's Python stacks written first, a rank that dies
in native code leaves its threads' stacks (``faulthandler``), and the caller gets each rank's exit and log. This
module imports nothing of the package.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import importlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

# a hung rank writes its threads' stacks on this signal (Lightning takes SIGUSR1 for SLURM's requeue)
STACK_DUMP_SIGNAL = signal.SIGUSR2
STACK_DUMP_WAIT_S = 3.0
# each rank's reports, in the launch's folder: <prefix>node<N>.rank<R>.txt
STACKS_PREFIX = "stacks."
CRASH_PREFIX = "crash."
GRACE_AFTER_FAILURE_S = 5.0
POLL_S = 0.05
# what an outer launcher (torchrun) set for the caller: a rank keeping them would take the caller's place
OUTER_LAUNCHER_VARIABLES = ("RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME",
                            "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                            "TORCHELASTIC_MAX_RESTARTS")  # fmt: skip


@dataclass(frozen=True)
class LaunchResult:
    """How a launch ended: each rank's exit code (negative: the signal that ended it, ``-9`` where the launcher
    killed it) and, where it failed, why (``""`` when every rank exited with 0)."""

    exitcodes: tuple[int, ...]
    reason: str
    failed_rank: int | None  # the first to fail on its own (not killed by the launcher)
    folder: Path
    per_rank_logs: bool

    @property
    def ok(self) -> bool:
        return not self.reason

    def log(self, rank: int) -> str:
        """What ``rank`` printed (empty where the ranks wrote to the caller's streams)."""
        path = self.folder / f"rank{rank}.log"
        return path.read_text(errors="replace") if self.per_rank_logs and path.exists() else ""

    def report(self, lines: int = 40) -> str:
        """Why it failed, for an error message: the reason, the first failed rank's last log lines, and every
        rank's native crash report and hang stacks."""
        parts = [self.reason]
        if self.failed_rank is not None and (text := self.log(self.failed_rank).strip()):
            tail = "\n".join(text.splitlines()[-lines:])
            parts.append(f"--- rank {self.failed_rank}'s last lines ---\n{tail}")
        return "\n".join([*parts, *rank_reports(self.folder)])


def rank_reports(folder: Path) -> list[str]:
    """Every rank's native crash report and hang stacks written in ``folder`` (those with content)."""
    reports = []
    for prefix in (CRASH_PREFIX, STACKS_PREFIX):
        for path in sorted(folder.glob(f"{prefix}*.txt")):
            if text := path.read_text(errors="replace").strip():
                reports.append(f"--- {path.name[: -len('.txt')]} ---\n{text}")
    return reports


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    target: Callable[..., Any] | str,
    nprocs: int,
    folder: Path,
    *,
    args: Sequence[Any] = (),
    start: Literal["fork", "spawn"] = "fork",
    timeout_s: float | None = None,
    grace_after_failure_s: float = GRACE_AFTER_FAILURE_S,
    threads: int | None = 1,
    env: Mapping[str, str] | None = None,
    per_rank_logs: bool = True,
    unwind_on_failure: bool = False,
) -> LaunchResult:
    """Run ``target(rank, *args)`` in ``nprocs`` processes and wait for all of them.

    ``target`` is a function, or ``"module:function"`` (required with ``start="spawn"``, whose ``args`` travel as
    JSON). A rank that returns exits with 0 at once, without the interpreter's teardown. A spawned rank that
    raises exits as its interpreter does (traceback, exit handlers, finalization; status 1); a forked one prints
    its traceback, runs its exit handlers and exits with 1, or, with ``unwind_on_failure``, lets the exception
    unwind out of this call in its own process, for a caller at the top of its program (a worker's ``main``)
    whose failing ranks must leave at an interpreter's pace: a peer reads the failure watchdog's report during
    those seconds, as it does under torchrun. ``threads`` sets each rank's intra-op threads
    (``OMP_NUM_THREADS``, as torchrun sets 1); ``None`` leaves them to the environment.
    ``per_rank_logs`` sends each rank's output to ``folder/rank<R>.log``; otherwise the ranks write to this
    process's streams. ``env`` replaces this process's environment for the ranks (``"spawn"`` only); either way
    an outer launcher's variables (:data:`OUTER_LAUNCHER_VARIABLES`) are left out, and a spawned rank finds the
    target's package where this process found it (``PYTHONPATH``).

    After the first rank fails, the others get ``grace_after_failure_s``, then are killed; after ``timeout_s``
    every rank still running writes its stacks (:data:`STACK_DUMP_SIGNAL`) and is killed. Returns how each ended.
    """
    if start not in ("fork", "spawn"):
        raise ValueError(f"start={start!r}: use 'fork' or 'spawn'")
    if start == "spawn" and not isinstance(target, str):
        raise ValueError("a spawned rank imports its target: pass it as 'module:function'")
    if env is not None and start == "fork":
        raise ValueError("a forked rank keeps this process's environment: pass env= with start='spawn'")
    folder.mkdir(parents=True, exist_ok=True)
    for stale in (*folder.glob(f"{CRASH_PREFIX}*.txt"), *folder.glob(f"{STACKS_PREFIX}*.txt")):
        stale.unlink()
    port = free_port()
    launching = os.getpid()  # a forked rank unwinding out of here must not stop its siblings
    ranks: list[_Rank] = []
    # this process may be told to dump stacks with its ranks (a caller's process group); it has none to write
    # (only the main thread may set a handler: elsewhere the signal keeps whatever handler it had)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(STACK_DUMP_SIGNAL, signal.SIG_IGN) if main else None
    try:
        for rank in range(nprocs):
            variables = rank_environment(rank, nprocs, port, threads)
            if start == "fork":
                ranks.append(_fork(target, rank, args, folder, variables, threads, per_rank_logs, unwind_on_failure))
            else:
                ranks.append(_spawn(str(target), rank, args, folder, _spawned_environment(str(target), env, variables),
                                    per_rank_logs))  # fmt: skip
        reason, failed = _watch(ranks, timeout_s, grace_after_failure_s)
    finally:
        if os.getpid() == launching:
            for rank in ranks:
                rank.kill()
            if main:
                signal.signal(STACK_DUMP_SIGNAL, previous)
    return LaunchResult(tuple(r.exitcode() for r in ranks), reason, failed, folder, per_rank_logs)


def rank_environment(rank: int, nprocs: int, port: int, threads: int | None) -> dict[str, str]:
    """What Lightning's launcher sets for the processes it starts on one node (and torchrun's one thread)."""
    variables = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": "0", "LOCAL_RANK": str(rank),
                 "WORLD_SIZE": str(nprocs)}  # fmt: skip
    if threads is not None:
        variables["OMP_NUM_THREADS"] = str(threads)
    return variables


class RankReports:
    """This process's fault reports (see :func:`prepare_rank`), which :meth:`arm` installs, again if need be.

    Python's signal table does not know faulthandler's handlers: it reads ``SIG_DFL`` for a crash signal, and
    whoever puts "every handler back" from that table (Lightning's ``Trainer`` does, for every signal, when it
    tears down) leaves the default in their place; and ``faulthandler.enable`` does not install its handlers
    again while it believes them installed (in a process forked from one where that happened, say). Arming
    therefore takes them down first.
    """

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        name = f"node{os.environ.get('NODE_RANK', '0')}.rank{os.environ.get('LOCAL_RANK', '0')}.txt"
        self.stacks = (folder / f"{STACKS_PREFIX}{name}").open("w")
        self.crash = (folder / f"{CRASH_PREFIX}{name}").open("w")
        self.arm()

    def arm(self) -> None:
        faulthandler.disable()
        faulthandler.enable(file=self.crash, all_threads=True)
        faulthandler.unregister(STACK_DUMP_SIGNAL)
        faulthandler.register(STACK_DUMP_SIGNAL, file=self.stacks, all_threads=True)


_reports: RankReports | None = None  # this process's, once prepare_rank ran


def prepare_rank(folder: Path) -> RankReports:
    """Have this process, a rank started by any launcher (this one, torchrun, Lightning's), write its threads'
    stacks to ``folder`` on :data:`STACK_DUMP_SIGNAL` and on a native crash (SIGSEGV, SIGABRT, ...), one file per
    rank (the ranks' dumps to one stream interleave character by character), and print whole lines (ranks that
    raise together interleaved inside lines). After a ``Trainer`` ends, :func:`rearm_reports`."""
    global _reports
    _reports = RankReports(folder)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True, write_through=False)  # type: ignore[union-attr]
    return _reports


def rearm_reports() -> None:
    """Install this rank's fault reports again: a Lightning ``Trainer`` that ended put the default handlers in
    their place (:class:`RankReports`). Nothing where :func:`prepare_rank` did not run."""
    if _reports is not None:
        _reports.arm()


class _Rank:
    """One started rank: a forked child (``pid``) or a spawned interpreter (``popen``)."""

    def __init__(self, pid: int | None = None, popen: subprocess.Popen | None = None) -> None:
        self.pid = pid if popen is None else popen.pid
        self.popen = popen
        self._code: int | None = None

    def poll(self) -> int | None:
        if self._code is None:
            if self.popen is not None:
                self._code = self.popen.poll()
            else:
                done, status = os.waitpid(self.pid, os.WNOHANG)
                if done:
                    self._code = os.waitstatus_to_exitcode(status)
        return self._code

    def signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)  # type: ignore[arg-type]

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait()
        elif self._code is None:
            _, status = os.waitpid(self.pid, 0)  # type: ignore[arg-type]
            self._code = os.waitstatus_to_exitcode(status)

    def exitcode(self) -> int:
        code = self.poll()
        return -signal.SIGKILL if code is None else code


def _watch(ranks: list[_Rank], timeout_s: float | None, grace_s: float) -> tuple[str, int | None]:
    """Wait for every rank; why the launch failed ("" if it did not), and the first rank that failed."""
    deadline = float("inf") if timeout_s is None else time.monotonic() + timeout_s
    reason, first = "", None
    while any(r.poll() is None for r in ranks):
        if first is None and (failed := [i for i, r in enumerate(ranks) if r.poll() not in (None, 0)]):
            first = failed[0]
            reason = f"rank {first} exited with {ranks[first].poll()}"
            deadline = min(deadline, time.monotonic() + grace_s)
        if time.monotonic() > deadline:
            if not reason:
                reason = f"timed out after {timeout_s:g} s (a hang)"
                for r in ranks:
                    r.signal(STACK_DUMP_SIGNAL)
                time.sleep(STACK_DUMP_WAIT_S)
            for r in ranks:
                r.kill()
            break
        time.sleep(POLL_S)
    if not reason and (failed := [i for i, r in enumerate(ranks) if r.poll() != 0]):
        first = failed[0]
        reason = f"rank {first} exited with {ranks[first].poll()}"
    return reason, first


def _fork(
    target: Callable[..., Any] | str,
    rank: int,
    args: Sequence[Any],
    folder: Path,
    variables: dict[str, str],
    threads: int | None,
    per_rank_logs: bool,
    unwind: bool,
) -> _Rank:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return _Rank(pid=pid)
    try:  # the child returns into the caller's code only by unwinding the target's exception
        for name in OUTER_LAUNCHER_VARIABLES:
            os.environ.pop(name, None)
        os.environ.update(variables)
        if threads is not None and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(threads)
        _run_rank(target, rank, args, folder, per_rank_logs, unwind)
    except BaseException:
        if unwind:
            raise
        traceback.print_exc()
    os._exit(70)  # only reached if _run_rank itself broke


def _spawned_environment(target: str, env: Mapping[str, str] | None, variables: dict[str, str]) -> dict[str, str]:
    """``env`` (or this process's) without an outer launcher's variables, with the rank's, and with the folder this
    process imports ``target``'s top package from first on ``PYTHONPATH``."""
    spawned = {k: v for k, v in (os.environ if env is None else env).items() if k not in OUTER_LAUNCHER_VARIABLES}
    spec = importlib.util.find_spec(target.partition(":")[0].split(".")[0])
    if spec is not None and spec.origin is not None:
        root = Path(spec.origin).parent
        root = root.parent if spec.submodule_search_locations else root  # a package: the folder holding it
        spawned["PYTHONPATH"] = os.pathsep.join(filter(None, (str(root), spawned.get("PYTHONPATH"))))
    return {**spawned, **variables}


def _spawn(
    target: str, rank: int, args: Sequence[Any], folder: Path, env: dict[str, str], per_rank_logs: bool
) -> _Rank:
    cmd = [sys.executable, "-m", __name__, target, json.dumps(list(args)), str(rank), str(folder),
           "1" if per_rank_logs else "0"]  # fmt: skip
    return _Rank(popen=subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))


def _run_rank(
    target: Callable[..., Any] | str, rank: int, args: Sequence[Any], folder: Path, per_rank_logs: bool, unwind: bool
) -> None:
    """In the rank's process: its output, its reports, then ``target``; never returns, but by raising the target's
    exception where ``unwind``."""
    if per_rank_logs:
        log = os.open(folder / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        # the streams may be a caller's (pytest's capture, say) rather than the descriptors: write to the log
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    prepare_rank(folder)
    try:
        (_resolve(target) if isinstance(target, str) else target)(rank, *args)
    except BaseException:
        if unwind:
            raise
        traceback.print_exc()
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()  # what an interpreter runs on the way out: the failure watchdog's release
        _flush()
        os._exit(1)
    _flush()
    os._exit(0)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _resolve(name: str) -> Callable[..., Any]:
    module, _, qualified = name.partition(":")
    if not qualified:
        raise ValueError(f"{name!r}: name the target as 'module:function'")
    return functools.reduce(getattr, qualified.split("."), importlib.import_module(module))


if __name__ == "__main__":  # a spawned rank: TARGET ARGS_JSON RANK FOLDER PER_RANK_LOGS
    _target, _args, _rank, _folder, _logs = sys.argv[1:6]
    _run_rank(_target, int(_rank), json.loads(_args), Path(_folder), _logs == "1", unwind=True)

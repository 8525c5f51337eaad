"""Stop every process soon after one fails, saying which rank failed and why.

Errors that every rank can see coming are agreed on and raised everywhere (:mod:`lightning_bfpp.engine.agreement`).
What remains are failures at points where ranks do not meet: an exception inside the schedule (a layer's
forward or backward on one stage), a process killed outright (SIGKILL, the out-of-memory killer, a lost
node). The other ranks then sit in a point-to-point transfer or a collective that will never complete;
gloo gives up only when a socket closes or the process-group timeout (30 minutes by default) expires, NCCL
only at its timeout. Launchers help unevenly: torchrun and Lightning's own launcher kill the rest when a
process exits with an error, an ``srun`` without ``--kill-on-bad-exit`` does not, and none says why.

:class:`FailureWatchdog` is a daemon thread per process on the process group's own key-value store:

- a process that raises reports it (``BFPPStrategy.on_exception``); every other process sees the report
  within ``interval`` seconds, prints it and exits with status 1;
- each process refreshes a heartbeat key every ``interval`` and watches its ring neighbour's; one that stopped
  for ``timeout`` seconds is reported as dead, so a killed process is noticed within ``timeout + interval``.
  One that is still there after it had beaten (hung, or stopped with SIGSTOP) is killed (SIGKILL) by its
  watcher when both run on the same host: a launcher's SIGTERM does not end a stopped process (torchrun waits
  30 s before its SIGKILL, and only then restarts the group), and a hung process would keep its accelerator's
  memory. One never seen beating may only be slow to start, and is not killed;
- losing the store itself (its host process died) is a failure too.

Per interval each process makes one write and two reads on the store, so its load grows linearly with the
number of processes. The thread uses no process group and holds the GIL only briefly; a main thread that
holds the GIL (pure Python) for longer than ``timeout`` looks dead, so keep ``timeout`` well above any such
stretch, or pass ``failure_timeout=None`` to rely on reports only.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import threading
import time

import torch.distributed as dist

_FAILED = "failed"
_STARTED = 0  # watchdogs started by this process: each gets its own namespace on the store
_STORE_LOSS_GRACE = 5.0  # seconds
_RELEASE_AT_EXIT = False  # release_groups_at_exit registered in this process
_FAILED_HERE = False  # this process reported a failure of its own


class FailureWatchdog:
    """See the module docstring. ``start()`` after the process group exists, ``stop()`` at teardown."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        *,
        namespace: str,
        timeout: float | None = 30.0,
        interval: float = 1.0,
        own_failure_grace: float = 60.0,
    ) -> None:
        self.store = dist.PrefixStore(f"bfpp-watchdog/{namespace}/", store)
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.interval = interval
        self.own_failure_grace = own_failure_grace
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported = False

    def start(self) -> None:
        self.store.set(self._process_key(self.rank), f"{socket.gethostname()} {os.getpid()}")
        self.store.set(self._alive_key(self.rank), "0")
        self._thread = threading.Thread(target=self._run, name="bfpp-failure-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval + 1)
        self._thread = None

    def report(self, message: str) -> None:
        """Tell every process that this one failed with ``message`` (the first report wins)."""
        global _FAILED_HERE
        self._reported = _FAILED_HERE = True
        try:
            if not self.store.check([_FAILED]):
                self.store.set(_FAILED, f"rank {self.rank} failed: {message}")
        except Exception:  # the store is gone: the others notice that by themselves
            pass

    # -- the thread --------------------------------------------------------------------------------

    def _alive_key(self, rank: int) -> str:
        return f"alive/{rank}"

    def _process_key(self, rank: int) -> str:
        return f"process/{rank}"

    def _kill_if_here(self, rank: int) -> str:
        """SIGKILL ``rank``'s process if it runs on this host (it stopped responding); what was done, for the
        message."""
        try:
            host, pid = self.store.get(self._process_key(rank)).decode().split()
            if host != socket.gethostname():
                return ""
            os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):  # gone already, or no such key
            return ""
        return f"; killed it (process {pid} on this host)"

    def _run(self) -> None:
        beat = 0
        neighbour = (self.rank + 1) % self.world_size
        last_value: bytes | None = None
        last_change = time.monotonic()
        while not self._stopped.wait(self.interval):
            try:
                beat += 1
                self.store.set(self._alive_key(self.rank), str(beat))
                if self.store.check([_FAILED]):
                    self._stop(self.store.get(_FAILED).decode())
                    return
                if self.timeout is None or neighbour == self.rank:
                    continue
                now = time.monotonic()
                key = self._alive_key(neighbour)
                value = self.store.get(key) if self.store.check([key]) else None
                if value != last_value:
                    last_value, last_change = value, now
                elif now - last_change > self.timeout:
                    message = (
                        f"rank {neighbour} failed: it stopped responding (no heartbeat for {self.timeout:.0f} s;"
                        " killed, out of memory, hung, or its node was lost)"
                    ) + (self._kill_if_here(neighbour) if last_value is not None else "")  # it had started
                    if not self.store.check([_FAILED]):
                        self.store.set(_FAILED, message)
                    self._stop(message)
                    return
            except Exception as error:
                # at the very end of a run the store's host may exit while this process is still tearing down
                if self._stopped.wait(_STORE_LOSS_GRACE):
                    return
                self._stop(
                    f"the process group's store stopped answering ({type(error).__name__}: {error}); the process"
                    " hosting it (global rank 0 or the launcher) has most likely died"
                )
                return

    def _stop(self, message: str) -> None:
        if self._stopped.is_set():
            return
        # a process that raised is on its way out with its own traceback; only make sure it gets there
        if self._reported and self._stopped.wait(self.own_failure_grace):
            return
        sys.stderr.write(f"[rank {self.rank}] BFPPStrategy: stopping this process because {message}\n")
        sys.stderr.flush()
        os._exit(1)


def start_watchdog(rank: int, world_size: int, timeout: float | None) -> FailureWatchdog | None:
    """A started watchdog on the default process group's store; None for one process or without a group.

    Every process sets its strategies up in the same order, so the n-th watchdog of each process shares the
    n-th namespace with the others' and a later Trainer's watchdog never reads an earlier one's keys."""
    global _STARTED
    if world_size == 1 or not dist.is_initialized():
        return None
    from lightning_bfpp.engine._compat import default_store

    _STARTED += 1
    watchdog = FailureWatchdog(default_store(), rank, world_size, namespace=str(_STARTED), timeout=timeout)
    watchdog.start()
    return watchdog


def release_groups_at_exit() -> None:
    """Destroy the process groups when the interpreter exits, while it is still whole (once per process).

    Lightning does this for NCCL only. With gloo, a process that exits with its groups alive can abort in the
    interpreter's finalization (``terminate called without an active exception``, exit status -6, after a run
    that finished normally): gloo's threads still hold work objects whose tensors need the GIL (torch issue
    190489). Seen once in this suite, on ``examples/cli.py``; a 4-process gloo script that exits without
    destroying its group aborted once in 30 runs here. A process that reported its own failure skips it: its
    groups may hold transfers that only its peers' exit ends, and the failure must not wait for them.
    """
    global _RELEASE_AT_EXIT
    if not _RELEASE_AT_EXIT:
        atexit.register(_release_groups)
        _RELEASE_AT_EXIT = True


def _release_groups() -> None:
    if dist.is_initialized() and not _FAILED_HERE:
        dist.destroy_process_group()

"""Launch pipelined runs as real processes and load what they recorded."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_bfpp.measure.launcher import CRASH_PREFIX, STACK_DUMP_SIGNAL, STACK_DUMP_WAIT_S, STACKS_PREFIX
from tests.models import RunSpec

REPO = Path(__file__).resolve().parents[2]


@dataclass
class RunResult:
    ranks: list[dict[str, Any]]
    params: dict[str, torch.Tensor]
    optimizer_state: dict[str, torch.Tensor]

    def steps(self, rank: int) -> list[dict[str, Any]]:
        return self.ranks[rank]["steps"]


PIPELINE_2x2 = {"pipeline_parallel_size": 2, "stages_per_rank": 2, "num_microbatches": 4}


def run_2x2(name: str, *, strategy=None, model=None, trainer=None, checks=(), **kwargs) -> RunSpec:
    """A run on 4 processes as (p, dp, v, m) = (2, 2, 2, 4), SGD, 8 samples per replica and step."""
    return RunSpec(
        name=name,
        strategy={**PIPELINE_2x2, **(strategy or {})},
        model={"optimizer": "sgd", **(model or {})},
        trainer=trainer or {},
        local_batch_size=8,
        data_parallel_size=2,
        checks=list(checks),
        **kwargs,
    )


def run_worker(
    runs: list[RunSpec], devices: int, workdir: Path, timeout: float, unset: Sequence[str] = ()
) -> subprocess.CompletedProcess:
    """Run ``runs`` one after another in ``devices`` CPU processes; a timeout is reported as a hang.

    The processes get ``OMP_NUM_THREADS=1`` unless ``unset`` names it (then the strategy picks their threads).
    They start from :class:`PreImported`'s server, which has imported the worker already; a launch that unsets
    a variable starts a new interpreter (what a process reads from its environment at import stays its own).
    """
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps({"devices": devices, "runs": [r.to_json() for r in runs]}))
    env = _launch_env(unset)
    args = [str(spec_path), str(workdir / "out")]
    cmd = [sys.executable, "-m", "tests.distributed.worker", *args]
    if not unset:
        return PreImported.run(args, env, workdir, timeout, cmd)
    try:
        # a new session, so a hang can be killed with every process Lightning launched
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_hung(proc.pid)
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"pipelined run timed out after {timeout}s (a hang):\n{_hang_report(stderr, workdir / 'out')}"
        ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _launch_env(unset: Sequence[str] = ()) -> dict[str, str]:
    """The environment a launch's processes get (also the pre-imported server's: what torch reads at import)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for name in ("LOCAL_RANK", *unset):
        env.pop(name, None)
    return env


class PreImported:
    """Launches through :mod:`tests.distributed.preimported`'s server (one per test session, started at the
    first launch), which forks each launch from a process that imported the worker already."""

    _server: subprocess.Popen | None = None

    @classmethod
    def _start(cls) -> subprocess.Popen:
        if cls._server is None or cls._server.poll() is not None:
            cls._server = subprocess.Popen(
                [sys.executable, "-m", "tests.distributed.preimported"],
                cwd=REPO, env=_launch_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
            )  # fmt: skip
            atexit.register(cls._server.stdin.close)  # type: ignore[union-attr]
        return cls._server

    @classmethod
    def run(
        cls, args: list[str], env: dict[str, str], workdir: Path, timeout: float, cmd: list[str]
    ) -> subprocess.CompletedProcess:
        out, err, alive = (workdir / f"worker.{name}" for name in ("stdout", "stderr", "alive"))
        deadline = time.monotonic() + timeout
        server = cls._start()
        request = {
            "args": args,
            "env": env,
            "cwd": str(REPO),
            "stdout": str(out),
            "stderr": str(err),
            "alive": str(alive),
        }
        server.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
        pid_line = _read_line(server, deadline)
        if pid_line is None:
            raise AssertionError(f"the pre-imported launcher did not start a worker (exit {server.poll()})")
        pid = int(pid_line)
        status = _read_line(server, deadline)
        # the launch ends when its last rank has: those forked from the first may outlive it
        if status is None or not _wait_for_unlock(alive, deadline):
            _kill_hung(pid)
            if status is None:
                _read_line(server, time.monotonic() + 30)
            stderr = err.read_text(errors="replace") if err.exists() else ""
            raise AssertionError(
                f"pipelined run timed out after {timeout}s (a hang):\n{_hang_report(stderr, workdir / 'out')}"
            )
        stdout, stderr = (f.read_text(errors="replace") for f in (out, err))
        return subprocess.CompletedProcess(cmd, int(status), stdout, stderr)


_answers = bytearray()  # what the server wrote that no _read_line has returned yet


def _read_line(server: subprocess.Popen, deadline: float) -> str | None:
    """The server's next answer, or None if none came before ``deadline`` (or the server is gone)."""
    fd = server.stdout.fileno()  # type: ignore[union-attr]
    while b"\n" not in _answers:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 4096) if ready else b""
        if not chunk:
            return None
        _answers.extend(chunk)
    line, _, rest = bytes(_answers).partition(b"\n")
    _answers[:] = rest
    return line.decode().strip()


def _wait_for_unlock(path: Path, deadline: float) -> bool:
    """Whether every process holding ``path``'s shared lock exited (or dropped it) before ``deadline``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
    finally:
        os.close(fd)


def launch(
    runs: list[RunSpec], devices: int, workdir: Path, timeout: float = 240, unset: Sequence[str] = ()
) -> dict[str, RunResult]:
    """Run ``runs`` (see :func:`run_worker`) and load what every rank recorded; fail with the output on error.

    A launch in which a rank died in native code (:func:`_native_crash`: no Python error of its own) runs once
    more, with a warning carrying the crash report; a second failure, and any Python error, fails the test."""
    proc, again = run_worker(runs, devices, workdir, timeout, unset), ""
    if proc.returncode != 0 and (crash := _native_crash(proc.stderr, workdir / "out")) is not None:
        warnings.warn(
            f"a rank of this launch died in native code (exit {proc.returncode}); it ran again:\n{crash}\n"
            f"{_tail(proc.stderr, 20)}",
            stacklevel=2,
        )
        shutil.rmtree(workdir / "out", ignore_errors=True)
        proc, again = run_worker(runs, devices, workdir, timeout, unset), ", run again after a native crash"
    if proc.returncode != 0:
        crash = _native_crash(proc.stderr, workdir / "out") or ""
        raise AssertionError(
            f"pipelined run failed (exit {proc.returncode}{again}):\n{crash}\n{_tail(proc.stderr)}\n"
            f"--- why it failed ---\n{_why_failed(proc.stderr, workdir / 'out')}"
        )
    return load_results(runs, devices, workdir)


# what the other ranks of a launch raise when one of them is gone
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "stopped responding")
_ERROR = re.compile(r"\w(Error|Exception): ")
_WATCHDOG = "BFPPStrategy: stopping this process because"
LAUNCH_FAILED = "launch failed:"  # the worker's line saying which rank failed first, and how


def _why_failed(stderr: str | None, out: Path) -> str:
    """The lines of a failed launch that say why, for the end of its error message, where a log's tail shows them:
    the worker's line naming the first rank to fail and every rank's exit code, the first error each rank raised
    of its own (with the two lines above it, its frame), the failure watchdog's first message, and each fault
    report's signal and crashed thread. The output's own tail is mostly the survivors' errors, which say only
    that a peer left."""
    lines = (stderr or "").splitlines()
    own: dict[str, str] = {}
    for i, line in enumerate(lines):
        if _ERROR.search(line) and not _lost_peer(line):
            rank = re.match(r"\[rank\d+\]", line)
            own.setdefault(rank.group() if rank else "", "\n".join(lines[max(i - 2, 0) : i + 1]))
    parts = [line for line in lines if line.startswith(LAUNCH_FAILED)][:1]  # the first rank to fail, and how
    parts += own.values()
    parts += [line for line in lines if _WATCHDOG in line][:1]
    parts += [f"--- {rank} ---\n{_crashed_thread(text)}" for rank, text in _fault_reports(out)]
    return "\n".join(parts) if parts else "no rank said why: no error of its own, watchdog message or fault report"


def _lost_peer(line: str) -> bool:
    return any(lost in line for lost in _PEER_LOST)


def _fault_reports(out: Path) -> list[tuple[str, str]]:
    """(rank, report) of every rank whose fault handler wrote one (a native crash), in rank order."""
    return [
        (path.name[len(CRASH_PREFIX) : -len(".txt")], text)
        for path in sorted(out.glob(f"{CRASH_PREFIX}*.txt"))
        if (text := path.read_text(errors="replace").strip())
    ]


def _crashed_thread(report: str, lines: int = 12) -> str:
    """A fault report's first line (the signal) and the stack of the thread that received it."""
    text = report.splitlines()
    current = next((i for i, line in enumerate(text) if line.startswith("Current thread")), None)
    return "\n".join(text[:1] + text[current : current + lines] if current is not None else text[:lines])


def _native_crash(stderr: str | None, out: Path) -> str | None:
    """How a rank died if it died without raising: its fault handler's report or, where it wrote none, the
    survivors' errors that only say they lost a peer. None where some rank raised an error of its own."""
    reports = [f"--- {rank} ---\n{text}" for rank, text in _fault_reports(out)]
    if reports:
        return "\n".join(reports)
    errors = [line for line in (stderr or "").splitlines() if _ERROR.search(line)]
    if errors and all(_lost_peer(line) for line in errors):
        return "a rank exited without a Python error; the others lost their connection to it"
    return None


def load_results(runs: list[RunSpec], devices: int, workdir: Path) -> dict[str, RunResult]:
    """What every rank of a finished :func:`run_worker` launch recorded, per run."""
    out = workdir / "out"
    results = {}
    for run in runs:
        folder = out / run.name
        ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(devices)]
        saved: dict[str, torch.Tensor] = {}
        for path in sorted(folder.glob("params_pp*.pt")):
            saved.update(torch.load(path))
        params = {k: v for k, v in saved.items() if not k.startswith("optimizer/")}
        optimizer_state = {k[len("optimizer/") :]: v for k, v in saved.items() if k.startswith("optimizer/")}
        results[run.name] = RunResult(ranks, params, optimizer_state)
    return results


def _kill_hung(pgid: int) -> None:
    """Kill a hung launch's processes, after asking each to write its threads' stacks."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, STACK_DUMP_SIGNAL)
        time.sleep(STACK_DUMP_WAIT_S)
        os.killpg(pgid, signal.SIGKILL)


def _hung(timeout: float, stderr: str | None, workdir: Path) -> AssertionError:
    report = _hang_report(stderr, workdir / "out")
    return AssertionError(f"pipelined run timed out after {timeout}s (a hang):\n{report}")


def _hang_report(stderr: str | None, out: Path) -> str:
    """A hung launch's last output lines, then where each rank was when it was stopped."""
    dumps = [
        f"--- {path.name[len(STACKS_PREFIX) : -len('.txt')]} ---\n{text}"
        for path in sorted(out.glob(f"{STACKS_PREFIX}*.txt"))
        if (text := path.read_text(errors="replace").strip())
    ]
    return "\n".join([_tail(stderr), *dumps])


def _tail(text: str | bytes | None, lines: int = 60) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ (absolute when b is zero): one number per tensor, blind to elements that are ~0."""
    a, b = a.double(), b.double()
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff / denom if denom > 0 else diff


def assert_steps_match(
    result: RunResult, reference: Any, *, tol: float, keys: tuple[str, ...] = ("train_loss",)
) -> None:
    """Every rank logged, at every step, the reference's values of ``keys`` (relative ``tol``)."""
    for rank, rank_result in enumerate(result.ranks):
        steps = rank_result["steps"]
        assert [s["step"] for s in steps] == [s["step"] for s in reference.steps], f"rank {rank}"
        for got, want in zip(steps, reference.steps, strict=True):
            for key in keys:
                g, w = got["callback_metrics"][key], want["callback_metrics"][key]
                assert abs(g - w) <= tol * abs(w), f"rank {rank} step {want['step']} {key}: {g} vs {w}"


def assert_tested_as_reference(result: RunResult, reference: Any, *, tol: float) -> dict[str, float]:
    """Every rank's ``trainer.test`` after ``fit`` returned the reference's metrics (relative ``tol``); returns them."""
    (want,) = reference.extras["test"]
    for rank, rank_result in enumerate(result.ranks):
        (got,) = rank_result["test"]
        assert got.keys() == want.keys(), f"rank {rank}: {sorted(got)} vs {sorted(want)}"
        for key in want:
            assert abs(got[key] - want[key]) <= tol * abs(want[key]), f"rank {rank} {key}: {got[key]} vs {want[key]}"
    return want


def assert_params_match(result: RunResult, reference: Any, *, tol: float) -> float:
    """Every final parameter agrees with the reference's (relative norm error ``tol``); returns the worst."""
    assert set(result.params) == set(reference.params)
    worst = max(relative_error(result.params[k], reference.params[k]) for k in reference.params)
    assert worst <= tol, f"largest relative parameter error {worst:.2e}"
    return worst


def assert_trained_as_on_one_device(result: RunResult, run: RunSpec, *, tol: float) -> Any:
    """A pipelined run of the suite's module (``tests.models``) equals the same run on one process: every step's
    logged loss on every rank and every final parameter (relative ``tol``), and every weight moved by more than
    30 times ``tol``, so that agreeing is not trivial, but the frozen ones (``run.model["frozen"]``), which are
    exactly their initial values. Returns the one-device reference."""
    from tests.models import is_frozen, make_model, reference_run

    ref = reference_run(run)
    assert_steps_match(result, ref, tol=tol)
    assert_params_match(result, ref, tol=tol)
    initial = make_model(run).state_dict()
    frozen = tuple(run.model.get("frozen", ()))
    trained = [k for k in ref.params if k.endswith("weight") and not is_frozen(k, frozen)]
    assert min(relative_error(ref.params[k], initial[k]) for k in trained) > 30 * tol
    for k in ref.params:
        if is_frozen(k, frozen):
            assert torch.equal(result.params[k], initial[k]), f"frozen {k} changed"
    return ref


def started_from(folder: Path) -> dict[str, torch.Tensor]:
    """The full parameters a run started from, as its ranks wrote them (the worker's ``save_initial_params``)."""
    initial: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("initial_pp*.pt")):
        initial.update(torch.load(path))
    assert initial, f"no initial_pp*.pt in {folder}"
    return initial


def assert_started_as_one_process(folder: Path, module: torch.nn.Module) -> None:
    """The run whose ranks wrote ``folder`` started from ``module``'s parameters, bit for bit: what one process
    builds from the same seed, compared without copying anything from the run."""
    initial = started_from(folder)
    want = {k: v.detach() for k, v in module.named_parameters(remove_duplicate=False) if "mae" not in k}
    assert set(initial) <= set(want), sorted(set(initial) - set(want))
    differ = [name for name, value in initial.items() if not torch.equal(value, want[name])]
    assert not differ, f"started from other values than one process: {differ[:5]}"

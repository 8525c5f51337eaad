"""The benchmark suite's clock reads peak memory only outside the timed steps (reading it costs host time)."""

from __future__ import annotations

import pytest

from benchmarks.suite import instrument


@pytest.mark.parametrize(
    ("warmup", "sampled"),
    [(4, [1, 2, 3]), (2, [1]), (1, [0]), (0, [0])],
)
def test_peak_memory_is_read_in_the_warm_up_steps_after_the_first(
    warmup: int, sampled: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[int] = []
    current = [0]  # the step the loop below is in
    memory = instrument.PeakMemory()
    monkeypatch.setattr(memory, "_in_use", lambda: reads.append(current[0]) or 1000 + current[0])
    monkeypatch.setattr(instrument, "MEMORY", memory)
    clock = instrument.StepClock(warmup)
    for step in range(warmup + 5):
        current[0] = step
        clock.mark()
        for _ in range(3):  # what the layers, waits and collectives of a step do
            memory.sample()
    clock.mark()
    in_steps = sorted(set(reads[1:]))  # the first read is the baseline, before step 0
    assert reads[0] == 0
    assert in_steps == sampled
    assert memory.result()["step_peak_mib"] == pytest.approx((sampled[-1] - 0) / 2**20)

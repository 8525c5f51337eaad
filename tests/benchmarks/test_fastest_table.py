"""The fastest-layout benchmark's table: the ratio and its mark per point, and auto under shard_grad_op."""

from __future__ import annotations

from benchmarks.fastest import POINTS, table


def _result(point: str, dp: int, steps: dict[str, float], sgo: bool) -> dict:
    torch_steps = {k: v for k, v in steps.items() if k not in ("auto", "auto_sgo", "bfpp_bf")}
    return {
        "point": point, "dp": dp, "steps_ms": steps, "fastest_torch": min(torch_steps, key=torch_steps.get),
        "auto_plan": {"schedule": "depth_first", "v": 4, "predicted_s": 0.6},
        "auto_sgo_plan": {"schedule": "breadth_first", "v": 2} if sgo else None,
        "bound_ms": 500.0, "bound_order": "zbv v=2",
    }  # fmt: skip


def test_points_cover_both_shardings_and_the_table_marks_misses_and_shard_grad_op_rows():
    assert {p.dp for p in POINTS} == {1, 2} and len(POINTS) == 24
    unsharded = _result("whole_p4_m8_dp1", 1, {"auto": 600.0, "bfpp_bf": 640.0, "Interleaved1F1B_v4": 607.0}, False)
    sharded = _result(
        "whole_p4_m8_dp2", 2,
        {"auto": 968.0, "auto_sgo": 850.0, "bfpp_bf": 924.0, "Interleaved1F1B_v2": 846.0, "LoopedBFS_v2": 874.0},
        True,
    )  # fmt: skip
    text = table([unsharded, sharded])
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| whole")}
    assert "0.988 |" in rows["whole_p4_m8_dp1"] and "✗" not in rows["whole_p4_m8_dp1"]
    assert "1.144 ✗" in rows["whole_p4_m8_dp2"]  # 968 / 846
    assert "breadth_first v=2: 850, 1.005 |" in rows["whole_p4_m8_dp2"]  # within 3%: no mark
    assert "at 1 of 2 points" in text
    assert "within 3% at 1 of 1 sharded points" in text


def test_the_ratio_by_round_pairs_each_round_and_leaves_unpaired_rounds_blank():
    steps = {"auto": 400.0, "bfpp_bf": 420.0, "InterleavedZeroBubble_v2": 390.0, "ZBVZeroBubble_v2": 395.0}
    paired = _result("split_p4_m4_dp2", 2, steps, False)
    paired["launch_steps_ms"] = {"auto": [400.0, 420.0, 380.0], "InterleavedZeroBubble_v2": [400.0, 390.0, 380.0]}
    unpaired = _result("split_p4_m8_dp2", 2, steps, False)  # a failed launch: two rounds against three
    unpaired["launch_steps_ms"] = {"auto": [400.0, 420.0], "InterleavedZeroBubble_v2": [400.0, 390.0, 380.0]}
    rows = {line.split("|")[1].strip(): line.split("|") for line in table([paired, unpaired]).splitlines()[2:4]}
    assert rows["split_p4_m4_dp2"][8].strip() == "1.00–1.08"  # 400/400, 420/390, 380/380
    assert rows["split_p4_m8_dp2"][8].strip() == ""

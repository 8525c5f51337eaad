"""An aliased layer is refused on every rank with the same message, and no rank hangs.

`self.last = self.blocks[-1]` makes a layer's parameters reachable under a second name, which would keep
another rank's weights on every rank that does not hold that layer. Found after partitioning, only those
ranks would raise while the layer's owner waited for them in the next collective; it must be found before,
from the module alone.
"""

from __future__ import annotations

import pytest

from tests.distributed.harness import launch
from tests.models import RunSpec

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def test_aliased_layer_fails_the_same_way_on_every_rank(tmp_path):
    run = RunSpec(
        name="aliased",
        strategy={"pipeline_parallel_size": 2},
        model_factory="tests.probe_models:aliased_net",
        expect_error=True,
    )
    # a hang (an owner waiting for the ranks that raised) would time out and fail inside launch
    ranks = launch([run], 2, tmp_path, timeout=150)["aliased"].ranks
    errors = [r["error"] for r in ranks]
    assert len(errors) == 2 and len(set(errors)) == 1, errors
    assert "`last` is another name for `blocks.7` of pipeline layer `blocks.7`" in errors[0]
    assert "ValueError" in errors[0]

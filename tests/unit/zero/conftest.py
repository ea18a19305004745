import pytest

from lightspeed.zero.stage3 import options as stage3_options


@pytest.fixture(autouse=True)
def gather_machinery_at_one_rank(monkeypatch):
    """The stage-3 unit tests run the gather / release machinery in one process: at a world of one a
    config would have the parameters view their shards instead (Note: one rank in param_group.py),
    which tests/unit/zero/test_stage3_one_rank.py covers."""
    monkeypatch.setattr(stage3_options, "ONE_RANK_VIEWS", False)

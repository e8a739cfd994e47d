"""``KernelLoader.tuned``: the winner from the store, and each ``on_miss`` for a problem
never tuned on this device (in-process, the test family ``twice`` of tests/tunefam)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from farm.core.errors import KernelError
from farm.core.settings import Settings
from loader import KernelLoader
from loader.errors import TuningMissing

sys.path.insert(0, str(Path(__file__).resolve().parent / "tunefam"))

PROBLEM = {"n": 2048}
SLOW_FIRST = [{"way": "slow"}, {"way": "plain"}]


def settings_for(home: Path, **extra: object) -> Settings:
    return Settings(home=home, workers=0, redis_url=None, minio_endpoint=None,
                    records_url=None, device=None, family_modules=["tunefam"],
                    isolation_dir=home / "isolation", **extra)  # type: ignore[arg-type]


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "home"


def test_fail_raises_and_first_warns_once(home: Path,
                                          caplog: pytest.LogCaptureFixture) -> None:
    with KernelLoader(settings_for(home)) as loader:
        with pytest.raises(TuningMissing, match="never tuned"):
            loader.tuned("twice", PROBLEM, on_miss="fail")
        with caplog.at_level(logging.WARNING, logger="loader.tuned"):
            one = loader.tuned("twice", PROBLEM)  # FARM_TUNE_ON_MISS's default: first
            two = loader.tuned("twice", PROBLEM, on_miss="first")
        assert one.params == two.params == {"n": 2048, "way": "plain"}
        assert not one.tuned and one.result is None
        assert caplog.text.count("never tuned on this device") == 1
        assert loader.stats.compiled == 1  # only the first candidate, for its kernel


def test_tune_here_stores_the_winner_for_every_later_process(home: Path) -> None:
    with KernelLoader(settings_for(home)) as loader:
        got = loader.tuned("twice", PROBLEM, candidates=SLOW_FIRST, on_miss="tune")
        assert got.tuned and got.params == {"n": 2048, "way": "plain"}
        assert got.result is not None and got.result.isolated
        assert [f.status for f in got.result.candidates] == ["ok", "ok"]
        assert got.result.speedup is not None and got.result.speedup > 1
    with KernelLoader(settings_for(home), on_miss="fail") as later:
        exact = later.tuned("twice", PROBLEM, candidates=SLOW_FIRST, on_miss="fail")
        latest = later.tuned("twice", PROBLEM, on_miss="fail")  # the problem's latest
        assert exact.params == latest.params == got.params
        assert exact.result == got.result
        with pytest.raises(TuningMissing):  # another candidate list was never tuned
            later.tuned("twice", PROBLEM, candidates=list(reversed(SLOW_FIRST)),
                        on_miss="fail")
        assert later.stats.compiled == 0


def test_a_problem_whose_candidates_all_fail_says_so(home: Path) -> None:
    with KernelLoader(settings_for(home)) as loader:
        with pytest.raises(KernelError, match="no candidate of its tuning ran right"):
            loader.tuned("twice", PROBLEM, candidates=[{"way": "lazy"}, {"way": "huge"}],
                         on_miss="tune")

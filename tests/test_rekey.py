"""The rekey rule: move an earlier build of the same family, copy anything else."""

from farm.compilation.rekey import RekeyAction, rekey_action
from farm.core.model import Key

OLD = Key(id_hash="a" * 32, build_id="1" * 24)
NEW = Key(id_hash="a" * 32, build_id="2" * 24)
TWIN_NEW = Key(id_hash="b" * 32, build_id="2" * 24)
TWIN_OLD = Key(id_hash="b" * 32, build_id="1" * 24)


def test_same_kernel_of_an_earlier_build_is_moved() -> None:
    assert rekey_action(OLD, "scale", NEW, "scale") is RekeyAction.MOVE


def test_another_kernel_of_an_earlier_build_of_the_family_is_moved() -> None:
    assert rekey_action(TWIN_OLD, "scale", NEW, "scale") is RekeyAction.MOVE


def test_a_kernel_of_the_current_build_is_copied() -> None:
    assert rekey_action(TWIN_NEW, "scale", NEW, "scale") is RekeyAction.COPY


def test_another_family_with_identical_source_is_copied() -> None:
    assert rekey_action(OLD, "other", NEW, "scale") is RekeyAction.COPY

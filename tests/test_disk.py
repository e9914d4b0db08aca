import pytest

from tasks.disk import DiskSpaceError, ensure_fits, measure


def test_measure_uses_nearest_existing_directory(tmp_path):
    space = measure(tmp_path / "not" / "yet" / "created")
    assert space.path == tmp_path
    assert 0 < space.free_bytes <= space.total_bytes


def test_refuses_a_model_larger_than_free_space(tmp_path):
    free = measure(tmp_path).free_bytes
    with pytest.raises(DiskSpaceError, match=str(tmp_path)):
        ensure_fits(tmp_path, needed_bytes=free + 10**9)


def test_margin_counts_against_free_space(tmp_path):
    free = measure(tmp_path).free_bytes
    assert ensure_fits(tmp_path, needed_bytes=1).free_bytes > 0
    with pytest.raises(DiskSpaceError, match="margin"):
        ensure_fits(tmp_path, needed_bytes=1, margin_bytes=free)

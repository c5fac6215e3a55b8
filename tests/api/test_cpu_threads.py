"""Default torch threads respect a container's CPU quota (cgroup v2 and v1 files in a temp tree)."""

from __future__ import annotations

import os

import pytest

from specserve.api.cpu_threads import cgroup_cpu_quota, default_num_threads


@pytest.mark.parametrize(
    "cpu_max,expected",
    [("max 100000\n", None), ("200000 100000\n", 2), ("150000 100000\n", 2), ("50000 100000\n", 1)],
)
def test_cgroup_v2_quota(tmp_path, cpu_max, expected):
    (tmp_path / "cpu.max").write_text(cpu_max)
    assert cgroup_cpu_quota(tmp_path) == expected


@pytest.mark.parametrize("quota_us,expected", [("-1", None), ("400000", 4), ("25000", 1)])
def test_cgroup_v1_quota(tmp_path, quota_us, expected):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(quota_us + "\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path) == expected


def test_no_cgroup_files_means_no_quota(tmp_path):
    (tmp_path / "cpu.max").write_text("garbage")
    assert cgroup_cpu_quota(tmp_path) is None


def test_default_is_the_smallest_of_torch_affinity_and_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("max 100000")
    assert default_num_threads(64, tmp_path) == min(64, affinity)
    assert default_num_threads(1, tmp_path) == 1
    (tmp_path / "cpu.max").write_text("100000 100000")  # one CPU's worth of quota
    assert default_num_threads(64, tmp_path) == 1

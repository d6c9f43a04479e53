"""rank= and world= given under torchrun name the data-parallel group, not the launcher's processes:
LOCAL_RANK and LOCAL_WORLD_SIZE still say how many processes share the node, for any group size."""

from __future__ import annotations

import os

import pytest

from headrace import ConfigError, Loader, readers
from headrace._distributed import detect_distributed


@pytest.fixture(autouse=True)
def eight_processes_on_this_node(monkeypatch):
    """What torchrun --nproc_per_node=8 sets on its fourth process."""
    for name, value in (("RANK", "3"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "3"), ("LOCAL_WORLD_SIZE", "8")):
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("world", [1, 2])
def test_a_given_group_of_any_size_shares_the_node_with_the_launchers_processes(image_folder, world):
    """world=1 (tensor parallelism over the whole node, one data-parallel group) took every core on
    each of the node's 8 processes; world=2 divided them by 8."""
    found = detect_distributed(rank=0, world=world)
    assert (found.local_rank, found.local_world, found.source) == (3, 8, "arguments")
    loader = Loader(readers.files(image_folder), batch_size=4, device="cpu", rank=0, world=world)
    assert loader.num_threads == max(1, (os.cpu_count() or 1) // 8)


def test_a_local_rank_past_the_node_is_refused_for_a_given_group_of_one(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for world in (1, 2):
        with pytest.raises(ConfigError, match="LOCAL_RANK=3 must be below LOCAL_WORLD_SIZE=2"):
            detect_distributed(rank=0, world=world)


def test_distributed_false_still_reads_alone(image_folder):
    """The way out for a process that reads the whole data set by itself is unchanged."""
    assert detect_distributed(distributed=False).local_world == 1
    loader = Loader(readers.files(image_folder), batch_size=4, device="cpu", distributed=False)
    assert loader.num_threads == (os.cpu_count() or 1)

"""torchrun's environment read with care: half of it, or a local rank no launcher gives, is an error
that names the variable, not a job whose every rank reads the whole data set or shares a GPU."""

from __future__ import annotations

import pytest

from headrace import ConfigError, Loader, readers
from headrace._distributed import detect_distributed

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)


def _set(monkeypatch, **env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("env, missing", [({"WORLD_SIZE": "4"}, "RANK"), ({"RANK": "2"}, "WORLD_SIZE")])
def test_half_of_torchrun_environment_is_refused_naming_what_is_missing(monkeypatch, image_folder, env, missing):
    """Either alone was taken as no launcher at all: rank 0 of 1 on every process, so every rank
    read every sample."""
    _set(monkeypatch, **env)
    with pytest.raises(ConfigError, match=f"{missing} is not"):
        detect_distributed()
    with pytest.raises(ConfigError, match=f"{missing} is not"):
        Loader(readers.files(image_folder), batch_size=4, device="cpu")
    assert detect_distributed(distributed=False).world == 1  # the way out the message gives
    alone = Loader(readers.files(image_folder), batch_size=4, device="cpu", distributed=False)
    assert (alone.rank, alone.world) == (0, 1)


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "1"}, {"RANK": "0"}])
def test_half_of_the_environment_that_says_one_process_is_one_process(monkeypatch, env):
    _set(monkeypatch, **env)
    found = detect_distributed()
    assert (found.rank, found.world, found.source) == (0, 1, "none")


@pytest.mark.parametrize("env, match", [
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "-1"}, "LOCAL_RANK=-1 is negative"),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2 must be below"),
])
def test_a_local_rank_no_launcher_gives_is_refused(monkeypatch, env, match):
    """LOCAL_RANK=-1 became device cuda:<last GPU> (Python's -1 % n), which another rank uses."""
    _set(monkeypatch, **env)
    with pytest.raises(ConfigError, match=match):
        detect_distributed()
    with pytest.raises(ConfigError, match=match):  # with the rank given, the GPU still follows LOCAL_RANK
        detect_distributed(rank=1, world=4)


def test_torchrun_environment_of_every_rank_on_two_nodes(monkeypatch):
    """What torchrun sets on 2 nodes of 2 processes is read as it is meant."""
    for rank in range(4):
        _set(monkeypatch, RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2")
        found = detect_distributed()
        assert (found.rank, found.world, found.local_rank, found.local_world, found.source) == (
            rank, 4, rank % 2, 2, "environment")

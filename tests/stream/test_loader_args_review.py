"""The Loader's ``seed`` refused when the loader is made: NumPy seeds the reader's shuffle and the
random ops with it only once the first epoch starts, and fails there on a negative one."""

from __future__ import annotations

import pytest

from headrace import ConfigError, Loader, readers


@pytest.mark.parametrize("seed", [-1, float("nan"), True, 2.0])
def test_a_seed_numpy_cannot_use_is_a_config_error_when_the_loader_is_made(image_folder, seed):
    # -1 was taken here and failed at the first epoch ("unexpected ValueError in the loader");
    # True was seed 1
    with pytest.raises(ConfigError, match="seed"):
        Loader(readers.files(image_folder, shuffle=True), batch_size=8, device="cpu", seed=seed)


async def test_seed_zero_and_a_large_seed_still_load_the_epoch(image_folder):
    for seed in (0, 2**40):
        async with Loader(readers.files(image_folder, shuffle=True), batch_size=32, device="cpu",
                          num_threads=1, seed=seed) as loader:
            keys = [k async for batch in loader for k in batch.sample_keys]
        assert sorted(keys) == sorted(f"c{c}/{i:04d}" for c in range(3) for i in range(25))

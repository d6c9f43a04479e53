"""``p`` on ColorTwist and GaussianBlur (torchvision's ``RandomApply``) and ``RandomGrayscale``, on
the CPU path through a Loader over real JPEGs: each sample either keeps the pixels of the pipeline
without the op exactly, or gets exactly what the op at p=1 gives it (the same first uniforms);
both happen, about as often as p says; the gray images are torchvision's gray within a level."""

from __future__ import annotations

import pytest
import torch
from sample_data import cropped_images, jpeg_items

from headrace import ConfigError, ops

N = 96


async def _images(*post, channels: int = 3) -> dict[str, torch.Tensor]:
    return await cropped_images(jpeg_items(N, 31, 30, 36), *post, size=20, channels=channels)


@pytest.mark.parametrize("make", [
    lambda p: ops.ColorTwist(0.6, 0.6, 0.6, 0.2, p=p),
    lambda p: ops.GaussianBlur(5, sigma=(1.0, 2.0), p=p),
], ids=["color", "blur"])
async def test_p_applies_the_op_to_that_share_of_the_samples_and_leaves_the_rest_exactly(make):
    plain, always, half = await _images(), await _images(make(1.0)), await _images(make(0.5))
    kept = [k for k in plain if torch.equal(half[k], plain[k])]
    changed = [k for k in plain if torch.equal(half[k], always[k]) and not torch.equal(always[k], plain[k])]
    assert len(kept) + len(changed) == N  # each sample is one or the other, exactly
    assert 0.3 * N < len(changed) < 0.7 * N


async def test_p_one_draws_as_before_and_p_zero_changes_nothing():
    assert ops.ColorTwist(0.4).randoms == 4 and ops.GaussianBlur(3).randoms == 1  # p=1: the draws of old
    assert ops.ColorTwist(0.4, p=0.5).randoms == 5 and ops.GaussianBlur(3, p=0.5).randoms == 2
    plain = await _images()
    none = await _images(ops.ColorTwist(0.6, 0.6, 0.6, 0.2, p=0.0), ops.GaussianBlur(5, p=0.0))
    assert all(torch.equal(plain[k], none[k]) for k in plain)


async def test_random_grayscale_is_torchvisions_gray_for_the_samples_drawn():
    plain, gray = await _images(), await _images(ops.RandomGrayscale(0.5))
    turned = 0
    for key, image in gray.items():
        if torch.equal(image, plain[key]):
            continue
        turned += 1
        assert torch.equal(image[..., 0], image[..., 1]) and torch.equal(image[..., 0], image[..., 2])
        rgb = plain[key].double()
        expected = 0.2989 * rgb[..., 0] + 0.587 * rgb[..., 1] + 0.114 * rgb[..., 2]  # rgb_to_grayscale's weights
        assert (image[..., 0].double() - expected).abs().max() <= 1.0
    assert 0.3 * N < turned < 0.7 * N
    ones = await _images(channels=1)
    assert all(torch.equal(ones[k], v) for k, v in (await _images(ops.RandomGrayscale(1.0), channels=1)).items())


@pytest.mark.parametrize("make", [
    lambda: ops.ColorTwist(0.1, p=1.5), lambda: ops.GaussianBlur(3, p=-0.1), lambda: ops.RandomGrayscale(2),
    lambda: ops.RandomGrayscale(float("nan")),
])
def test_p_outside_zero_to_one_is_refused(make):
    with pytest.raises(ConfigError, match=r"p must be|finite number"):
        make()

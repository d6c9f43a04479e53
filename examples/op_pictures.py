"""Pictures of what each image op does, for docs/ops.md: one PNG per op in docs/images/ops/.

Each picture is made by the real op: a JPEG of one of scikit-image's sample photographs goes
through a ``headrace.Preprocessor`` whose pipeline is that op alone (after Decode), on the CPU.
The first tile is the decoded input; the others are the op's outputs at their true pixel size,
each captioned with the op's arguments. A random op shows two requests: each is a sample of
its own, with its own draw. ``Normalize`` is shown turned back into pixels (``x * std + mean``),
and the tensor it made with its values stretched over 0..255.

    .venv/bin/python examples/op_pictures.py            # needs the bench extra (scikit-image)
    .venv/bin/python examples/op_pictures.py --out /tmp/ops --photo astronaut

The pictures are palette PNGs of at most 90 KB each. The seed is fixed, so a
rerun draws the same crops and angles.
"""

from __future__ import annotations

import argparse
import asyncio
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

import headrace
from headrace import ops

ROOT = Path(__file__).resolve().parents[1]
INPUT_HEIGHT = 160  # the photograph is scaled to this height before it is encoded
CAPTION = 32  # pixels under each tile for its caption (two lines)
GAP = 8
MAX_BYTES = 60_000


@dataclass
class Figure:
    name: str  # the PNG's file name, without .png
    op: ops.Op
    caption: str
    requests: int = 1  # how many outputs to show (two for a random op)
    more: tuple[tuple[ops.Op, str], ...] = ()  # other settings of the same op, one output each


def figures(height: int, width: int) -> list[Figure]:
    shear = 0.35  # WarpAffine: input x = output x + shear * (output y - height / 2)
    return [
        Figure("resize", ops.Resize(96), "Resize(96)", more=((ops.Resize((128, 128)), "Resize((128, 128))"),)),
        Figure("center_crop", ops.CenterCrop(128), "CenterCrop(128)", more=((ops.CenterCrop(192), "CenterCrop(192)"),)),
        Figure("random_resized_crop", ops.RandomResizedCrop(128), "RandomResizedCrop(128)", requests=2),
        Figure("flip", ops.Flip(p=1.0), "Flip(p=1.0)", more=((ops.Flip(p=1.0, vertical=True), "Flip(p=1.0, vertical=True)"),)),
        Figure("color_twist", ops.ColorTwist(brightness=0.4, contrast=0.4, saturation=0.8, hue=0.2),
               "ColorTwist(0.4, 0.4, 0.8, 0.2)", requests=2),
        Figure("rotate", ops.Rotate(30), "Rotate(30)", requests=2),
        Figure("random_affine", ops.RandomAffine(20, translate=(0.1, 0.1), scale=(0.8, 1.1), shear=10),
               "RandomAffine(20, (0.1, 0.1), (0.8, 1.1), 10)", requests=2),
        Figure("warp_affine", ops.WarpAffine([[1, shear, -shear * height / 2], [0, 1, 0]]), "WarpAffine(shear 0.35)",
               more=((ops.WarpAffine([[1.25, 0, -0.125 * width], [0, 1.25, -0.125 * height]], fill=(40, 90, 160)),
                      "WarpAffine(zoom 0.8, fill=(40, 90, 160))"),)),
        Figure("gaussian_blur", ops.GaussianBlur(9, sigma=1.5), "GaussianBlur(9, sigma=1.5)",
               more=((ops.GaussianBlur(21, sigma=4.0), "GaussianBlur(21, sigma=4)"),)),
        Figure("tone_curves", ops.RandomPosterize(2, p=1.0), "RandomPosterize(2)",
               more=((ops.RandomSolarize(128, p=1.0), "RandomSolarize(128)"), (ops.RandomEqualize(p=1.0), "RandomEqualize()"),
                     (ops.RandomAdjustSharpness(4.0, p=1.0), "RandomAdjustSharpness(4)"))),
        Figure("rand_augment", ops.RandAugment(magnitude=15), "RandAugment(magnitude=15)", requests=4),
        Figure("augmix", ops.AugMix(), "AugMix()", requests=4),
        Figure("timm_augmix", ops.TimmAugMix("augmix-m5-w4-d2"), 'TimmAugMix("augmix-m5-w4-d2")', requests=4),
        Figure("timm_auto_augment", ops.TimmAutoAugment("original-mstd0.5"), 'TimmAutoAugment("original-mstd0.5")',
               requests=4),
        Figure("normalize", ops.Normalize(), "Normalize(), as x * std + mean"),
    ]


def photograph(name: str) -> np.ndarray:
    try:
        import skimage.data
    except ImportError:
        raise SystemExit("op_pictures needs scikit-image (pip install -e '.[bench]')") from None
    return np.asarray(getattr(skimage.data, name)())[..., :3]


def jpeg_of(pixels: np.ndarray, height: int) -> bytes:
    img = Image.fromarray(pixels)
    img = img.resize((round(img.width * height / img.height), height), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=95)
    return buf.getvalue()


def as_pixels(out: torch.Tensor, normalize: ops.Normalize | None) -> Image.Image:
    """A CHW output row as an RGB image; a normalized one turned back into 0..255 levels first."""
    x = out.float()
    if normalize is not None:
        mean = torch.tensor(normalize.mean).view(-1, 1, 1)
        std = torch.tensor(normalize.std).view(-1, 1, 1)
        x = (x * std + mean) * 255.0
    return Image.fromarray(x.round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy())


def stretched(out: torch.Tensor) -> Image.Image:
    """A normalized tensor's values, lowest to highest over all channels, as 0..255."""
    x = out.float()
    x = (x - x.min()) / (x.max() - x.min()) * 255.0
    return Image.fromarray(x.round().to(torch.uint8).permute(1, 2, 0).numpy())


async def run_op(op: ops.Op, jpeg: bytes, requests: int) -> list[torch.Tensor]:
    """The op's outputs for ``requests`` requests of the same JPEG, each a sample with its own index."""
    pipeline = ops.Pipeline([op], label=None)
    async with headrace.Preprocessor(pipeline, device="cpu", max_batch=1, seed=7) as pre:
        return [await pre(jpeg) for _ in range(requests)]


def compose(tiles: list[tuple[Image.Image, str]]) -> Image.Image:
    """Tiles side by side at their true sizes, top-aligned, each over its caption."""
    font = ImageFont.load_default(size=11)
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    slots = [max(img.width, measure.multiline_textbbox((0, 0), caption, font=font, spacing=2)[2]) for img, caption in tiles]
    width = sum(slots) + GAP * (len(tiles) + 1)
    height = max(img.height for img, _ in tiles) + CAPTION + 2 * GAP
    sheet = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(sheet)
    x = GAP
    for (img, caption), slot in zip(tiles, slots):
        sheet.paste(img, (x, GAP))
        draw.multiline_text((x, GAP + img.height + 4), caption, fill=(40, 40, 40), font=font, spacing=2)
        x += slot + GAP
    return sheet


def save_small(sheet: Image.Image, path: Path) -> int:
    """A palette PNG with the most colours (256 down to 64) that keep it within MAX_BYTES: a
    photograph stays recognisable at a third of its RGB PNG's bytes."""
    for colors in (256, 192, 128, 96, 64):
        sheet.quantize(colors=colors, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.FLOYDSTEINBERG).save(path, optimize=True)
        if path.stat().st_size <= MAX_BYTES:
            break
    return path.stat().st_size


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "ops")
    parser.add_argument("--photo", default="chelsea", help="a scikit-image sample photograph (default: chelsea)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    jpeg = jpeg_of(photograph(args.photo), INPUT_HEIGHT)
    (decoded,) = await run_op(ops.Resize(INPUT_HEIGHT), jpeg, 1)  # a no-op resize: Decode's pixels
    source = as_pixels(decoded, None)
    input_tile = (source, f"input {source.width}x{source.height}")

    for fig in figures(source.height, source.width):
        normalize = fig.op if isinstance(fig.op, ops.Normalize) else None
        outs = await run_op(fig.op, jpeg, fig.requests)
        tiles = [input_tile]
        for k, out in enumerate(outs):
            size = f"{out.shape[2]}x{out.shape[1]}" if fig.requests == 1 else f"sample {k}, {out.shape[2]}x{out.shape[1]}"
            tiles.append((as_pixels(out, normalize), f"{fig.caption}\n{size}"))
        for op, caption in fig.more:
            (out,) = await run_op(op, jpeg, 1)
            tiles.append((as_pixels(out, None), f"{caption}\n{out.shape[2]}x{out.shape[1]}"))
        if normalize is not None:
            tiles.append((stretched(outs[0]), "the float32 tensor,\nmin..max as 0..255"))
        size = save_small(compose(tiles), args.out / f"{fig.name}.png")
        print(f"{fig.name}.png: {len(tiles) - 1} outputs, {size / 1024:.0f} KiB")


if __name__ == "__main__":
    asyncio.run(main())

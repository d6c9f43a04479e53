"""Small image data sets that headrace makes itself, for the demo, the tests and the benchmarks.

``make_image_folder`` writes a class-per-folder tree of JPEGs. With scikit-image installed (the
``bench`` extra) the images are random crops of its real photographs, as docs/design.md §10 describes
(shorter side 256–600 px, light grain, quality 85–96, 4:2:0, about 60–70 KiB); without it they
are smooth random colour fields with shapes and grain, which still compress like photographs do.
``ensure_image_folder`` makes one only when the folder does not already hold it (a cache).
"""

from __future__ import annotations

import concurrent.futures
import io
import os
import re
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["COCO_CATEGORIES", "MARKER", "count_images", "ensure_image_folder", "make_coco", "make_image_folder", "photographs"]

_COLOR_PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "immunohistochemistry", "hubble_deep_field",
                 "retina", "stereo_motorcycle")
_GRAY_PHOTOS = ("camera", "brick", "grass", "gravel", "moon", "coins", "clock", "cell")


def photographs() -> list[np.ndarray] | None:
    """scikit-image's sample photographs as RGB uint8 arrays, or None without scikit-image."""
    try:
        import skimage.data as data
    except ImportError:
        return None
    out = []
    for name in _COLOR_PHOTOS + _GRAY_PHOTOS:
        try:
            img = getattr(data, name)()
        except Exception:  # a newer scikit-image may fetch some photos from the network
            continue
        if isinstance(img, tuple):
            img = img[0]
        img = np.asarray(img)
        if img.ndim == 2:
            img = np.repeat(img[..., None], 3, axis=2)
        out.append(np.ascontiguousarray(img[..., :3]).astype(np.uint8))
    return out or None


def _synthetic(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    # A low-resolution random field, upsampled smoothly, plus a few flat shapes: photo-like spectra.
    small = rng.integers(0, 256, size=(int(rng.integers(3, 9)), int(rng.integers(3, 9)), 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC)
    arr = np.asarray(img).copy()
    for _ in range(int(rng.integers(2, 6))):
        y0, x0 = int(rng.integers(0, h)), int(rng.integers(0, w))
        y1, x1 = min(h, y0 + int(rng.integers(h // 8, h // 2))), min(w, x0 + int(rng.integers(w // 8, w // 2)))
        arr[y0:y1, x0:x1] = rng.integers(0, 256, size=3)
    return arr


def _sample_image(rng: np.random.Generator, photos: list[np.ndarray] | None, short_side: int) -> Image.Image:
    if photos:
        src = photos[int(rng.integers(len(photos)))]
        sh, sw = src.shape[:2]
        frac = rng.uniform(0.5, 1.0)
        ch, cw = max(16, int(sh * frac)), max(16, int(sw * rng.uniform(0.5, 1.0)))
        y0, x0 = int(rng.integers(0, sh - ch + 1)), int(rng.integers(0, sw - cw + 1))
        img = Image.fromarray(src[y0 : y0 + ch, x0 : x0 + cw])
        if rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    else:
        aspect = rng.uniform(0.6, 1.6)
        img = Image.fromarray(_synthetic(rng, 64, max(16, int(64 * aspect))))
    scale = short_side / min(img.size)
    img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.Resampling.BILINEAR)
    # Uniform grain in [-5, 5] (standard deviation ~3.2): as photographic as Gaussian grain for the
    # encoder, and four times cheaper to draw.
    arr = np.asarray(img).astype(np.int16)
    arr += rng.integers(-5, 6, size=arr.shape, dtype=np.int16)
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def _encode_one(i: int, seed: int, photos, short_side, quality) -> bytes:
    rng = np.random.default_rng([seed, i])  # one stream per image: any worker count gives the same files
    img = _sample_image(rng, photos, int(rng.integers(short_side[0], short_side[1] + 1)))
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=int(rng.integers(quality[0], quality[1] + 1)), subsampling="4:2:0")
    return buf.getvalue()


def make_image_folder(
    root: str | os.PathLike,
    *,
    count: int = 512,
    classes: int = 10,
    seed: int = 0,
    short_side: tuple[int, int] = (256, 600),
    quality: tuple[int, int] = (85, 96),
    use_photographs: bool = True,
    progress: Callable[[int], None] | None = None,
    workers: int | None = None,
) -> Path:
    """Write ``count`` JPEGs into ``root/class_XX/NNNNNN.jpg`` (image ``i`` in class ``i % classes``)
    and return ``root``.

    Deterministic for a seed, whatever ``workers`` (threads encoding in parallel; default: the
    cores, at most 8). ``progress(n)`` is called from the calling thread as images are written.
    Existing files with the same names are overwritten; others are left alone.
    """
    root = Path(root)
    photos = photographs() if use_photographs else None
    for c in range(classes):
        (root / f"class_{c:02d}").mkdir(parents=True, exist_ok=True)
    workers = workers or min(8, os.cpu_count() or 1)

    def write(i: int) -> None:
        data = _encode_one(i, seed, photos, short_side, quality)
        (root / f"class_{i % classes:02d}" / f"{i:06d}.jpg").write_bytes(data)

    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="headrace-make") as pool:
        window = 4 * workers  # bounded look-ahead: progress stays live and memory flat
        pending: deque[concurrent.futures.Future[None]] = deque()
        for i in range(count):
            pending.append(pool.submit(write, i))
            if len(pending) >= window:
                pending.popleft().result()
                if progress is not None:
                    progress(1)
        for fut in pending:
            fut.result()
            if progress is not None:
                progress(1)
    return root


# The categories of ``make_coco``: ids with gaps, as COCO's own (1..90 for 80 categories).
COCO_CATEGORIES = {1: "red", 3: "green", 7: "blue"}
_COCO_COLORS = {1: (230, 20, 20), 3: (20, 200, 40), 7: (30, 40, 230)}


def make_coco(root: str | os.PathLike, *, count: int = 32, seed: int = 0) -> tuple[Path, Path]:
    """Write a small COCO-style detection set: ``count`` JPEGs in ``root/images/`` and their
    ``root/annotations.json`` (COCO's ``instances`` format), and return the two paths.

    Each image (160-320 px a side) is a smooth background with one to four solid rectangles in
    the colours of ``COCO_CATEGORIES``, each annotated with its exact box (x, y, width, height),
    its outline as a polygon and its category; every fifth image has none. Deterministic for a seed.
    """
    import json

    root = Path(root)
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    doc: dict = {"images": [], "annotations": [],
                 "categories": [{"id": cid, "name": name} for cid, name in COCO_CATEGORIES.items()]}
    for i in range(count):
        h, w = int(rng.integers(160, 321)), int(rng.integers(160, 321))
        arr = np.asarray(Image.fromarray(rng.integers(60, 200, size=(4, 4, 3), dtype=np.uint8))
                         .resize((w, h), Image.Resampling.BICUBIC)).copy()
        image_id = 1000 + i
        for _ in range(0 if i % 5 == 4 else int(rng.integers(1, 5))):
            bw, bh = int(rng.integers(w // 8, w // 2)), int(rng.integers(h // 8, h // 2))
            x, y = int(rng.integers(0, w - bw)), int(rng.integers(0, h - bh))
            cid = int(rng.choice(list(COCO_CATEGORIES)))
            arr[y : y + bh, x : x + bw] = _COCO_COLORS[cid]
            doc["annotations"].append({"id": len(doc["annotations"]) + 1, "image_id": image_id, "category_id": cid,
                                       "bbox": [x, y, bw, bh], "area": bw * bh, "iscrowd": 0,
                                       "segmentation": [[x, y, x + bw, y, x + bw, y + bh, x, y + bh]]})
        name = f"{i:06d}.jpg"
        Image.fromarray(arr).save(images / name, quality=90)
        doc["images"].append({"id": image_id, "file_name": name, "width": w, "height": h})
    annotations = root / "annotations.json"
    annotations.write_text(json.dumps(doc))
    return images, annotations


def count_images(root: str | os.PathLike) -> int:
    """How many ``class_*/*.jpg`` files ``root`` holds (0 if it does not exist)."""
    root = Path(root)
    if not root.is_dir():
        return 0
    return sum(1 for _ in root.glob("class_*/*.jpg"))


MARKER = ".headrace-dataset"  # in a folder headrace made: only such a folder is ever emptied or rewritten
_MARKER_TEXT = "made by headrace.datasets.make_image_folder; headrace may empty and rewrite this folder\n"


def _made_before_markers(root: Path) -> bool:
    """A folder written before the marker existed: only ``class_NN`` folders of ``NNNNNN.jpg`` files."""
    if not root.is_dir():
        return False
    entries = list(root.iterdir())
    return bool(entries) and all(
        d.is_dir() and re.fullmatch(r"class_\d{2,}", d.name) and all(re.fullmatch(r"\d{6}\.jpg", f.name) for f in d.iterdir())
        for d in entries
    )


def ensure_image_folder(
    root: str | os.PathLike,
    *,
    count: int,
    classes: int = 10,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    **kwargs,
) -> tuple[Path, bool]:
    """``make_image_folder`` unless ``root`` already holds exactly ``count`` images in ``classes`` folders.

    headrace writes only into a folder that is new, empty, or one it made (it leaves a
    ``.headrace-dataset`` file there): a folder of someone else's files is a ``ConfigError``, and
    is left as it is. A folder it made with another count is emptied of its ``class_*/*.jpg``
    files first. Returns ``(root, made)``, where ``made`` says whether the images were (re)written.
    """
    from headrace._errors import ConfigError

    root = Path(root)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{root} is a file, not a folder: give an empty or a new folder for the data set it makes")
    ours = (root / MARKER).is_file() or _made_before_markers(root)
    if root.is_dir() and not ours and any(root.iterdir()):
        raise ConfigError(f"{root} holds files headrace did not make: give an empty or a new folder for the "
                          "data set it makes (it writes only where it finds its own .headrace-dataset file)")
    folders = sorted(root.glob("class_*")) if root.is_dir() else []
    if ours and count_images(root) == count and len(folders) == classes:
        (root / MARKER).write_text(_MARKER_TEXT)
        return root, False
    for old in root.glob("class_*/*.jpg") if ours else ():
        old.unlink()
    for folder in folders:
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    root.mkdir(parents=True, exist_ok=True)
    (root / MARKER).write_text(_MARKER_TEXT)
    make_image_folder(root, count=count, classes=classes, seed=seed, progress=progress, **kwargs)
    return root, True

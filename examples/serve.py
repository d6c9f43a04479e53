"""An image classification server: aiohttp + headrace's ``Preprocessor`` + a small torch model.

    python examples/serve.py --port 8080
    curl --data-binary @cat.jpg http://127.0.0.1:8080/predict                  # the body is the image
    curl -F image=@cat.jpg -F image=@dog.jpg http://127.0.0.1:8080/predict      # or multipart, several files

Each upload goes through ``headrace.Preprocessor``: concurrent requests are gathered into batches
of at most ``--max-batch`` images, waiting at most ``--max-delay`` seconds for company, and
decoded → resized (shorter side 256) → centre-cropped (224) → normalised by the same executors
the training loader uses (CPU threads, or GPU lanes with ``--device cuda``).

The model batches too, with no second batcher: it is the service's ``postprocess`` step, so it
runs once per preprocessing batch, on the whole batch, in the one thread the service owns for it
(the event loop never runs the model; while the model works on batch k, batch k+1 is decoding).
Each caller gets its own row: the top ``--topk`` classes and their softmax scores.

The model: torchvision's ``mobilenet_v3_small(weights=None)`` when torchvision imports, otherwise
a small torch.nn CNN (``TinyNet``, below). Both have RANDOM weights (seeded): nothing is downloaded,
so the classes are meaningless; the point is the serving path, not the predictions. Load your own
weights into ``build_model``'s result for a real classifier.

Answers: 200 ``{"results": [{"key", "top": [{"class", "score"}, ...]}], "model"}``; 400 for an
empty or undecodable upload (the error names the request); 503 with ``Retry-After`` when the
service is full (``--when-full reject``, the default here: a server should shed load rather than
queue without bound) or shutting down; 413 for more files in one upload than ``--max-pending``
under reject (taken whole or not at all, they would never fit). ``GET /healthz`` answers 200 once
the service is open; ``GET /stats`` gives the service's counters (batch sizes included).
"""

from __future__ import annotations

import argparse
import sys
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

import headrace
import torch
from aiohttp import BodyPartReader, web
from headrace import ops
from headrace._loop import new_event_loop

PRE = web.AppKey("preprocessor", headrace.Preprocessor)
MODEL_NAME = web.AppKey("model_name", str)
MAX_PENDING = web.AppKey("max_pending", int)


class TinyNet(torch.nn.Module):
    """Four strided 3x3 convolutions, global average pooling, a linear head: about 100k parameters."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        width = 3
        for out in (16, 32, 64, 128):
            layers += [torch.nn.Conv2d(width, out, 3, stride=2, padding=1), torch.nn.BatchNorm2d(out), torch.nn.ReLU()]
            width = out
        self.features = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def build_model(kind: str = "auto", *, device: str = "cpu", seed: int = 0) -> tuple[torch.nn.Module, str]:
    """``(model, name)`` in eval mode on ``device``, random weights from ``seed``.

    ``kind``: ``"auto"`` (mobilenet if torchvision imports, else tiny), ``"mobilenet"`` or ``"tiny"``.
    Raises ImportError for ``"mobilenet"`` without torchvision.
    """
    torch.manual_seed(seed)
    if kind in ("auto", "mobilenet"):
        try:
            import torchvision
        except ImportError:
            if kind == "mobilenet":
                raise
        else:
            model = torchvision.models.mobilenet_v3_small(weights=None)
            return model.eval().to(device), "mobilenet_v3_small (torchvision, random weights)"
    if kind not in ("auto", "tiny"):
        raise ValueError(f"unknown model {kind!r}")
    return TinyNet().eval().to(device), "TinyNet (torch.nn, random weights; torchvision not installed)"


def classify(model: torch.nn.Module, topk: int) -> Callable[[torch.Tensor], list[list[dict[str, Any]]]]:
    """The service's postprocess: one forward pass for a whole batch, then each row's top classes."""

    def step(images: torch.Tensor) -> list[list[dict[str, Any]]]:
        with torch.inference_mode():
            scores, classes = model(images).softmax(dim=1).topk(topk, dim=1)
        # .tolist() copies to the host (and waits for the GPU) here, in the service's thread.
        return [
            [{"class": c, "score": round(s, 6)} for c, s in zip(cs, ss)]
            for cs, ss in zip(classes.tolist(), scores.tolist())
        ]

    return step


_request_ids = itertools.count()


async def predict(request: web.Request) -> web.Response:
    pre = request.app[PRE]
    rid = f"http-{next(_request_ids)}"
    if request.content_type.startswith("multipart/"):
        images = []
        reader = await request.multipart()
        async for part in reader:
            if isinstance(part, BodyPartReader):  # nested multiparts are not uploads we take
                images.append(await part.read())
    else:
        images = [await request.read()]
    if not images or not all(images):
        return _error(400, "empty upload: send an image as the body, or as multipart files", rid)
    if pre.when_full == "reject" and len(images) > request.app[MAX_PENDING]:  # never taken whole: no Retry-After
        return _error(413, f"{len(images)} files in one upload, more than max_pending={request.app[MAX_PENDING]}", rid)
    try:
        rows = await pre(images if len(images) > 1 else images[0], key=rid)
    except headrace.DecodeError as exc:
        return _error(400, str(exc), rid)
    except headrace.OverloadedError as exc:
        return _error(503, str(exc), rid, headers={"Retry-After": "1"})
    except headrace.ClosedError as exc:
        return _error(503, str(exc), rid)
    except headrace.LoaderError as exc:  # the model failed on the batch (TransformError, stage "postprocess")
        return _error(500, str(exc), rid)
    if len(images) == 1:
        rows = [rows]
    keys = [rid] if len(images) == 1 else [f"{rid}/{i}" for i in range(len(images))]
    results = [
        {"key": k, "shape": list(row.shape)} if isinstance(row, torch.Tensor) else {"key": k, "top": row}
        for k, row in zip(keys, rows)  # a tensor row: --model none
    ]
    return web.json_response({"results": results, "model": request.app[MODEL_NAME]})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True, "device": request.app[PRE].device})


async def stats(request: web.Request) -> web.Response:
    """The service's counters: requests, failures, rejections, batch sizes (size -> batches)."""
    s = dict(vars(request.app[PRE].stats()))
    s["batch_sizes"] = {str(k): v for k, v in sorted(s["batch_sizes"].items())}
    return web.json_response(s)


def _error(status: int, message: str, rid: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message, "key": rid}, status=status, headers=headers)


def make_app(
    *,
    device: str = "auto",
    model: str = "auto",
    topk: int = 5,
    max_batch: int = 32,
    max_delay: float = 0.0,
    max_pending: int = 512,
    when_full: str = "reject",
    num_threads: int | None = None,
    client_max_size: int = 32 << 20,
) -> web.Application:
    """The aiohttp application; the service and the model live as long as the app runs."""
    app = web.Application(client_max_size=client_max_size)

    async def service(app: web.Application) -> AsyncIterator[None]:
        # "auto" resolved here as the Preprocessor resolves it, so that the model sits with the images.
        pre_device = ("cuda" if ops.cuda_available() else "cpu") if device == "auto" else device
        if model == "none":  # preprocessing only: answers carry the tensor's shape (for benchmarks)
            step, name = None, "none"
        else:
            net, name = build_model(model, device=pre_device)
            step = classify(net, topk)
        async with headrace.Preprocessor(
            ops.validation(label=None),
            device=pre_device,
            max_batch=max_batch,
            max_delay=max_delay,
            max_pending=max_pending,
            when_full=when_full,
            num_threads=num_threads,
            postprocess=step,
            wait_ready=step is None,  # GPU, no model: answer once the tensor is done (what a benchmark times)
        ) as pre:
            app[PRE], app[MODEL_NAME], app[MAX_PENDING] = pre, name, max_pending
            yield

    app.cleanup_ctx.append(service)
    app.router.add_post("/predict", predict)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/stats", stats)
    return app



def refuse_cuda_without_gpu(device: str) -> None:
    """Say in one line that a GPU run cannot start here, rather than a traceback from inside the loader."""
    if device.startswith("cuda") and not ops.cuda_available():
        sys.exit(f"--device {device} needs a CUDA GPU with CuPy and nvImageCodec (pip install '.[cuda12]' or "
                 "'.[cuda13]'); none here: run with --device cpu")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--model", default="auto", choices=["auto", "mobilenet", "tiny", "none"],
                   help="none: preprocessing only, answers carry the tensor shape")
    p.add_argument("--topk", type=int, default=5)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-delay", type=float, default=0.0,
                   help="seconds a request waits for company (0: batches form from the backlog alone)")
    p.add_argument("--max-pending", type=int, default=512, help="images in flight before --when-full applies")
    p.add_argument("--when-full", default="reject", choices=["reject", "wait"])
    p.add_argument("--threads", type=int, default=None, help="CPU decode threads (default: all cores)")
    args = p.parse_args(argv)
    refuse_cuda_without_gpu(args.device)
    app = make_app(
        device=args.device, model=args.model, topk=args.topk, max_batch=args.max_batch, max_delay=args.max_delay,
        max_pending=args.max_pending, when_full=args.when_full, num_threads=args.threads,
    )
    # uvloop when installed, like the loader.
    web.run_app(app, host=args.host, port=args.port, loop=new_event_loop(),
                print=lambda m: print(m, flush=True))


if __name__ == "__main__":
    main()

"""The hand-written baseline for batch scoring: the inference loop a user would write around an exported model.

Everything comes from the model folder as a user would read it: the network named in model_card.json, built by
torchvision and loaded from model.safetensors; the card's preprocessing: the centred square of `crop_fraction`
of the shorter side resized (bilinear) to `center_crop`, then torchvision's ToTensor and Normalize. (The card's
rounded `resize_shorter_side` with torchvision's Resize + CenterCrop places the crop up to half a pixel away,
which changes the pixels by several levels on photos: close, but not the same numbers.) torchvision's
ImageFolder lists and decodes the files (PIL, `convert("RGB")`), a DataLoader with worker processes batches
them, the model runs under torch.inference_mode in fp32, and every image becomes one CSV row: its path under
the folder, then the top-k classes and their probabilities, most likely first.

    python -m clusterfit.bench.baselines.score_loop MODEL_DIR IMAGES --out predictions.csv --batch-size 64

Prints one JSON line: images scored, the loop's seconds (DataLoader start to the last row written), images/s.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import time
from pathlib import Path

import torch
import torchvision
from PIL import Image
from safetensors.torch import load_file
from torch.utils.data import DataLoader
from torchvision import datasets, transforms


class CentreCrop:
    """The model card's crop: the centred square of `crop_fraction` of the shorter side, resized to `size`."""

    def __init__(self, size: int, crop_fraction: float) -> None:
        self.size, self.crop_fraction = size, crop_fraction

    def __call__(self, image: Image.Image) -> Image.Image:
        side = min(image.size) * self.crop_fraction
        left, top = (image.width - side) / 2, (image.height - side) / 2
        box = (left, top, left + side, top + side)
        return image.resize((self.size, self.size), Image.Resampling.BILINEAR, box=box)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("images", type=Path, help="an ImageNet-layout folder (<class>/<image>.jpg)")
    parser.add_argument("--out", type=Path, required=True, help="the CSV to write")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="DataLoader processes")
    parser.add_argument("--top-k", type=int, default=5)
    args = parser.parse_args()

    card = json.loads((args.model_dir / "model_card.json").read_text())
    classes, prep = card["classes"], card["preprocessing"]
    model = torchvision.models.get_model(card["model"], weights=None, num_classes=len(classes))
    model.load_state_dict(load_file(str(args.model_dir / "model.safetensors")))
    model.eval()
    preprocess = transforms.Compose(
        [
            CentreCrop(prep["center_crop"], prep["crop_fraction"]),
            transforms.ToTensor(),
            transforms.Normalize(prep["mean"], prep["std"]),
        ]
    )
    dataset = datasets.ImageFolder(str(args.images), transform=preprocess)
    loader = DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers)
    top_k = min(args.top_k, len(classes))

    started = time.perf_counter()
    first = 0
    with open(args.out, "w", newline="") as f, torch.inference_mode():
        rows = csv.writer(f)
        ks = range(1, top_k + 1)
        rows.writerow(["file", *(f"class_{k}" for k in ks), *(f"probability_{k}" for k in ks)])
        for images, _ in loader:
            probabilities, indices = model(images).softmax(dim=1).topk(top_k, dim=1)
            for offset, (probs, best) in enumerate(zip(probabilities.tolist(), indices.tolist(), strict=True)):
                path = Path(dataset.samples[first + offset][0]).relative_to(args.images)
                rows.writerow([path.as_posix(), *(classes[i] for i in best), *probs])
            first += len(images)
    seconds = time.perf_counter() - started
    print(json.dumps({"images": first, "seconds": seconds, "images_per_s": first / seconds}), flush=True)


if __name__ == "__main__":
    main()

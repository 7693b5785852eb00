"""Batch scoring throughput: `clusterfit score` on 1 and 2 ranks against the inference loop a user would write,
over the same folder of real JPEGs with the same exported model, in one run.

The folder is crops of scikit-learn's two sample photos saved as 96x96 JPEGs (quality 90). The model is the
serving benchmark's (a ResNet-18 exported for 64 px input, 10 classes, random weights, which cost what trained
ones do) with its last layer centred on the folder's features, so that its top-1 varies from image to image
and comparing top-1 classes means something. The three systems score the whole folder in turn, in a rotating
order, --rounds times, each as its own process with fresh outputs, fp32, the same batch size and top-5:
  - `clusterfit score --nproc 1` and `--nproc 2` (torchrun, gloo; cores / ranks threads each), with --csv;
  - the hand-written loop (`clusterfit.bench.baselines.score_loop`): torchvision's ImageFolder, the model
    card's crop, ToTensor and Normalize, a DataLoader with one worker per core, torch.inference_mode, a CSV.
Per round it records the loop's images/s (what each reports: clusterfit from its first batch to every rank's
last chunk, the baseline from its first batch to its last row) and the end-to-end images/s (the command's wall
time, start-up, job bookkeeping and merging included). The outputs of the last round are compared per file
with those of `clusterfit score` on 1 rank: the same top-1 class, and how far apart the top-1 probabilities are.

    python benchmarks/scoring.py --images 3000 --rounds 3
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
from serving import make_model  # the serving benchmark's model, so the two sections describe one model

from clusterfit.bench.data import machine_description, make_photos
from clusterfit.data.imagefolder import val_transform
from clusterfit.data.loaders import normalize_on_device
from clusterfit.outputs.model_card import read_model_card, write_model_card
from clusterfit.scoring import load_classifier
from clusterfit.worker.export import export_model

SYSTEMS = ("clusterfit score, 1 rank", "clusterfit score, 2 ranks", "hand-written loop")


def centre_last_layer(model_dir: Path, images: Path, sample: int = 256) -> None:
    """Point each class at a random direction through the mean features of `sample` of the images, scaled so the
    logits spread by about 2, and export again: a random network alone answers one class for nearly every image."""
    classifier, card = load_classifier(model_dir), read_model_card(model_dir)
    prep = card.preprocessing
    transform = val_transform(card.image_size, prep.crop_fraction)
    files = sorted(images.rglob("*.jpg"))
    pixels = torch.stack([transform(str(file)) for file in files[:: max(1, len(files) // sample)]])
    model = classifier.model
    fc, model.fc = model.fc, torch.nn.Identity()
    with torch.no_grad():
        features = model(normalize_on_device(pixels, torch.device("cpu"), False, prep.mean, prep.std))
        centre = features.mean(dim=0)
        directions = torch.randn(fc.out_features, fc.in_features, generator=torch.Generator().manual_seed(0))
        fc.weight.copy_(directions * 2 / ((features - centre) @ directions.T).std())
        fc.bias.copy_(-(fc.weight @ centre))
    model.fc = fc
    export_model(model, model_dir, metadata=classifier.metadata, image_size=card.image_size)
    write_model_card(model_dir, card)  # the new weights' sha256


def command(system: str, model: Path, images: Path, out: Path, batch_size: int) -> list[str]:
    if system == "hand-written loop":
        baseline = [sys.executable, "-m", "clusterfit.bench.baselines.score_loop", str(model), str(images)]
        return [*baseline, "--out", str(out / "predictions.csv"), "--batch-size", str(batch_size)]
    ranks = "2" if system.endswith("2 ranks") else "1"
    score = [sys.executable, "-m", "clusterfit", "score", str(model), str(images), "--out", str(out)]
    return [*score, "--nproc", ranks, "--batch-size", str(batch_size), "--csv"]


def run(system: str, model: Path, images: Path, out: Path, batch_size: int, env: dict[str, str]) -> dict[str, float]:
    """One scoring of the whole folder: the loop's and the end-to-end images/s."""
    out.mkdir(parents=True)
    started = time.perf_counter()
    result = subprocess.run(
        command(system, model, images, out, batch_size), capture_output=True, text=True, env=env, check=False
    )
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{system} failed:\n{result.stdout}{result.stderr}")
    if system == "hand-written loop":
        report = json.loads(result.stdout.strip().splitlines()[-1])
        images_done, loop_rate = report["images"], report["images_per_s"]
    else:
        summary = json.loads((out / "summary.json").read_text())
        images_done, loop_rate = summary["images_scored"], summary["images_per_s"]
    return {"images": images_done, "loop_images_per_s": loop_rate, "end_to_end_images_per_s": images_done / wall}


def top1(csv_file: Path) -> dict[str, tuple[str, float]]:
    with open(csv_file, newline="") as f:
        return {row["file"]: (row["class_1"], float(row["probability_1"])) for row in csv.DictReader(f)}


def agreement(outputs: dict[str, Path]) -> dict[str, dict[str, float]]:
    """Each system's top-1 per file against the 1-rank clusterfit run's: files compared, the share with the same
    class, and the largest difference of the top-1 probability where the class is the same."""
    reference = top1(outputs[SYSTEMS[0]] / "predictions.csv")
    parquet = pq.read_table(outputs[SYSTEMS[0]] / "predictions.parquet")
    assert parquet.num_rows == len(reference), "predictions.csv and predictions.parquet disagree"
    found = {}
    for system in SYSTEMS[1:]:
        other = top1(outputs[system] / "predictions.csv")
        assert other.keys() == reference.keys(), f"{system} scored other files"
        same = [file for file in reference if reference[file][0] == other[file][0]]
        found[system] = {
            "files": len(reference),
            "same_top1": len(same) / len(reference),
            "max_top1_probability_diff": max(abs(reference[f][1] - other[f][1]) for f in same),
            "distinct_top1_classes": len({cls for cls, _ in other.values()}),
        }
    return found


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=64, help="the model's input size")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/scoring.json"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="clusterfit-scoring-") as tmp:
        root = Path(tmp)
        images = make_photos(root / "photos", args.images, sizes=((96, 96),))
        model = make_model(root / "model", args.image_size)
        centre_last_layer(model, images)
        # A job store of its own: the runs queue behind nothing, and leave nothing in the user's.
        env = {**os.environ, "CLUSTERFIT_HOME": str(root / "home")}
        results: dict[str, list[dict[str, float]]] = {system: [] for system in SYSTEMS}
        load_before = os.getloadavg()[1]  # other work on the cores makes every figure smaller and noisier
        last: dict[str, Path] = {}
        for round_index in range(args.rounds):
            shift = round_index % len(SYSTEMS)
            for system in SYSTEMS[shift:] + SYSTEMS[:shift]:
                out = root / f"round-{round_index}" / system.replace(" ", "_").replace(",", "")
                results[system].append(run(system, model, images, out, args.batch_size, env))
                last[system] = out
                print(f"round {round_index + 1}, {system}: {results[system][-1]}", flush=True)
        agreed = agreement(last)
        load = {"before": load_before, "after": os.getloadavg()[1], "cores": len(os.sched_getaffinity(0))}

    machine = machine_description()
    baseline = results["hand-written loop"]
    print(
        f"\n{args.images} JPEGs of 96x96, ResNet-18 at {args.image_size} px, fp32, batch {args.batch_size}; "
        f"{machine}; {args.rounds} rounds, median (range); 5-minute load average {load['before']:.1f} before and "
        f"{load['after']:.1f} after, on {load['cores']} cores"
    )
    print("| system | loop images/s | ÷ hand-written | end-to-end images/s | ÷ hand-written | same top-1 |")
    print("|---|---:|---:|---:|---:|---:|")
    for system in SYSTEMS:
        loop = [r["loop_images_per_s"] for r in results[system]]
        whole = [r["end_to_end_images_per_s"] for r in results[system]]
        loop_ratio = statistics.median(loop) / statistics.median([r["loop_images_per_s"] for r in baseline])
        whole_ratio = statistics.median(whole) / statistics.median([r["end_to_end_images_per_s"] for r in baseline])
        same = "reference" if system == SYSTEMS[0] else f"{agreed[system]['same_top1']:.2%}"
        print(f"| {system} | {spread(loop)} | {loop_ratio:.2f} | {spread(whole)} | {whole_ratio:.2f} | {same} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    body = {"machine": machine, "load_average": load, "args": {k: str(v) for k, v in vars(args).items()}}
    body["rounds"] = results
    args.out.write_text(json.dumps({**body, "agreement": agreed}, indent=2) + "\n")


if __name__ == "__main__":
    main()

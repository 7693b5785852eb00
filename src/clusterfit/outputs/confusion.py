"""Per-class accuracy and the confusion matrix of a job's last validation: JSON in summary.json and a PNG
beside it (rows: the true class, named and numbered; columns: the predicted class's number; each cell shaded
by its share of the row)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MAX_MATRIX_CLASSES = 100  # above this the matrix is too large to read or to keep in summary.json


def per_class_accuracy(confusion: list[list[int]], classes: list[str]) -> list[dict[str, Any]]:
    rows = []
    for index, (name, row) in enumerate(zip(classes, confusion, strict=True)):
        images = sum(row)
        rows.append({"class": name, "images": images, "top1": row[index] / images if images else None})
    return rows


def confusion_facts(confusion: list[list[int]], classes: list[str]) -> dict[str, Any]:
    """What summary.json keeps: per-class accuracy always, the matrix itself for up to 100 classes."""
    facts: dict[str, Any] = {"per_class": per_class_accuracy(confusion, classes)}
    if len(classes) <= MAX_MATRIX_CLASSES:
        facts["confusion_matrix"] = {"classes": classes, "rows_true_columns_predicted": confusion}
    return facts


def write_confusion_png(confusion: list[list[int]], classes: list[str], path: Path) -> Path | None:
    """The matrix as an image (PIL, no plotting library needed); None above MAX_MATRIX_CLASSES."""
    if len(classes) > MAX_MATRIX_CLASSES:
        return None
    from PIL import Image, ImageDraw

    count = len(classes)
    cell = max(4, min(32, 640 // count))
    names = [f"{index} {name[:12]}" for index, name in enumerate(classes)]
    label = 7 * max(len(name) for name in names) + 4 if cell >= 12 else 0
    size = label + cell * count
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    for true, row in enumerate(confusion):
        total = sum(row) or 1
        for predicted, images in enumerate(row):
            share = images / total
            shade = (int(255 * (1 - share)), int(255 * (1 - 0.6 * share)), 255)  # white to blue
            x, y = label + predicted * cell, label + true * cell
            draw.rectangle([x, y, x + cell - 1, y + cell - 1], fill=shade, outline=(220, 220, 220))
    if label:
        for index, name in enumerate(names):
            draw.text((2, label + index * cell + cell // 2 - 5), name, fill="black")  # rows: the true class
            draw.text((label + index * cell + 2, label - 12), str(index), fill="black")  # columns: predicted
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path

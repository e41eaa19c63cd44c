"""The photo table of docs/choosing-eps.md ("Photos: the reference point"): privunit's
--reference zero (the rule before --reference existed) against --reference auto (mid-range
for colour images) on photos that are not MNIST.

The photos are scikit-learn's two sample images (china.jpg, flower.jpg; load_sample_images),
as PNG, at their own size (640 x 427) and resized (Lanczos) to 320 x 213 and 160 x 107: one
folder per size, one record per photo. Each folder is released with the command itself,

    tldp perturb PHOTOS --mechanism privunit --eps E --reference R --seed S --allow-weak-seed

at per-record eps 2, 4 and 8, seeds 0, 1, 2 (published weak seeds: right for a table in the
docs, never for a release), and measured with `tldp evaluate PHOTOS OUT --json` (the mean
PSNR and SSIM of the records against their originals, and the parameters check, which
recomputes the calibration, the reference included, from the manifest). Mean brightness is
the mean of the written PNGs' values (0..255); "black" the share of values exactly 0; for scale, the
PSNR of a flat mid-grey image (128) against the photos. Each cell is the mean over the 2
photos and the 3 seeds.

    python docs/choosing-eps/reference.py --out docs/choosing-eps/reference.json

Nothing is downloaded; it takes about a minute.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

SIZES = (None, (320, 213), (160, 107))  # width, height; None: the photo's own size
EPSILONS = (2.0, 4.0, 8.0)
REFERENCES = ("zero", "auto")
SEEDS = (0, 1, 2)


def write_photos(folder: Path, size: tuple[int, int] | None) -> None:
    from PIL import Image
    from sklearn.datasets import load_sample_images

    folder.mkdir(parents=True)
    data = load_sample_images()
    for name, image in zip(data.filenames, data.images):
        picture = Image.fromarray(image)
        if size is not None:
            picture = picture.resize(size, Image.LANCZOS)
        picture.save(folder / (Path(name).stem + ".png"))


def tldp(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "tldp_cli", *args], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"tldp {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def brightness(folder: Path) -> tuple[float, float]:
    from PIL import Image

    values = [np.asarray(Image.open(path), np.float64) for path in sorted(folder.glob("*.png"))]
    return (float(np.mean([v.mean() for v in values])), float(np.mean([(v == 0).mean() for v in values])))


def grey_psnr(folder: Path, value: float = 128.0) -> float:
    """The PSNR (as tldp evaluate computes it for 8-bit images: peak 255) of a flat image at
    `value` against each photo, averaged: what a release that knew nothing would score."""
    from PIL import Image

    values = [np.asarray(Image.open(path), np.float64) for path in sorted(folder.glob("*.png"))]
    return float(np.mean([10 * np.log10(255.0**2 / np.mean((v - value) ** 2)) for v in values]))


def measure(photos: Path, work: Path, eps: float, reference: str, seed: int) -> dict:
    out = work / f"{photos.name}-{reference}-{eps:g}-{seed}"
    tldp("perturb", str(photos), "--mechanism", "privunit", "--eps", f"{eps:g}", "--reference", reference,
         "--seed", str(seed), "--allow-weak-seed", "--out", str(out), "-q")
    report = json.loads(tldp("evaluate", str(photos), str(out), "--json"))
    assert report["checks"][0]["check"] == "parameters" and report["checks"][0]["passed"], report["checks"][0]
    mean, black = brightness(out)
    manifest = json.loads(Path(str(out) + ".manifest.json").read_text())
    return {"psnr": report["error"]["psnr"]["mean"], "ssim": report["error"]["ssim"]["mean"],
            "brightness": mean, "black": black, "reference": manifest["privunit"]["reference"],
            "certified_epsilon": manifest["accounting"]["per_record"]["epsilon"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON table")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in SIZES:
            photos = Path(tmp) / ("full" if size is None else f"{size[0]}x{size[1]}")
            write_photos(photos, size)
            shape = np.asarray(__import__("PIL.Image").Image.open(next(photos.glob("*.png")))).shape
            raw_brightness, raw_black = brightness(photos)
            for eps in EPSILONS:
                for reference in REFERENCES:
                    runs = [measure(photos, Path(tmp), eps, reference, seed) for seed in SEEDS]
                    row = {"size": f"{shape[1]} x {shape[0]}", "eps": eps, "reference": reference,
                           "input_brightness": raw_brightness, "input_black": raw_black,
                           "flat_grey_psnr": grey_psnr(photos),
                           **{key: float(np.mean([r[key] for r in runs]))
                              for key in ("psnr", "ssim", "brightness", "black", "reference", "certified_epsilon")}}
                    row["reference_point"] = row.pop("reference")
                    row["reference"] = reference
                    rows.append(row)
                    print(f"{row['size']:>10} eps {eps:g} {reference:>5}: PSNR {row['psnr']:.2f} dB, SSIM "
                          f"{row['ssim']:.3f}, brightness {row['brightness']:.1f} (input {raw_brightness:.1f}), "
                          f"black {row['black']:.3f}", flush=True)
    args.out.write_text(json.dumps({"protocol": __doc__, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

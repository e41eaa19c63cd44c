"""The pictures of docs/choosing-eps.md: the same digits and the same photo released at
several per-record eps by TLDP (`--budget record`), the Gaussian baseline (`--budget
record`, delta 1e-5) and privunit, side by side.

Every release is `tldp_cli.perturb_array` with the options named in the row label (what
`tldp perturb` runs on the same array), with the published weak seed 0 (right for a
picture in the docs, never for a release). The digits are the first of each class among
the shipped MNIST training digits (sample_data/digits.npy); the photo is scikit-learn's
china.jpg (load_sample_images), resized to 120 x 80 so that one record is the whole
photo (I = 28,800 values). Values outside 0..255 (TLDP and the baselines add unbounded
noise) are shown clipped; privunit writes its records clipped to the declared range.

    python docs/choosing-eps/pictures.py --out docs/choosing-eps

Nothing is downloaded; it takes about a minute.
"""

from __future__ import annotations

import argparse
import io
import re
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
EPSILONS = (1.0, 4.0, 16.0, 64.0, 1000.0)
ROWS = (  # label, mechanism, noise (all under --budget record)
    ("TLDP-L", "tldp", None),
    ("Gaussian\nbaseline", "baseline", "gaussian"),
    ("privunit", "privunit", None),
)
PHOTO_SIZE = (120, 80)  # width, height


def digits() -> np.ndarray:
    x = np.load(ROOT / "sample_data" / "digits.npy")
    y = np.load(ROOT / "sample_data" / "digits_labels.npy")
    return np.stack([x[np.flatnonzero(y == c)[0]] for c in np.unique(y)])


def photo() -> np.ndarray:
    from PIL import Image
    from sklearn.datasets import load_sample_images

    image = Image.fromarray(load_sample_images().images[0])  # china.jpg
    return np.asarray(image.resize(PHOTO_SIZE, Image.LANCZOS))[None]


def release(records: np.ndarray, mechanism: str, noise: str | None, eps: float) -> tuple[np.ndarray | None, str]:
    """The released records and the cell's caption (the certified per-record figure), or
    None and the reason a run is refused."""
    from tldp_cli import UsageError, perturb_array

    try:
        out = perturb_array(records, eps=eps, mechanism=mechanism, noise=noise, budget="record",
                            seed=0, allow_weak_seed=True)
    except UsageError as exc:
        least = re.search(r"at least ([0-9.e+]+) per record", str(exc))
        return None, "refused:\n" + (f"certifies at least\n{least.group(1)} per record" if least else str(exc))
    k = f", k {out.calibration.privunit.k}" if mechanism == "privunit" else ""
    return np.asarray(out.array, np.float64), f"ε {out.accounting['per_record']['epsilon']:.3g}{k}"


def strip(records: np.ndarray) -> np.ndarray:
    """Records side by side, one pixel of white between them, as uint8."""
    pad = [(0, 0), (0, 1)] + [(0, 0)] * (records.ndim - 3)
    tiles = np.pad(np.clip(records, 0, 255), [(0, 0)] + pad, constant_values=255)
    return np.concatenate(list(tiles), axis=1)[:, :-1].astype(np.uint8)


def figure(records: np.ndarray, title: str, cell_inches: float) -> bytes:
    from matplotlib.figure import Figure

    columns = 1 + len(EPSILONS)
    h, w = strip(records).shape[:2]
    fig = Figure(figsize=(columns * cell_inches + 0.6, len(ROWS) * (cell_inches * h / w + 0.3) + 0.6), dpi=100)
    axes = fig.subplots(len(ROWS), columns, squeeze=False)
    grey = records.ndim == 3
    for r, (label, mechanism, noise) in enumerate(ROWS):
        cells = [(records.astype(np.float64), "raw")]
        cells += [release(records, mechanism, noise, eps) for eps in EPSILONS]
        for c, (values, caption) in enumerate(cells):
            ax = axes[r, c]
            ax.set_xticks([])
            ax.set_yticks([])
            if values is None:
                ax.text(0.5, 0.5, caption, ha="center", va="center", fontsize=7, transform=ax.transAxes)
            else:
                ax.imshow(strip(values), cmap="gray" if grey else None, vmin=0, vmax=255,
                          interpolation="nearest")
                ax.set_xlabel(caption, fontsize=7)
            if r == 0:
                ax.set_title("raw" if c == 0 else f"per-record ε {EPSILONS[c - 1]:g}", fontsize=8)
            if c == 0:
                ax.set_ylabel(label, fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "digits.png").write_bytes(
        figure(digits(), "four shipped MNIST training digits (28 × 28), each a record; --budget record", 1.9))
    (args.out / "photo.png").write_bytes(
        figure(photo(), "scikit-learn's china.jpg at 120 × 80 × 3, one record; --budget record", 1.9))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

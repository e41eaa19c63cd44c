"""The project's MNIST subset as the .npy files `tldp perturb` and `tldp evaluate` take.

sample_data/mnist-subset.npz holds 2000 MNIST training digits and 800 test digits of
classes 0, 1, 6 and 9 (uint8, 28 x 28; arrays x_train, y_train, x_test, y_test; 442 kB).
This writes them as train.npy, train_labels.npy, test.npy and test_labels.npy into --out,
for the per-record tables of docs/choosing-eps.md and docs/reproduction.md:

    python docs/choosing-eps/mnist.py --out docs/choosing-eps/mnist

The test digits are for measuring only: nothing in tldp (the privunit k rule included,
see docs/choosing-eps/k_rule.py) was chosen on them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
NAMES = {"x_train": "train.npy", "y_train": "train_labels.npy", "x_test": "test.npy",
         "y_test": "test_labels.npy"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with np.load(ROOT / "sample_data" / "mnist-subset.npz") as data:
        for key, name in NAMES.items():
            np.save(args.out / name, data[key])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

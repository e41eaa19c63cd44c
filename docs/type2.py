"""The paper's Type II setting at small scale: features in (-1, 1) from a network with tanh
activations, trained on clean data.

A scikit-learn MLPClassifier with one hidden layer of 64 tanh units is trained on the clean
shipped MNIST digits (sample_data/digits.npy, 400 digits of classes 0, 1, 6, 9, pixels / 256).
Its hidden layer is the feature extractor: tanh(x W + b) lies in (-1, 1), so the declared
range is -1:1 (Delta = 2). The script writes the features of the training and of the test
digits as .npy files (each record an 8 x 8 matrix, so that MVG applies too) with their
labels; `tldp sweep --range -1:1` then perturbs the training features and trains
the classifier (the network's last layer: a logistic regression on the features) on them,
testing on the clean test features (see docs/type2.md for the commands).

    python docs/type2.py --out docs/type2/features

Nothing is downloaded; it takes a few seconds.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
HIDDEN = 64  # features per record, stored as 8 x 8
SHAPE = (8, 8)
SEED = 0  # the network's initialisation and batches (not a privacy key)


def _digits(name: str) -> tuple[np.ndarray, np.ndarray]:
    data = ROOT / "sample_data"
    x = np.load(data / f"{name}.npy")
    return x.reshape(len(x), -1).astype(np.float64) / 256.0, np.load(data / f"{name}_labels.npy")


def extract(out: Path) -> dict:
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.metrics import f1_score
    from sklearn.neural_network import MLPClassifier

    x, y = _digits("digits")
    x_test, y_test = _digits("digits_test")
    net = MLPClassifier(hidden_layer_sizes=(HIDDEN,), activation="tanh", max_iter=300,
                        random_state=SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        net.fit(x, y)

    def features(a: np.ndarray) -> np.ndarray:
        hidden = np.tanh(a @ net.coefs_[0] + net.intercepts_[0])
        return hidden.astype(np.float32).reshape(len(a), *SHAPE)

    train, test = features(x), features(x_test)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "train.npy", train)
    np.save(out / "train_labels.npy", y)
    np.save(out / "test.npy", test)
    np.save(out / "test_labels.npy", y_test)
    info = {
        "network": f"MLPClassifier(hidden_layer_sizes=({HIDDEN},), activation='tanh', max_iter=300, "
                   f"random_state={SEED}) on pixels / 256",
        "train_records": int(len(train)), "test_records": int(len(test)),
        "features_per_record": HIDDEN, "record_shape": list(SHAPE), "declared_range": [-1, 1],
        "network_f1_on_test": round(float(f1_score(y_test, net.predict(x_test), average="weighted")), 6),
        "feature_min": round(float(min(train.min(), test.min())), 6),
        "feature_max": round(float(max(train.max(), test.max())), 6),
        "saturated_fraction": round(float((np.abs(train) > 0.99).mean()), 6),
    }
    (out / "features.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "type2" / "features")
    args = parser.parse_args(argv)
    info = extract(args.out)
    print(f"wrote {args.out}: {info['train_records']} + {info['test_records']} records of "
          f"{info['features_per_record']} features in [{info['feature_min']}, {info['feature_max']}]; "
          f"the network's own F1 on the test digits {info['network_f1_on_test']}")


if __name__ == "__main__":
    main()

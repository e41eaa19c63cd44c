"""The paper's Type III setting at small scale: federated training with perturbed parameters.

Three clients each hold a third of the shipped MNIST digits (sample_data/digits.npy,
400 digits of classes 0, 1, 6, 9). Every round each client starts from the global
model, trains a NumPy multinomial logistic regression on its own digits, clips its
parameters to [-C, C] and perturbs them with tldp's library API (tldp_cli.run.model_params:
the calibration, engine and accounting of `tldp perturb --clip`); the server averages
the perturbed parameters. The global model after the last round is scored on the 200
clean test digits (weighted F1, as the paper).

    python docs/type3.py --out docs/type3                 # type3.csv, type3.json, the plots, model.*
    python docs/type3.py --quick --out docs/type3/quick   # fewer points and seeds (the CI check)

Nothing is downloaded. Every noise draw is keyed by the seed number and the round and client,
so a rerun writes the same tables (numbers to 6 significant digits; no timings in them).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tldp_cli.privacy import mechanisms  # noqa: E402
from tldp_cli.run.model_params import calibrate_tensors, certify_tensors, perturb_tensors  # noqa: E402
from tldp_cli.sampling.rng import Streams  # noqa: E402

CLIENTS = 3
ROUNDS = 10
LOCAL_EPOCHS = 5
LEARNING_RATE = 0.5
L2 = 1e-3
CLIP = 0.1  # C: parameters are clipped to [-C, C], so the range width is 2C
DP_DELTA = 1e-5
ELEMENT_EPS = [0.1, 0.5, 1, 2, 5, 10]
RECORD_EPS = [1, 10, 100, 1000, 10000]
QUICK_ELEMENT_EPS = [1, 10]
QUICK_RECORD_EPS = [1000, 10000]
QUICK_METHODS = ("TLDP-L", "TLDP-G", "Laplace (baseline)", "Gaussian (baseline)")
SEEDS = 10
QUICK_SEEDS = 5
DIGITS = 6  # significant digits in the tables
METHODS = [("TLDP-L", "tldp", "laplace"), ("TLDP-G", "tldp", "gaussian"),
           ("Laplace (baseline)", "baseline", "laplace"), ("Gaussian (baseline)", "baseline", "gaussian")]
METHODS += [(name.upper(), name, "gaussian") for name in ("mvg", "idn") if name in mechanisms.MECHANISMS]


def load():
    data = ROOT / "sample_data"
    x = np.load(data / "digits.npy").reshape(400, -1) / 256.0  # scaled by the declared range 0:256
    y = np.load(data / "digits_labels.npy")
    x_test = np.load(data / "digits_test.npy").reshape(200, -1) / 256.0
    y_test = np.load(data / "digits_test_labels.npy")
    classes = np.unique(y)
    parts = np.array_split(np.random.default_rng(0).permutation(len(x)), CLIENTS)
    return x, y, x_test, y_test, classes, parts


def local_training(params, x, onehot):
    """Full-batch gradient descent on the softmax cross-entropy, from the global model."""
    w, b = params["weight"].astype(np.float64), params["bias"].astype(np.float64)
    for _ in range(LOCAL_EPOCHS):
        z = x @ w + b
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        g = (p - onehot) / len(x)
        w -= LEARNING_RATE * (x.T @ g + L2 * w)
        b -= LEARNING_RATE * g.sum(axis=0)
    return {"weight": w.astype(np.float32), "bias": b.astype(np.float32)}


def f1(params, x_test, y_test, classes) -> float:
    from sklearn.metrics import f1_score

    predicted = classes[(x_test @ params["weight"] + params["bias"]).argmax(axis=1)]
    return float(f1_score(y_test, predicted, average="weighted"))


def train(data, calibrations=None, clip_only=False, seed=0) -> tuple[float, dict]:
    """Federated averaging; each client's update perturbed (calibrations) or not.
    Returns the global model's F1 and the model."""
    x, y, x_test, y_test, classes, parts = data
    onehot = (y[:, None] == classes).astype(np.float64)
    # The bias is stored as a 1 x 4 matrix so that MVG (matrix records) applies to it too.
    params = {"weight": np.zeros((x.shape[1], len(classes)), np.float32),
              "bias": np.zeros((1, len(classes)), np.float32)}
    # reproducible (a weak seed: this is a demo); each release gets its own key below
    streams = Streams("secure", seed=seed, allow_weak_seed=True)
    for round_ in range(ROUNDS):
        updates = []
        for client, idx in enumerate(parts):
            update = local_training(params, x[idx], onehot[idx])
            if calibrations is not None:
                update = perturb_tensors(update, calibrations, streams=streams,
                                         key=f"round {round_}/client {client}")
            elif clip_only:
                update = {n: np.clip(v, -CLIP, CLIP) for n, v in update.items()}
            updates.append(update)
        params = {n: np.mean([u[n] for u in updates], axis=0) for n in params}
    return f1(params, x_test, y_test, classes), params


def figures(calibrations) -> dict:
    """Certified figures for one client: per element, per tensor, one round (the whole
    model), the whole training (every round)."""
    one = certify_tensors(calibrations)
    whole = certify_tensors(calibrations, releases=ROUNDS)
    weight = next(t for t in one["per_tensor"] if t["name"] == "weight")
    return {
        "element_epsilon": one["per_element"]["epsilon"],
        "weight_tensor_epsilon": weight["epsilon"],
        "round_epsilon": one["per_file"]["epsilon"], "round_delta": one["per_file"]["delta"],
        "training_epsilon": whole["per_file"]["epsilon"], "training_delta": whole["per_file"]["delta"],
        "training_rho": whole["per_file"]["rho"],
    }


def save_model(params: dict, classes, path: Path) -> None:
    """The non-private global model, a sample input for `tldp perturb --clip`: as
    .safetensors (with metadata) and as .npz."""
    from safetensors.numpy import save_file

    tensors = {"weight": params["weight"], "bias": params["bias"].astype(np.float16),
               "rounds": np.array([ROUNDS], np.int64)}
    save_file(tensors, str(path), metadata={
        "model": "multinomial logistic regression on pixels / 256",
        "classes": ",".join(str(c) for c in classes), "trained_by": "docs/type3.py"})
    np.savez(path.with_suffix(".npz"), **tensors)


def _rounded(value):
    return float(f"{value:.{DIGITS}g}") if isinstance(value, float) and np.isfinite(value) else value


def run(seeds: int, out: Path, quick: bool = False) -> dict:
    data = load()
    shapes = {"weight": (data[0].shape[1], len(data[4])), "bias": (1, len(data[4]))}
    f1_clean, model = train(data)
    if not quick:
        save_model(model, data[4], out / "model.safetensors")
    reference = {"f1_clean": f1_clean, "f1_clipped": train(data, clip_only=True)[0]}
    grids = (("element", QUICK_ELEMENT_EPS), ("record", QUICK_RECORD_EPS)) if quick else \
        (("element", ELEMENT_EPS), ("record", RECORD_EPS))
    rows = []
    for budget, grid in grids:
        for label, mechanism, noise in methods(quick):
            for eps in grid:
                calibrations = calibrate_tensors(shapes, epsilon=eps, clip=CLIP, noise=noise,
                                                 mechanism=mechanism, budget=budget, dp_delta=DP_DELTA)
                scores = [train(data, calibrations, seed=s)[0] for s in range(seeds)]
                rows.append({"budget": budget, "method": label, "epsilon": eps,
                             "f1_mean": float(np.mean(scores)),
                             "f1_std": float(np.std(scores, ddof=1)) if seeds > 1 else 0.0,
                             "f1_min": min(scores), "f1_max": max(scores), **figures(calibrations)})
    rows = [{k: _rounded(v) for k, v in row.items()} for row in rows]
    return {"setting": {"clients": CLIENTS, "rounds": ROUNDS, "local_epochs": LOCAL_EPOCHS,
                        "learning_rate": LEARNING_RATE, "l2": L2, "clip": CLIP, "dp_delta": DP_DELTA,
                        "parameters": {n: list(s) for n, s in shapes.items()}, "noise_seeds": seeds,
                        "f1_std": "sample standard deviation over the noise seeds", "quick": quick},
            "reference": {k: _rounded(v) for k, v in reference.items()}, "rows": rows}


def methods(quick: bool) -> list:
    return [m for m in METHODS if not quick or m[0] in QUICK_METHODS]


def plot(result: dict, budget: str, x_key: str, x_label: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, _, _ in methods(result["setting"]["quick"]):
        rows = [r for r in result["rows"] if r["budget"] == budget and r["method"] == label]
        ax.errorbar([r[x_key] for r in rows], [r["f1_mean"] for r in rows],
                    yerr=[r["f1_std"] for r in rows], marker="o", capsize=3, label=label)
    ref = result["reference"]
    ax.axhline(ref["f1_clean"], color="k", ls="--", lw=1, label="no noise")
    ax.axhline(ref["f1_clipped"], color="gray", ls=":", lw=1, label=f"clipped to ±{CLIP}, no noise")
    ax.set_xscale("log")
    ax.set_xlabel(x_label)
    ax.set_ylabel("weighted F1 of the global model")
    ax.set_ylim(0, 1)
    ax.set_title(f"Type III: {CLIENTS} clients, {ROUNDS} rounds, MNIST digits 0/1/6/9", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "type3")
    parser.add_argument("--quick", action="store_true",
                        help=f"{len(QUICK_METHODS)} methods, eps {QUICK_ELEMENT_EPS} per element and "
                             f"{QUICK_RECORD_EPS} per tensor, {QUICK_SEEDS} seeds")
    parser.add_argument("--seeds", type=int, default=None,
                        help=f"noise seeds per point (default {SEEDS}, --quick {QUICK_SEEDS})")
    args = parser.parse_args()
    start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    seeds = args.seeds or (QUICK_SEEDS if args.quick else SEEDS)
    result = run(seeds, args.out, args.quick)
    seconds = round(time.time() - start, 1)
    (args.out / "type3.json").write_text(json.dumps(result, indent=2) + "\n")
    with open(args.out / "type3.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(result["rows"][0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(result["rows"])
    plot(result, "element", "epsilon", "ε per element (the paper's calibration)",
         args.out / "f1_element_eps.png")
    plot(result, "element", "training_epsilon", "certified ε per client, whole training",
         args.out / "f1_element_certified.png")
    plot(result, "record", "training_epsilon", "certified ε per client, whole training (ε per tensor = "
         "--budget record)", args.out / "f1_record_certified.png")
    print(f"wrote {args.out} in {seconds} s; clean F1 {result['reference']['f1_clean']:.3f}")


if __name__ == "__main__":
    main()

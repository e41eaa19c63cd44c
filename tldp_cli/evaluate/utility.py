"""Task utility, the paper's Type I comparison: train a classifier (scikit-learn) on
perturbed records, test it on clean ones, weighted F1; and the records and labels it
reads."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tldp_cli import formats
from tldp_cli.errors import InputError, MissingExtra, UsageError, reason_of
from tldp_cli.formats import FormatOptions

MODELS = ("logistic", "mlp")


def load_records(path: Path, dataset: str | None = None, input_format: str | None = None) -> np.ndarray:
    """Every record of a dataset tldp can read, in memory (records along axis 0).

    Image folders are stacked in the readers' order (sorted relative paths); they
    must share one shape. HDF5/Zarr inputs with several arrays need `dataset`.
    """
    path = Path(path)
    module = formats.detect(path, input_format)
    with _no_skip_bad():
        reader = module.open_reader(path, FormatOptions(datasets=[dataset] if dataset else []))
    try:
        jobs = reader.arrays()
        if module.records_are_files:
            shapes = {j.shape for j in jobs}
            if len(shapes) > 1:
                raise InputError(f"{path}: the images have different shapes; cannot stack them")
            with _no_skip_bad():
                return np.concatenate([j.read(0, 1) for j in jobs])
        if len(jobs) > 1:
            names = ", ".join(j.name for j in jobs)
            if not module.selects_arrays:  # --dataset would be refused: say what works instead
                raise UsageError(f"{path}: holds several arrays ({names}), and --dataset, which would "
                                 f"choose one, does not apply to {module.title}; save the records as one "
                                 ".npy array to sweep or score them")
            raise UsageError(f"{path}: holds several arrays ({names}); name one with --dataset")
        return jobs[0].read(0, jobs[0].records)
    finally:
        reader.close()


@contextlib.contextmanager
def _no_skip_bad() -> Iterator[None]:
    """An image folder's error on an image it cannot decode advises --skip-bad, which
    evaluate and sweep do not take: theirs says what to do instead."""
    try:
        yield
    except InputError as exc:
        text = str(exc)
        if not text.endswith(formats.SKIP_BAD_HINT):
            raise
        raise InputError(text[: -len(formats.SKIP_BAD_HINT)] + "; this command reads every image: "
                         "replace it or move it out of the folder") from None


LABELS_FROM_FOLDERS = "subfolders"
LABELS_DATASET_PREFIX = "dataset="


def load_labels(spec: Path | str, data: Path | None = None, option: str = "--labels") -> np.ndarray:
    """Class labels, one per record of `data`, in the order tldp reads the records.

    `spec` is a 1-D array file (.npy, or an HDF5/Zarr file holding one array),
    "dataset=NAME" for the array NAME inside `data` (HDF5/Zarr), or "subfolders"
    for the name of the top-level subfolder each image of the folder `data` is in.
    """
    text = str(spec)
    if text == LABELS_FROM_FOLDERS:
        return _folder_labels(data, option)
    if text.startswith(LABELS_DATASET_PREFIX):
        name = text[len(LABELS_DATASET_PREFIX):]
        if not name:
            raise UsageError(f"{option} dataset=NAME needs the name of an array")
        if data is None or not formats.detect(Path(data)).shares_rows:
            raise UsageError(f"{option} {text}: {data} is not an HDF5 file or Zarr store")
        labels, where = load_records(Path(data), name), f"{data}: dataset {name}"
    else:
        path = Path(spec)
        if not path.exists():
            raise InputError(f"{path}: no such file or directory")
        where = str(path)
        if path.suffix == ".npy":
            try:
                labels = np.load(path, allow_pickle=False)
            except Exception as exc:
                raise InputError(f"{path}: not a readable .npy array ({reason_of(exc)})") from None
        else:
            labels = load_records(path)
    if labels.ndim != 1:
        raise InputError(f"{where}: labels must be a 1-D array, not shape {labels.shape}")
    return labels


def _folder_labels(data: Path | None, option: str) -> np.ndarray:
    if data is None or not formats.detect(Path(data)).records_are_files:
        raise UsageError(f"{option} subfolders: {data} is not a folder of images")
    with _no_skip_bad():
        reader = formats.detect(Path(data)).open_reader(Path(data), FormatOptions())
    try:
        return folder_labels([job.name for job in reader.arrays()], Path(data))
    finally:
        reader.close()


def folder_labels(names: list[str], folder: Path) -> np.ndarray:
    """The top-level subfolder of each image path (relative to `folder`)."""
    labels = []
    for name in names:
        parts = Path(name).parts
        if len(parts) < 2:
            raise InputError(f"{folder / name}: not inside a subfolder, so it has no label "
                             "(labels from subfolders need every image in one)")
        labels.append(parts[0])
    return np.array(labels)


# What each library of the eval extra is needed for, and its name on the package index.
_EVAL_LIBRARIES = {"sklearn": ("task utility (--labels)", "scikit-learn"),
                   "matplotlib": ("the sweep's plots", "matplotlib")}


def need(module: str, load: bool = True):
    """`module`, imported; or, with load=False, only found (a command's check before its work,
    which imports nothing heavy: tests/cli/test_startup.py). MissingExtra where it is not installed."""
    import importlib
    import importlib.util

    top = module.split(".")[0]
    try:
        if not load:
            if importlib.util.find_spec(top) is None:
                raise ImportError(top)
            return None
        return importlib.import_module(module)
    except ImportError:
        what, library = _EVAL_LIBRARIES.get(top, ("this", top))
        raise MissingExtra(what, library, "eval") from None


def _classifier(model: str):
    need("sklearn")
    if model == "logistic":
        from sklearn.linear_model import LogisticRegression

        return LogisticRegression(max_iter=300)
    if model == "mlp":
        from sklearn.neural_network import MLPClassifier

        return MLPClassifier(hidden_layer_sizes=(128,), max_iter=200, random_state=0)
    raise UsageError(f"--model must be one of {', '.join(MODELS)}, not {model!r}")


def weighted_f1(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray,
                model: str, value_range: tuple[float, float]) -> float:
    """Fit `model` on train, return the weighted F1 on test (the paper's formula).

    Features are the flattened records scaled by the declared range, (x - lo) / width,
    the same map for training and test: nothing is fitted on the test data.
    """
    need("sklearn")  # before the first import from it: the install hint, not a traceback
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.metrics import f1_score

    lo, hi = value_range

    def features(x):
        return (np.asarray(x, np.float64).reshape(len(x), -1) - lo) / (hi - lo)

    clf = _classifier(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        clf.fit(features(train_x), train_y)
        predicted = clf.predict(features(test_x))
    return float(f1_score(test_y, predicted, average="weighted"))


def check_task_options(labels, test, test_labels, model: str) -> None:
    """What evaluate and sweep refuse before reading any data: a task given in part (labels,
    test records and test labels go together), a model tldp does not know, a task without
    scikit-learn (the eval extra), which would otherwise fail once every check had run."""
    if any((labels, test, test_labels)) and not all((labels, test, test_labels)):
        raise UsageError("task utility needs all of --labels, --test and --test-labels")
    if model not in MODELS:
        raise UsageError(f"--model must be one of {', '.join(MODELS)}, not {model!r}")
    if labels:
        need("sklearn")


def check_task(train_records: int, labels: np.ndarray, test_x: np.ndarray, test_y: np.ndarray,
                record_shape: tuple[int, ...], labels_path, test_path) -> None:
    if len(labels) != train_records:
        raise UsageError(f"{labels_path}: {len(labels)} labels for {train_records} records")
    if len(test_y) != len(test_x):
        raise UsageError(f"{test_path}: {len(test_x)} test records but {len(test_y)} test labels")
    if tuple(test_x.shape[1:]) != tuple(record_shape):
        raise UsageError(f"{test_path}: test records have shape {tuple(test_x.shape[1:])}, "
                         f"the training records {tuple(record_shape)}")


def task_utility(clean: np.ndarray, perturbed: np.ndarray, labels: np.ndarray, test_x: np.ndarray,
                 test_y: np.ndarray, model: str, value_range: tuple[float, float]) -> dict:
    """The paper's Type I metric: train on perturbed records, test on clean ones."""
    t0 = time.perf_counter()
    f1_perturbed = weighted_f1(perturbed, labels, test_x, test_y, model, value_range)
    f1_clean = weighted_f1(clean, labels, test_x, test_y, model, value_range)
    classes = np.unique(test_y)
    return {"model": model, "metric": "weighted F1 (sklearn f1_score, average='weighted')",
            "f1_perturbed": f1_perturbed, "f1_clean": f1_clean,
            "f1_majority_class": majority_f1(test_y),
            "train_records": int(len(labels)), "test_records": int(len(test_y)),
            "classes": [c.item() for c in classes], "seconds": time.perf_counter() - t0}


def majority_f1(test_y: np.ndarray) -> float:
    """Weighted F1 of always predicting the most frequent class: a chance reference."""
    need("sklearn")
    from sklearn.metrics import f1_score

    classes, counts = np.unique(test_y, return_counts=True)
    return float(f1_score(test_y, np.full_like(test_y, classes[counts.argmax()]), average="weighted",
                          zero_division=0))


"""The release ledger: one SQLite file, kept with the raw data, that counts every release
of the same data and caps what they spend together.

Each release of an input is recorded with the input's keyed fingerprint (HMAC-SHA256
of its arrays' shapes, dtypes and bytes, under a random key that lives in the ledger
only: a copy of the data at another path has the same fingerprint; without the ledger
the fingerprint confirms no guess about the data), its options and its certified
figures. Before anything is written, a run composes its figures with the earlier
releases of the same data and refuses to pass a cap.

Crash safety without undercounting: the check and a *pending* record are one
transaction (BEGIN IMMEDIATE), committed before the output is written, so two
concurrent runs cannot both pass a cap. The record becomes *complete* once the output
is in place; a run that fails deletes its pending record; a run killed in between
leaves it pending, and pending releases count as spent (the output may be in place).

Composition per record: pure epsilons and deltas add (basic composition, valid for
every release); when every release states a zCDP rho, rho adds too and the epsilon
of the summed rho (the RDP bound, valid for continuous and discrete Gaussian noise)
plus the kept values' deltas is used where it is smaller. That epsilon is stated at
the smallest --dp-delta of the releases: a release with a larger one cannot trade the
earlier releases' delta for a smaller epsilon under an epsilon cap.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import json
import os
import secrets
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from tldp_cli.privacy import accounting
from tldp_cli.errors import InputError, TldpError, UsageError, reason_of

SCHEMA_VERSION = 1
_BUSY_MS = 60_000  # a concurrent run holds the write lock for milliseconds

_TABLES = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS releases (
    id INTEGER PRIMARY KEY,
    fingerprint TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'complete')),
    created TEXT NOT NULL,
    input TEXT NOT NULL,
    output TEXT NOT NULL,
    options TEXT NOT NULL,
    figures TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS releases_by_data ON releases (fingerprint);
"""


CAP_ROUNDING = 1e-9  # relative: sums of figures that meet a cap exactly may round above it


class LedgerError(TldpError):
    """The ledger refuses a release (a cap) or cannot be used."""


@dataclass(frozen=True)
class Spent:
    releases: int
    pending: int
    epsilon: float
    delta: float

    def describe(self) -> str:
        pending = (f", {self.pending} of them pending (a run in progress, or one that was killed)"
                   if self.pending else "")
        return (f"{self.releases} release{'s' if self.releases != 1 else ''}{pending}: "
                f"each record (eps={self.epsilon:.4g}, delta={self.delta:.3g})")


def open_ledger(path: Path) -> sqlite3.Connection:
    """Opens (creating) the ledger; refuses one of a newer schema or not a ledger."""
    try:
        db = sqlite3.connect(path, timeout=_BUSY_MS / 1000, isolation_level=None)
        db.execute(f"PRAGMA busy_timeout = {_BUSY_MS}")
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = FULL")
        db.executescript(_TABLES)  # idempotent (IF NOT EXISTS)
        db.execute("BEGIN IMMEDIATE")
        version = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if version is None:
            db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            db.execute("INSERT INTO meta VALUES ('fingerprint_key', ?)", (secrets.token_hex(32),))
        db.execute("COMMIT")
    except sqlite3.DatabaseError as exc:
        for needed in (path, path.parent):  # SQLite says "unable to open database file" for both
            if needed.exists() and not os.access(needed, os.R_OK | os.W_OK):
                raise InputError(f"{path}: cannot open the ledger (permission denied on {needed})") from None
        raise InputError(f"{path}: not a tldp ledger ({reason_of(exc)})") from None
    if int(version[0] if version else SCHEMA_VERSION) > SCHEMA_VERSION:
        db.close()
        raise UsageError(f"{path}: the ledger was written by a newer tldp (schema {version[0]}, this "
                         f"one reads {SCHEMA_VERSION}); use that tldp")
    return db


def fingerprint(db: sqlite3.Connection, arrays: Iterable[tuple[tuple[int, ...], str, Iterable[bytes]]]) -> str:
    """HMAC-SHA256, under the ledger's key, of each array's shape, dtype and bytes in order."""
    key = bytes.fromhex(db.execute("SELECT value FROM meta WHERE key = 'fingerprint_key'").fetchone()[0])
    mac = hmac.new(key, b"tldp-ledger-fingerprint/1", hashlib.sha256)
    for shape, dtype, blocks in arrays:
        mac.update(json.dumps([list(shape), dtype]).encode())
        for block in blocks:
            mac.update(block)
    return mac.hexdigest()


def spent(db: sqlite3.Connection, data: str, extra: list[dict[str, Any]] = (), dp_delta: float = 1e-5) -> Spent:
    """What the releases of `data` (and `extra` figures) spend together, per record."""
    rows = db.execute("SELECT status, figures, options FROM releases WHERE fingerprint = ?", (data,)).fetchall()
    figures = [json.loads(f)["per_record"] for _, f, _ in rows] + [f["per_record"] for f in extra]
    stated = [json.loads(o).get("--dp-delta", dp_delta) for _, _, o in rows]
    epsilon, delta = compose_records(figures, min([dp_delta, *stated]))
    return Spent(len(figures), sum(1 for status, _, _ in rows if status == "pending"), epsilon, delta)


def compose_records(scopes: list[dict[str, Any]], dp_delta: float) -> tuple[float, float]:
    """(epsilon, delta) of several releases' per-record scopes together (module docstring)."""
    if not scopes:
        return 0.0, 0.0
    basic = (sum(s["epsilon"] for s in scopes), min(1.0, sum(s["delta"] for s in scopes)))
    if any(s.get("rho") is None for s in scopes):
        return basic
    rho = sum(s["rho"] for s in scopes)
    kept = sum(s.get("point_mass_delta") or 0.0 for s in scopes)
    by_rho = (accounting.discrete_gaussian_rdp_epsilon(rho, dp_delta), min(1.0, dp_delta + kept))
    return by_rho if by_rho[0] < basic[0] else basic


def begin(db: sqlite3.Connection, data: str, figures: dict[str, Any], *, input: str, output: str,
          options: dict[str, Any], max_epsilon: float | None, max_delta: float | None,
          dp_delta: float) -> tuple[int, Spent]:
    """Checks the caps with this release included and records it as pending, in one
    transaction; returns its id and what all releases spend with it."""
    db.execute("BEGIN IMMEDIATE")
    try:
        before = spent(db, data, dp_delta=dp_delta)
        after = spent(db, data, [figures], dp_delta)
        over = []
        # Within floating-point rounding of the cap is at the cap: 0.1 + 0.1 + 0.1 is a hair
        # above 0.3, and three releases of 0.1 meet a cap of 0.3.
        if max_epsilon is not None and after.epsilon > max_epsilon * (1 + CAP_ROUNDING):
            over.append(f"eps {after.epsilon:.4g} > --max-record-eps {max_epsilon:g}")
        if max_delta is not None and after.delta > max_delta * (1 + CAP_ROUNDING):
            over.append(f"delta {after.delta:.3g} > --max-record-delta {max_delta:g}")
        if over:
            left = "" if max_epsilon is None else f"; eps left under the cap: {max(0.0, max_epsilon - before.epsilon):.4g}"
            raise LedgerError(f"the ledger refuses this release: with it, this data's releases would "
                              f"spend {', '.join(over)} per record (spent so far: {before.describe()}"
                              f"{left}); nothing was written")
        created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        cursor = db.execute(
            "INSERT INTO releases (fingerprint, status, created, input, output, options, figures) "
            "VALUES (?, 'pending', ?, ?, ?, ?, ?)",
            (data, created, input, output, json.dumps(options, default=str), json.dumps(figures)))
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    return cursor.lastrowid, after


def complete(db: sqlite3.Connection, release: int) -> None:
    db.execute("UPDATE releases SET status = 'complete' WHERE id = ?", (release,))


def abandon(db: sqlite3.Connection, release: int) -> None:
    """The run failed before its output was in place: it released nothing."""
    db.execute("DELETE FROM releases WHERE id = ? AND status = 'pending'", (release,))


def listing(path: Path) -> dict[str, Any]:
    """Every dataset of the ledger (by fingerprint), its releases and what they spend."""
    if not path.is_file():
        raise InputError(f"{path}: no such ledger")
    db = open_ledger(path)
    try:
        rows = db.execute("SELECT id, fingerprint, status, created, input, output, options, figures "
                          "FROM releases ORDER BY id").fetchall()
        datasets: dict[str, dict[str, Any]] = {}
        for rid, data, status, created, input, output, options, figures in rows:
            entry = datasets.setdefault(data, {"fingerprint": data, "releases": []})
            figures = json.loads(figures)
            entry["releases"].append({"id": rid, "status": status, "created": created, "input": input,
                                      "output": output, "options": json.loads(options),
                                      "per_element": figures["per_element"], "per_record": figures["per_record"],
                                      "per_file": figures.get("per_file")})
        for data, entry in datasets.items():
            dp_delta = min(r["options"].get("--dp-delta", 1e-5) for r in entry["releases"])
            total = spent(db, data, dp_delta=dp_delta)
            entry["cumulative_per_record"] = {"epsilon": total.epsilon, "delta": total.delta,
                                              "releases": total.releases, "pending": total.pending}
        return {"schema": "tldp-ledger/1", "ledger": str(path), "datasets": list(datasets.values())}
    finally:
        db.close()

"""The release ledger: one SQLite file, kept with the raw data, that counts every release
of the same subjects and caps what they spend together.

Subjects, not files. Each record (row along axis 0) of every array a release reads is
known by a keyed fingerprint of its content: BLAKE2b under a random key that lives in the
ledger only, of the record's dtype and flattened bytes (so (50, 8, 8) and (50, 64) have
the same records; any changed value is another record). The records of one row of a row
group (arrays that share axis 0: row i of each is subject i) are linked, and so are
records linked through any other release: a subject is a connected set of records, and
the fingerprints it holds in any file reach it. A release is charged once to every
subject it touches; what a subject spends composes every release charged to it. Linking
only ever merges subjects: a merge over-charges (equal records of different people, a
label shared by thousands of rows). The one charge per release under-charges a release
that holds several records of one subject (duplicate rows; a row group's rows released
as records of their own): each record spends the release's per-record figure, and the
ledger counts it once (docs/plan-and-ledger.md).

Storage: `records` maps each fingerprint (64 bits: a collision merges two subjects,
which over-charges) to its subject, `subjects` each subject to its history, and
`histories` a history to the set of releases charged to it (subjects with the same
releases share one history, so a release updates a few histories, not one row per
release and record). Releases recorded by the schema-1 ledger (one fingerprint per file)
are upgraded as charged to every subject.

Crash safety without undercounting: the check and a *pending* record are one
transaction (BEGIN IMMEDIATE), committed before the output is written, so two
concurrent runs cannot both pass a cap. The record becomes *complete* once the output
is in place; a run that fails deletes its pending record (its links stay: they are facts
about the data, and only over-charge); a run killed in between leaves it pending, and
pending releases count as spent (the output may be in place).

The figures of several releases together come from accounting.compose_releases.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import hashlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

from tldp_cli.errors import InputError, TldpError, UsageError, reason_of
from tldp_cli.files import output
from tldp_cli.privacy.certificates import Guarantee
from tldp_cli.run import manifest

if TYPE_CHECKING:  # imported where used: a run without --ledger imports no SQLite
    import sqlite3

SCHEMA_VERSION = 2
_BUSY_MS = 60_000  # a concurrent run holds the write lock for milliseconds
_CACHE_KB = 64 << 10  # SQLite's page cache, at most (its default, 2 MB, thrashes past 10^5 records)
_DEFAULT_DP_DELTA = 1e-5  # a schema-1 release that did not record its --dp-delta

_TABLES = """
CREATE TABLE releases (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: histories name releases by id
    status TEXT NOT NULL CHECK (status IN ('pending', 'complete')),
    created TEXT NOT NULL,
    input TEXT NOT NULL,
    output TEXT NOT NULL,
    options TEXT NOT NULL,
    figures TEXT NOT NULL,
    subjects INTEGER,  -- how many subjects it touched (NULL: recorded by schema 1)
    everyone INTEGER NOT NULL DEFAULT 0  -- 1: charged to every subject (schema 1)
);
CREATE TABLE histories (id INTEGER PRIMARY KEY, releases TEXT NOT NULL UNIQUE);
CREATE TABLE subjects (id INTEGER PRIMARY KEY, history INTEGER NOT NULL);
CREATE TABLE records (fingerprint INTEGER PRIMARY KEY, subject INTEGER NOT NULL);
"""


CAP_ROUNDING = 1e-9  # relative: sums of figures that meet a cap exactly may round above it


class LedgerError(TldpError):
    """The ledger refuses a release (a cap) or cannot be used."""


@dataclass(frozen=True)
class Spent:
    """What the releases charged to one subject spend together, per record."""

    releases: int
    pending: int
    epsilon: float
    delta: float
    scope: str = "each record"  # "whole file": a model file's subject (charged_scope)

    def describe(self) -> str:
        pending = (f", {self.pending} of them pending (a run in progress, or one that was killed)"
                   if self.pending else "")
        return (f"{self.releases} release{'s' if self.releases != 1 else ''}{pending}: "
                f"{self.scope} (eps={self.epsilon:.4g}, delta={self.delta:.3g})")


def open_ledger(path: Path) -> sqlite3.Connection:
    """Opens (creating) the ledger, upgrading one of schema 1; refuses one of a newer
    schema or not a ledger: an SQLite database of other tables (another program's) is left
    as it is, never made a ledger (its journal mode included). A new ledger is created
    readable by its owner only: it can test whether a record is in the raw data (SQLite
    gives its journals the same mode)."""
    import sqlite3

    if not os.path.lexists(path):
        with contextlib.suppress(OSError):  # another run made it; or sqlite3 says why it cannot
            output.create_private(path).close()
    try:
        db = sqlite3.connect(path, timeout=_BUSY_MS / 1000, isolation_level=None)
        db.execute(f"PRAGMA busy_timeout = {_BUSY_MS}")
        tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if tables and not {"meta", "releases"} <= tables:
            db.close()
            raise InputError(f"{path}: not a tldp ledger (an SQLite database of other tables: "
                             f"{', '.join(sorted(tables)[:3])}{', ...' if len(tables) > 3 else ''}); "
                             "give a new file or one perturb --ledger wrote")
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = FULL")
        db.execute(f"PRAGMA cache_size = {-_CACHE_KB}")
        db.execute("BEGIN IMMEDIATE")
        db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        version = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if version is None:
            _create_tables(db)
            db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            db.execute("INSERT INTO meta VALUES ('fingerprint_key', ?)", (secrets.token_hex(32),))
        elif int(version[0]) == 1:
            _upgrade_from_1(db)
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


def _create_tables(db: sqlite3.Connection) -> None:
    for statement in _TABLES.split(";"):  # executescript would commit the open transaction
        if statement.strip():
            db.execute(statement)


def _upgrade_from_1(db: sqlite3.Connection) -> None:
    """Schema 1 kept one fingerprint per file, not its records: which subjects its releases
    touched is unknown, so each is charged to every subject (over-counting, never under)."""
    db.execute("ALTER TABLE releases RENAME TO releases_schema_1")
    _create_tables(db)
    db.execute("INSERT INTO releases (id, status, created, input, output, options, figures, everyone) "
               "SELECT id, status, created, input, output, options, figures, 1 FROM releases_schema_1")
    db.execute("DROP TABLE releases_schema_1")
    db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))


class Fingerprints:
    """The keyed fingerprint of each record of an array: 64 bits of BLAKE2b, under the
    ledger's key, of the record's dtype and flattened bytes (little-endian)."""

    def __init__(self, db: sqlite3.Connection):
        self.key = bytes.fromhex(db.execute("SELECT value FROM meta WHERE key = 'fingerprint_key'").fetchone()[0])

    def _base(self, dtype: np.dtype):
        return hashlib.blake2b(dtype.name.encode() + b"\0", key=self.key, digest_size=8, person=b"tldp-record/2")

    @staticmethod
    def _little(values: np.ndarray) -> np.ndarray:
        """Big-endian, stored or native: the same values, the same record."""
        little = values.dtype.newbyteorder("<")
        return values if values.dtype == little else values.astype(little)

    def of_parts(self, parts: Iterable[np.ndarray]) -> int:
        """The fingerprint of one record read in parts (ArrayJob.read_parts: its values flat, in
        order), as of_rows gives it: a tensor fingerprinted in flat memory."""
        mac = None
        for part in parts:
            values = self._little(np.ascontiguousarray(part).reshape(-1))
            mac = mac or self._base(values.dtype)
            mac.update(values.data)
        if mac is None:
            raise ValueError("a record read in parts has at least one part")
        return int(np.frombuffer(mac.digest(), dtype="<i8")[0])

    def of_rows(self, block: np.ndarray) -> np.ndarray:
        """The fingerprints (int64) of a block's records, one per index of axis 0."""
        rows = self._little(np.ascontiguousarray(block).reshape(len(block), -1))
        base = self._base(rows.dtype)
        digests = bytearray()
        for row in rows:
            mac = base.copy()
            mac.update(row.data)  # (a contiguous row: .data is its memoryview)
            digests += mac.digest()
        return np.frombuffer(bytes(digests), dtype="<i8").astype(np.int64)

    def of_array(self, blocks: Iterable[np.ndarray]) -> np.ndarray:
        parts = [self.of_rows(block) for block in blocks]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


@dataclass(frozen=True)
class _Release:
    per_record: Guarantee
    dp_delta: float
    pending: bool
    everyone: bool


def charged_scope(figures: dict[str, Any]) -> dict[str, Any]:
    """The scope of a release's figures charged to each subject it touches: its `charged`
    one (manifest.ledger_figures: per_file for a model file, whose tensors are one party's),
    per_record where a release recorded before it was stated."""
    return figures[figures.get("charged", "per_record")]


def _releases(db: sqlite3.Connection) -> dict[int, _Release]:
    rows = db.execute("SELECT id, status, options, figures, everyone FROM releases").fetchall()
    return {rid: _Release(manifest.guarantee_of(charged_scope(json.loads(figures))),
                          json.loads(options).get("--dp-delta", _DEFAULT_DP_DELTA), status == "pending",
                          bool(everyone)) for rid, status, options, figures, everyone in rows}


def _spent(ids: Iterable[int], releases: dict[int, _Release], new: _Release | None = None) -> Spent:
    """What the releases `ids` (those still recorded) and those charged to every subject
    spend together, with `new` (a release being checked) if given."""
    charged = [releases[i] for i in sorted({*ids, *(i for i, r in releases.items() if r.everyone)})
               if i in releases] + ([new] if new else [])
    from tldp_cli.privacy import accounting  # here: a run's early refusals never import it

    epsilon, delta = accounting.compose_releases([(r.per_record, r.dp_delta) for r in charged])
    return Spent(len(charged), sum(r.pending for r in charged), epsilon, delta)


@dataclass
class _Touched:
    """The subjects a release touches (0..count-1): the connected sets of its records'
    fingerprints, the rows that hold them and the recorded subjects they reach."""

    fingerprints: np.ndarray  # every fingerprint it holds, sorted, unique
    known: np.ndarray  # the recorded subject of each, -1 for a new one
    component: np.ndarray  # the subject each fingerprint belongs to now
    count: int
    subject: np.ndarray  # each subject's recorded id (the smallest it joins), -1 for a new one
    history: np.ndarray  # each subject's recorded history; -1: new; -2: it joins several (`several`)
    merges: dict[int, list[int]]  # a subject that joins several recorded ones -> their ids, smallest first
    several: dict[int, list[int]]  # a subject that joins recorded ones of several histories -> those


def _touched(db: sqlite3.Connection, groups: list[np.ndarray]) -> _Touched:
    """Links the rows of each group (an array (k, n): the fingerprints of k arrays that share
    n rows) to each other and to the recorded subjects their fingerprints belong to."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    rows = sum(g.shape[1] for g in groups)
    offsets = np.cumsum([0] + [g.shape[1] for g in groups])
    row_of = np.concatenate([np.broadcast_to(offsets[i] + np.arange(g.shape[1]), g.shape).ravel()
                             for i, g in enumerate(groups)])
    fingerprints, inverse = np.unique(np.concatenate([g.ravel() for g in groups]), return_inverse=True)
    known, histories = _recorded(db, fingerprints)
    olds, first, old_index = np.unique(known[known >= 0], return_index=True, return_inverse=True)
    nodes = rows + len(fingerprints) + len(olds)
    source = np.concatenate([row_of, rows + np.flatnonzero(known >= 0)])
    target = np.concatenate([rows + inverse.ravel(), rows + len(fingerprints) + old_index])
    graph = coo_matrix((np.ones(len(source), np.int8), (source, target)), shape=(nodes, nodes))
    count, labels = connected_components(graph, directed=False)
    touched = _Touched(fingerprints, known, labels[rows:rows + len(fingerprints)], count,
                       np.full(count, -1, np.int64), np.full(count, -1, np.int64), {}, {})
    _join(touched, olds, labels[rows + len(fingerprints):], histories[known >= 0][first])
    return touched


def _join(touched: _Touched, olds: np.ndarray, label: np.ndarray, history: np.ndarray) -> None:
    """Each subject's recorded subjects (`olds`, sorted, in subject `label`) and histories."""
    labels, first, per_label = np.unique(label, return_index=True, return_counts=True)
    touched.subject[labels] = olds[first]  # olds are sorted: the smallest id of each
    touched.history[labels] = history[first]
    for joined in labels[per_label > 1].tolist():  # rare: a new link between recorded subjects
        at = np.flatnonzero(label == joined)
        touched.merges[joined] = olds[at].tolist()
        if len(set(history[at].tolist())) > 1:
            touched.several[joined] = sorted(set(history[at].tolist()))
            touched.history[joined] = -2


def _recorded(db: sqlite3.Connection, fingerprints: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The recorded subject of each fingerprint (-1: none) and that subject's history.
    Leaves the fingerprints in the temporary table `seen` for _charge."""
    db.execute("CREATE TEMP TABLE IF NOT EXISTS seen (fingerprint INTEGER PRIMARY KEY)")
    db.execute("DELETE FROM seen")
    db.executemany("INSERT INTO seen VALUES (?)", _rows(fingerprints))
    known = np.full(len(fingerprints), -1, np.int64)
    history = np.full(len(fingerprints), -1, np.int64)
    cursor = db.execute("SELECT r.fingerprint, r.subject, s.history FROM seen JOIN records r USING (fingerprint) "
                        "JOIN subjects s ON s.id = r.subject")
    while found := cursor.fetchmany(1 << 16):  # in slices: a million tuples would take 200 MB
        columns = np.array(found, np.int64)
        at = np.searchsorted(fingerprints, columns[:, 0])
        known[at], history[at] = columns[:, 1], columns[:, 2]
    return known, history


def _rows(*columns: np.ndarray) -> Iterable[tuple[int, ...]]:
    """Rows for executemany from integer columns, a slice at a time (a list of a million
    Python ints takes 40 MB)."""
    for start in range(0, len(columns[0]), 1 << 16):
        yield from zip(*(column[start:start + (1 << 16)].tolist() for column in columns))


def _history_sets(db: sqlite3.Connection, ids: Iterable[int]) -> dict[int, frozenset[int]]:
    wanted = sorted(set(ids))
    sets = {}
    for start in range(0, len(wanted), 500):
        chunk = wanted[start:start + 500]
        for hid, text in db.execute(f"SELECT id, releases FROM histories WHERE id IN ({','.join('?' * len(chunk))})",
                                    chunk):
            sets[hid] = frozenset(json.loads(text))
    return sets


@dataclass
class _Charged:
    """The releases charged so far to the subjects a release touches: `by_history` for the
    subjects of one recorded history, `new` whether some are new to the ledger, `several`
    for those that join subjects of several histories."""

    by_history: dict[int, frozenset[int]]
    new: bool
    several: dict[int, frozenset[int]]

    def sets(self) -> set[frozenset[int]]:
        return {*self.by_history.values(), *self.several.values(), *([frozenset()] if self.new else [])}


def _charged(db: sqlite3.Connection, touched: _Touched) -> _Charged:
    single = np.unique(touched.history[touched.history >= 0]).tolist()
    sets = _history_sets(db, {*single, *(h for hs in touched.several.values() for h in hs)})
    return _Charged({h: sets.get(h, frozenset()) for h in single},
                    bool((touched.history == -1).any()),
                    {label: frozenset().union(*(sets.get(h, frozenset()) for h in hs))
                     for label, hs in touched.several.items()})


def begin(db: sqlite3.Connection, groups: list[np.ndarray], figures: dict[str, Any], *, input: str,
          output: str, options: dict[str, Any], max_epsilon: float | None, max_delta: float | None,
          dp_delta: float) -> tuple[int, Spent, int]:
    """Checks the caps for every subject the release touches, with it included, and records
    it as pending, in one transaction. `groups`: the fingerprints of the rows it touches,
    one array (arrays, rows) per row group. Returns its id, what its most-spent subject
    has spent with it, and how many subjects it touches."""
    db.execute("BEGIN IMMEDIATE")
    try:
        touched = _touched(db, groups)
        charged = _charged(db, touched)
        releases = _releases(db)
        new = _Release(manifest.guarantee_of(charged_scope(figures)), dp_delta, False, False)  # stated once complete
        by_set = {ids: (_spent(ids, releases), _spent(ids, releases, new)) for ids in charged.sets()}
        scope = "whole file" if figures.get("charged") == "per_file" else "each record"
        before = dataclasses.replace(max((b for b, _ in by_set.values()), key=lambda s: (s.epsilon, s.delta)),
                                     scope=scope)
        after = dataclasses.replace(max((a for _, a in by_set.values()), key=lambda s: (s.epsilon, s.delta)),
                                    scope=scope)
        worst_delta = max(a.delta for _, a in by_set.values())
        _check_caps(after, worst_delta, before, max_epsilon, max_delta)
        created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        cursor = db.execute(
            "INSERT INTO releases (status, created, input, output, options, figures, subjects) "
            "VALUES ('pending', ?, ?, ?, ?, ?, ?)",
            (created, input, output, json.dumps(options, default=str), json.dumps(figures), touched.count))
        release_id = cursor.lastrowid
        assert release_id is not None  # the INSERT's
        _charge(db, touched, charged, release_id, set(releases))
        db.execute("DELETE FROM seen")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    return release_id, after, touched.count


def _check_caps(after: Spent, worst_delta: float, before: Spent, max_epsilon: float | None,
                max_delta: float | None) -> None:
    over = []
    # Within floating-point rounding of the cap is at the cap: 0.1 + 0.1 + 0.1 is a hair
    # above 0.3, and three releases of 0.1 meet a cap of 0.3.
    if max_epsilon is not None and after.epsilon > max_epsilon * (1 + CAP_ROUNDING):
        over.append(f"eps {after.epsilon:.4g} > --max-record-eps {max_epsilon:g}")
    if max_delta is not None and worst_delta > max_delta * (1 + CAP_ROUNDING):
        over.append(f"delta {worst_delta:.3g} > --max-record-delta {max_delta:g}")
    if over:
        from tldp_cli.privacy import accounting  # imported already: _spent computed `after`

        left = ""
        if max_epsilon is not None:
            eps_left = accounting.epsilon_left(max_epsilon, before.epsilon)
            if eps_left <= max_epsilon * CAP_ROUNDING:
                eps_left = 0.0  # at the cap, as above: not the 2.8e-12 five figures of 10 - 6e-13 leave
            left = f"; eps left under the cap: {eps_left:.4g}"
        raise LedgerError(f"the ledger refuses this release: with it, the most-spent subject it touches "
                          f"would spend {', '.join(over)} "
                          f"{'per model file' if before.scope == 'whole file' else 'per record'} "
                          f"(that subject so far: {before.describe()}"
                          f"{left}); nothing was written")


def _charge(db: sqlite3.Connection, touched: _Touched, charged: _Charged, release: int, recorded: set[int]) -> None:
    """Records the release against every subject it touches: recorded subjects it links
    become one (the smallest id), new fingerprints join their subject, and each subject's
    history gains the release (a few statements, one per history, not one per subject)."""
    made: dict[frozenset[int], int] = {}

    def history(ids: frozenset[int]) -> int:
        if ids not in made:
            text = json.dumps(sorted((ids & recorded) | {release}))
            db.execute("INSERT OR IGNORE INTO histories (releases) VALUES (?)", (text,))
            made[ids] = db.execute("SELECT id FROM histories WHERE releases = ?", (text,)).fetchone()[0]
        return made[ids]

    if touched.merges:  # rare: one pass over the records (those of a subject this run does not see too)
        db.execute("CREATE TEMP TABLE IF NOT EXISTS moved (old INTEGER PRIMARY KEY, new INTEGER NOT NULL)")
        db.executemany("INSERT INTO moved VALUES (?, ?)",
                       ((other, subjects[0]) for subjects in touched.merges.values() for other in subjects[1:]))
        db.execute("UPDATE records SET subject = (SELECT new FROM moved WHERE old = subject) "
                   "WHERE subject IN (SELECT old FROM moved)")
        db.execute("DELETE FROM subjects WHERE id IN (SELECT old FROM moved)")
        db.execute("DELETE FROM moved")
    # New subjects are numbered in the order of their smallest fingerprint, so that a later
    # pass over the sorted fingerprints reads their subjects in order, not at random.
    first = np.full(touched.count, len(touched.fingerprints))
    np.minimum.at(first, touched.component, np.arange(len(touched.fingerprints)))
    fresh = np.flatnonzero(touched.subject < 0)
    fresh = fresh[np.argsort(first[fresh], kind="stable")]
    touched.subject[fresh] = db.execute("SELECT COALESCE(MAX(id), 0) FROM subjects").fetchone()[0] + 1 + np.arange(len(fresh))
    if len(fresh):
        fresh_history = history(frozenset())
        db.executemany("INSERT INTO subjects (id, history) VALUES (?, ?)",
                       _rows(touched.subject[fresh], np.full(len(fresh), fresh_history)))
    new = touched.known < 0
    db.executemany("INSERT OR REPLACE INTO records (fingerprint, subject) VALUES (?, ?)",
                   _rows(touched.fingerprints[new], touched.subject[touched.component[new]]))
    if charged.by_history:  # the subjects it touches, by the fingerprints in `seen`: no list of ids
        cases = [(old, history(ids)) for old, ids in charged.by_history.items()]
        db.execute(f"UPDATE subjects SET history = CASE history {' '.join('WHEN ? THEN ?' for _ in cases)} "
                   "ELSE history END WHERE id IN (SELECT r.subject FROM seen JOIN records r USING (fingerprint))",
                   [value for case in cases for value in case])
    for label, ids in charged.several.items():
        db.execute("UPDATE subjects SET history = ? WHERE id = ?", (history(ids), int(touched.subject[label])))
    db.execute("DELETE FROM histories WHERE id NOT IN (SELECT history FROM subjects)")


def complete(db: sqlite3.Connection, release: int) -> None:
    db.execute("UPDATE releases SET status = 'complete' WHERE id = ?", (release,))


def abandon(db: sqlite3.Connection, release: int) -> None:
    """The run failed before its output was in place: it released nothing. (Histories that
    name it keep its id, which no release takes again: AUTOINCREMENT.)"""
    db.execute("DELETE FROM releases WHERE id = ? AND status = 'pending'", (release,))


def listing(path: Path) -> dict[str, Any]:
    """The ledger's releases, and its subjects grouped by the releases charged to them, with
    what those spend together, most-spent first."""
    if not path.is_file():
        raise InputError(f"{path}: {'a folder, not a' if path.is_dir() else 'no such'} ledger (give the file "
                         "perturb --ledger wrote)")
    if path.stat().st_size == 0:  # SQLite would take it as a new database, and tldp make it a ledger
        raise InputError(f"{path}: an empty file, not a ledger (give the file perturb --ledger wrote)")
    db = open_ledger(path)
    try:
        rows = db.execute("SELECT id, status, created, input, output, options, figures, subjects, everyone "
                          "FROM releases ORDER BY id").fetchall()
        entries = []
        for rid, status, created, input, output, options, figures, subjects, everyone in rows:
            figures = json.loads(figures)
            entries.append({"id": rid, "status": status, "created": created, "input": input, "output": output,
                            "options": json.loads(options), "subjects": subjects,
                            "charged_to_every_subject": bool(everyone),
                            "charged": figures.get("charged", "per_record"), "per_element": figures["per_element"],
                            "per_record": figures["per_record"], "per_file": figures.get("per_file")})
        return {"schema": "tldp-ledger/2", "ledger": str(path), "releases": entries, **_subjects(db)}
    finally:
        db.close()


def _subjects(db: sqlite3.Connection) -> dict[str, Any]:
    releases = _releases(db)
    counts = db.execute("SELECT history, COUNT(*) FROM subjects GROUP BY history").fetchall()
    sets = _history_sets(db, (h for h, _ in counts))
    by_set: dict[frozenset[int], int] = {}
    for history, count in counts:  # histories that differ only by abandoned releases are one
        ids = frozenset(i for i in sets.get(history, ()) if i in releases)
        if ids:
            by_set[ids] = by_set.get(ids, 0) + count
    everyone = sorted(i for i, r in releases.items() if r.everyone)
    groups: list[dict[str, Any]] = []
    for ids, count in by_set.items():
        spent = _spent(ids, releases)
        groups.append({"subjects": count, "releases": sorted({*ids, *everyone}), "per_record": _as_dict(spent)})
    if everyone and not groups:  # no subject recorded yet: each will be charged these
        groups.append({"subjects": 0, "releases": everyone, "per_record": _as_dict(_spent((), releases))})
    groups.sort(key=lambda g: (-g["per_record"]["epsilon"], -g["per_record"]["delta"], g["releases"]))
    return {"subjects": groups, "worst_subject": groups[0]["per_record"] if groups else None}


def _as_dict(spent: Spent) -> dict[str, Any]:
    return {"epsilon": spent.epsilon, "delta": spent.delta, "releases": spent.releases, "pending": spent.pending}

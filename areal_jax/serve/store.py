"""The turn store: every served turn, durably, in SQLite (WAL) under the workdir.

One row per generated candidate of a chat completion (``candidate`` 0..n-1 share ``request_id``).
A row is inserted and committed before the response's last byte is sent, so an acknowledged turn
survives a crash. Three loops share the file, each on its own connection:
  * serving inserts turns (``add_turn``);
  * the judge sets ``judge_status`` ("pending" -> "judged" | "unjudgeable") and ``score``; with
    hindsight OPD a turn with a hint is "hinted" until the teacher has scored it (``hinted``);
  * the trainer sets ``train_status`` ("new" -> "trained" | "stale") with the policy version
    whose train step consumed the row (``trained_version``), so a restart from checkpoint V
    rolls back the marks of steps after V (``rollback_after``) and trains nothing twice.
A turn also records the session protocol: ``key_id`` (the API key's id, never the key; NULL
without keys), ``turn_type`` ("main" | "side": side turns are recorded with both statuses "side",
never judged nor trained) and ``session_done`` (the request said the session ended: its turn is
the last). A session is its id within one key id: another key's requests cannot join it.
With hindsight OPD (``serve.signal`` opd or combined) the judge also stores the turn's ``hint``
and ``teacher``: the teacher's logprob of each response token under the hinted prompt (JSON
``{"logprobs": [...]}``, with ``topk_ids`` / ``topk_logprobs`` per token for ``teacher_topk``).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS turns (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  session_id TEXT NOT NULL,
  turn_index INTEGER NOT NULL,
  request_id TEXT NOT NULL,
  candidate INTEGER NOT NULL DEFAULT 0,
  messages TEXT NOT NULL,            -- JSON: the conversation the request sent
  prompt_tokens TEXT NOT NULL,       -- JSON list of ids
  completion_tokens TEXT NOT NULL,   -- JSON list of ids
  logprobs TEXT NOT NULL,            -- JSON list of floats (behaviour logprob per token)
  versions TEXT NOT NULL,            -- JSON list of policy versions per token
  completion_text TEXT NOT NULL,
  finish_reason TEXT NOT NULL,
  temperature REAL NOT NULL,
  created_s REAL NOT NULL,
  judge_status TEXT NOT NULL DEFAULT 'pending',
  score REAL,
  judged_s REAL,
  train_status TEXT NOT NULL DEFAULT 'new',
  trained_version INTEGER,
  key_id TEXT,                       -- the API key's id (access.key_id), NULL without keys
  turn_type TEXT NOT NULL DEFAULT 'main',  -- "main" | "side" (served and recorded, never trained)
  session_done INTEGER NOT NULL DEFAULT 0,  -- 1: the request ended its session (X-Session-Done)
  hint TEXT,                         -- the judge's hint from the next state (OPD), NULL: none
  teacher TEXT                       -- JSON: the teacher's logprobs of the response (OPD), or NULL
);
CREATE INDEX IF NOT EXISTS turns_session ON turns (session_id, turn_index);
CREATE INDEX IF NOT EXISTS turns_judge ON turns (judge_status);
CREATE INDEX IF NOT EXISTS turns_train ON turns (judge_status, train_status);
"""
# Columns added after the first stores were written: a store from before gets them on open.
_ADDED = {"key_id": "TEXT", "turn_type": "TEXT NOT NULL DEFAULT 'main'",
          "session_done": "INTEGER NOT NULL DEFAULT 0", "hint": "TEXT", "teacher": "TEXT"}

TURN_COLUMNS = ("id", "session_id", "turn_index", "request_id", "candidate", "messages",
                "prompt_tokens", "completion_tokens", "logprobs", "versions", "completion_text",
                "finish_reason", "temperature", "created_s", "judge_status", "score", "judged_s",
                "train_status", "trained_version", "key_id", "turn_type", "session_done", "hint",
                "teacher")
_JSON = ("messages", "prompt_tokens", "completion_tokens", "logprobs", "versions", "teacher")


def skip_reason(row: dict, version: int, max_staleness: int, temperature: float) -> str | None:
  """Why the trainer at ``version`` may never train ``row``: "stale" (its oldest token more than
  ``max_staleness`` versions behind), "temperature" (sampled at another temperature than the
  learner's: its behaviour logprobs follow another distribution), or None."""
  if not row["versions"] or version - min(row["versions"]) > max_staleness:
    return "stale"
  if abs(row["temperature"] - temperature) > 1e-6:
    return "temperature"
  return None


class TurnStore:
  """Thread-safe access to ``<workdir>/turns.sqlite`` (one connection per thread)."""

  def __init__(self, path: str):
    self.path = path
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    self._local = threading.local()
    conn = self._raw()
    conn.executescript(SCHEMA)
    have = {row[1] for row in conn.execute("PRAGMA table_info(turns)")}
    for column, kind in _ADDED.items():
      if column not in have:
        conn.execute(f"ALTER TABLE turns ADD COLUMN {column} {kind}")

  def _conn(self) -> "_Tx":
    return _Tx(self._raw())

  def _raw(self) -> sqlite3.Connection:
    conn = getattr(self._local, "conn", None)
    if conn is None:
      conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
      conn.execute("PRAGMA journal_mode=WAL")
      conn.execute("PRAGMA synchronous=FULL")  # a committed turn survives a power cut, not just a crash
      conn.execute("PRAGMA busy_timeout=30000")
      self._local.conn = conn
    return conn

  def close(self) -> None:
    conn = getattr(self._local, "conn", None)
    if conn is not None:
      conn.close()
      self._local.conn = None

  # ---- serving ---------------------------------------------------------------------------------

  def add_turns(self, session_id: str, rows: list[dict], key_id: str | None = None,
                turn_type: str = "main", done: bool = False) -> tuple[list[int], int]:
    """Inserts and commits the candidates of one request as the session's next turn (all or none);
    returns their row ids and the turn index. A ``side`` turn is never judged nor trained."""
    if turn_type not in ("main", "side"):
      raise ValueError(f"turn_type must be 'main' or 'side', got {turn_type!r}")
    status = "side" if turn_type == "side" else None
    ids = []
    with self._conn() as conn:
      last = conn.execute("SELECT MAX(turn_index) FROM turns WHERE session_id = ? AND key_id IS ?",
                          (session_id, key_id)).fetchone()[0]
      index = 0 if last is None else last + 1
      for r in rows:
        cur = conn.execute(
            "INSERT INTO turns (session_id, turn_index, request_id, candidate, messages, "
            "prompt_tokens, completion_tokens, logprobs, versions, completion_text, finish_reason, "
            "temperature, created_s, key_id, turn_type, session_done, judge_status, train_status) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
            "COALESCE(?, 'pending'), COALESCE(?, 'new'))",
            (session_id, index, r["request_id"], r.get("candidate", 0),
             json.dumps(r["messages"]), json.dumps(r["prompt_tokens"]),
             json.dumps(r["completion_tokens"]), json.dumps(r["logprobs"]),
             json.dumps(r["versions"]), r["completion_text"], r["finish_reason"],
             float(r["temperature"]), r.get("created_s", time.time()), key_id, turn_type,
             int(done), status, status))
        ids.append(cur.lastrowid)
    return ids, index

  # ---- reading ---------------------------------------------------------------------------------

  def _rows(self, sql: str, args: tuple = ()) -> list[dict]:
    # a read is one autocommit statement: in WAL mode it sees the last commit and takes no lock
    cur = self._raw().execute(sql, args)
    names = [d[0] for d in cur.description]
    out = []
    for values in cur.fetchall():
      row = dict(zip(names, values))
      for k in _JSON:
        if row.get(k) is not None:
          row[k] = json.loads(row[k])
      out.append(row)
    return out

  def first(self, limit: int) -> list[dict]:
    """The oldest ``limit`` rows with a completion (benchmarks, audits)."""
    return self._rows("SELECT * FROM turns WHERE completion_tokens != '[]' ORDER BY id LIMIT ?",
                      (limit,))

  def get(self, turn_id: int) -> dict | None:
    rows = self._rows("SELECT * FROM turns WHERE id = ?", (turn_id,))
    return rows[0] if rows else None

  def session(self, session_id: str) -> list[dict]:
    return self._rows("SELECT * FROM turns WHERE session_id = ? ORDER BY turn_index, candidate",
                      (session_id,))

  def pending_judgement(self, limit: int = 256) -> list[dict]:
    return self._rows("SELECT * FROM turns WHERE judge_status = 'pending' ORDER BY id LIMIT ?",
                      (limit,))

  def hinted(self, limit: int = 64, oldest: bool = False) -> list[dict]:
    """Turns with a hint waiting for the teacher's logprobs (``judge_status = 'hinted'``), newest
    first (when the teacher falls behind, the freshest turns are the ones worth training), or with
    ``oldest`` oldest first (those it may never reach)."""
    order = "ASC" if oldest else "DESC"
    return self._rows(f"SELECT * FROM turns WHERE judge_status = 'hinted' ORDER BY id {order} "
                      "LIMIT ?", (limit,))

  def next_turn(self, session_id: str, turn_index: int, key_id: str | None = None) -> dict | None:
    """The first candidate of the session's next main turn (carrying the user's reply; side turns
    between are skipped)."""
    rows = self._rows("SELECT * FROM turns WHERE session_id = ? AND key_id IS ? AND turn_index > ? "
                      "AND turn_type = 'main' ORDER BY turn_index, candidate LIMIT 1",
                      (session_id, key_id, turn_index))
    return rows[0] if rows else None

  def session_state(self, session_id: str, key_id: str | None = None) -> dict:
    """``done`` (a request ended the session) and ``main_turns`` (how many main turns it has)."""
    done, main = self._raw().execute(
        "SELECT MAX(session_done), COUNT(DISTINCT CASE WHEN turn_type = 'main' THEN turn_index END) "
        "FROM turns WHERE session_id = ? AND key_id IS ?", (session_id, key_id)).fetchone()
    return {"done": bool(done), "main_turns": main}

  def trainable(self, limit: int, per_key: int | None = None, hinted: bool = False) -> list[dict]:
    """Judged, untrained main turns, oldest first; with ``per_key``, at most that many of each key
    id (so that one key's backlog cannot hide the others' turns); with ``hinted``, the turns still
    waiting for the teacher too, in the same order (a trainer that runs the teacher itself)."""
    judged = "judge_status IN ('judged', 'hinted')" if hinted else "judge_status = 'judged'"
    where = f"{judged} AND train_status = 'new' AND turn_type = 'main'"
    if per_key is None:
      return self._rows(f"SELECT * FROM turns WHERE {where} ORDER BY id LIMIT ?", (limit,))
    rows = self._rows(
        f"SELECT * FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY key_id ORDER BY id) AS key_rank "
        f"FROM turns WHERE {where}) WHERE key_id IS NULL OR key_rank <= ? ORDER BY id LIMIT ?",
        (per_key, limit))
    for r in rows:
      del r["key_rank"]
    return rows

  def counts(self) -> dict[str, int]:
    conn = self._raw()
    out = {"turns": conn.execute("SELECT COUNT(*) FROM turns").fetchone()[0]}
    for col in ("judge_status", "train_status"):
      for value, n in conn.execute(f"SELECT {col}, COUNT(*) FROM turns GROUP BY {col}"):
        out[f"{col}.{value}"] = n
    return out

  # ---- judge and trainer -----------------------------------------------------------------------

  def set_judgements(self, results: list[tuple], from_status: str = "pending") -> None:
    """``(turn id, "judged" | "unjudgeable" | "hinted", score[, hint, teacher])`` for each row in
    ``judge_status`` ``from_status`` (``teacher``: a dict, stored as JSON), in one transaction."""
    if from_status not in ("pending", "hinted"):
      raise ValueError(f"from_status must be 'pending' or 'hinted', got {from_status!r}")
    now = time.time()
    rows = []
    for tid, status, score, *opd in results:
      hint, teacher = (opd + [None, None])[:2]
      rows.append((status, score, now, hint, None if teacher is None else json.dumps(teacher), tid))
    with self._conn() as conn:
      conn.executemany("UPDATE turns SET judge_status = ?, score = ?, judged_s = ?, hint = ?, "
                       f"teacher = ? WHERE id = ? AND judge_status = '{from_status}'", rows)

  def mark(self, ids: list[int], status: str, version: int) -> None:
    """Sets ``train_status`` of ``ids`` (consumed by the step that made ``version``)."""
    with self._conn() as conn:
      conn.executemany("UPDATE turns SET train_status = ?, trained_version = ? WHERE id = ?",
                       [(status, int(version), i) for i in ids])

  def rollback_after(self, version: int) -> int:
    """Undoes the marks of train steps that made versions after ``version`` (lost by a restart from
    the checkpoint of ``version``); returns how many rows became trainable again."""
    with self._conn() as conn:
      cur = conn.execute("UPDATE turns SET train_status = 'new', trained_version = NULL "
                         "WHERE trained_version > ?", (int(version),))
      return cur.rowcount


class _Tx:
  """``with`` block = one transaction (BEGIN IMMEDIATE ... COMMIT, ROLLBACK on error)."""

  def __init__(self, conn: sqlite3.Connection):
    self.conn = conn

  def __enter__(self) -> sqlite3.Connection:
    self.conn.execute("BEGIN IMMEDIATE")
    return self.conn

  def __exit__(self, exc_type, exc, tb) -> None:
    self.conn.execute("ROLLBACK" if exc_type else "COMMIT")


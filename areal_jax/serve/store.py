"""The turn store: every served turn, durably, in SQLite (WAL) under the workdir.

One row per generated candidate of a chat completion (``candidate`` 0..n-1 share ``request_id``).
A row is inserted and committed before the response's last byte is sent, so an acknowledged turn
survives a crash. Three loops share the file, each on its own connection:
  * serving inserts turns (``add_turn``);
  * the judge sets ``judge_status`` ("pending" -> "judged" | "unjudgeable") and ``score``;
  * the trainer sets ``train_status`` ("new" -> "trained" | "stale") with the policy version
    whose train step consumed the row (``trained_version``), so a restart from checkpoint V
    rolls back the marks of steps after V (``rollback_after``) and trains nothing twice.
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
  trained_version INTEGER
);
CREATE INDEX IF NOT EXISTS turns_session ON turns (session_id, turn_index);
CREATE INDEX IF NOT EXISTS turns_judge ON turns (judge_status);
CREATE INDEX IF NOT EXISTS turns_train ON turns (judge_status, train_status);
"""

TURN_COLUMNS = ("id", "session_id", "turn_index", "request_id", "candidate", "messages",
                "prompt_tokens", "completion_tokens", "logprobs", "versions", "completion_text",
                "finish_reason", "temperature", "created_s", "judge_status", "score", "judged_s",
                "train_status", "trained_version")
_JSON = ("messages", "prompt_tokens", "completion_tokens", "logprobs", "versions")


class TurnStore:
  """Thread-safe access to ``<workdir>/turns.sqlite`` (one connection per thread)."""

  def __init__(self, path: str):
    self.path = path
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    self._local = threading.local()
    self._raw().executescript(SCHEMA)

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

  def add_turns(self, session_id: str, rows: list[dict]) -> tuple[list[int], int]:
    """Inserts and commits the candidates of one request as the session's next turn (all or none);
    returns their row ids and the turn index."""
    ids = []
    with self._conn() as conn:
      last = conn.execute("SELECT MAX(turn_index) FROM turns WHERE session_id = ?",
                          (session_id,)).fetchone()[0]
      index = 0 if last is None else last + 1
      for r in rows:
        cur = conn.execute(
            "INSERT INTO turns (session_id, turn_index, request_id, candidate, messages, "
            "prompt_tokens, completion_tokens, logprobs, versions, completion_text, finish_reason, "
            "temperature, created_s) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (session_id, index, r["request_id"], r.get("candidate", 0),
             json.dumps(r["messages"]), json.dumps(r["prompt_tokens"]),
             json.dumps(r["completion_tokens"]), json.dumps(r["logprobs"]),
             json.dumps(r["versions"]), r["completion_text"], r["finish_reason"],
             float(r["temperature"]), r.get("created_s", time.time())))
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
        if k in row:
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

  def next_turn(self, session_id: str, turn_index: int) -> dict | None:
    """The first candidate of the session's following turn (carrying the user's reply)."""
    rows = self._rows("SELECT * FROM turns WHERE session_id = ? AND turn_index = ? "
                      "ORDER BY candidate LIMIT 1", (session_id, turn_index + 1))
    return rows[0] if rows else None

  def trainable(self, limit: int) -> list[dict]:
    """Judged, untrained rows, oldest first."""
    return self._rows("SELECT * FROM turns WHERE judge_status = 'judged' AND train_status = 'new' "
                      "ORDER BY id LIMIT ?", (limit,))

  def counts(self) -> dict[str, int]:
    conn = self._raw()
    out = {"turns": conn.execute("SELECT COUNT(*) FROM turns").fetchone()[0]}
    for col in ("judge_status", "train_status"):
      for value, n in conn.execute(f"SELECT {col}, COUNT(*) FROM turns GROUP BY {col}"):
        out[f"{col}.{value}"] = n
    return out

  # ---- judge and trainer -----------------------------------------------------------------------

  def set_judgements(self, results: list[tuple[int, str, float | None]]) -> None:
    """``(turn id, "judged" | "unjudgeable", score)`` for each row, in one transaction."""
    now = time.time()
    with self._conn() as conn:
      conn.executemany("UPDATE turns SET judge_status = ?, score = ?, judged_s = ? "
                       "WHERE id = ? AND judge_status = 'pending'",
                       [(status, score, now, tid) for tid, status, score in results])

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


#!/usr/bin/env python3
"""SQLite's own ceiling for the inbox's writes, without approvald or sqlx.

A cross-check of `approvald bench`'s "ingest store ceiling" row with
Python's bundled sqlite3: one connection (WAL, synchronous=FULL) stores
~300-byte callbacks with random decision ids in batches, one durable
commit per batch, into a table with the inbox's columns and indexes
(migrations/sqlite), filled with 200,000 waiting callbacks first; beside
it, interleaved, the bench's baseline: single-row durable commits of a
300-byte row. Also the same batches without the unique (tenant,
correlation_id) key, to show what the key costs.

    python3 benches/sqlite_inbox_ceiling.py [DIR]   # ~1 minute, DIR on the disk to measure
    PAGE_SIZE=1024 python3 benches/sqlite_inbox_ceiling.py [DIR]   # both files with 1 KiB pages
    CACHE_KIB=16384 python3 benches/sqlite_inbox_ceiling.py [DIR]  # 16 MiB page caches
"""
import os
import sqlite3
import sys
import time
import uuid

SECS = float(os.environ.get("SECS", "4"))


def whole(name, default):
    """The positive whole number in environment variable `name`."""
    value = os.environ.get(name, default)
    if not value.isdigit() or int(value) == 0:
        raise SystemExit(f"{name} must be a positive whole number, not {value!r}")
    return int(value)


# SQLite's page size for both files (SQLite's default, 4096, unless set).
PAGE_SIZE = whole("PAGE_SIZE", "4096")
# SQLite's page cache for both connections, KiB (approvald's default, 1024, unless set).
CACHE_KIB = whole("CACHE_KIB", "1024")
DIR = sys.argv[1] if len(sys.argv) > 1 else "."
BODY = "x" * 300


def fresh(name):
    path = os.path.join(DIR, name)
    for suffix in ("", "-wal", "-shm"):
        try:
            os.remove(path + suffix)
        except FileNotFoundError:
            pass
    conn = sqlite3.connect(path, isolation_level=None)
    # Before the first table and WAL mode, or it does not take.
    conn.execute(f"PRAGMA page_size={PAGE_SIZE}")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
    conn.execute("PRAGMA synchronous=FULL")
    return conn, path


def done(conn, path):
    conn.close()
    for suffix in ("", "-wal", "-shm"):
        try:
            os.remove(path + suffix)
        except FileNotFoundError:
            pass


def baseline():
    conn, path = fresh("ceiling-baseline.db")
    conn.execute("CREATE TABLE bench_baseline (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < SECS:
        conn.execute("INSERT INTO bench_baseline (body) VALUES (?)", (BODY,))
        n += 1
    rate = n / (time.perf_counter() - start)
    done(conn, path)
    return rate


def inbox(batch, unique=True, fill=200_000):
    conn, path = fresh("ceiling-inbox.db")
    key = ", UNIQUE (tenant, correlation_id)" if unique else ""
    conn.executescript(f"""
        CREATE TABLE inbox (id INTEGER PRIMARY KEY AUTOINCREMENT, tenant TEXT NOT NULL,
          correlation_id TEXT NOT NULL, answer TEXT NOT NULL, answered_at TEXT, body BLOB NOT NULL,
          body_sha256 TEXT NOT NULL, source TEXT NOT NULL, state TEXT NOT NULL,
          received_at INTEGER NOT NULL, duplicates INTEGER NOT NULL DEFAULT 0, processed_at INTEGER{key});
        CREATE INDEX inbox_new_received ON inbox (received_at) WHERE state = 'new';
        CREATE INDEX inbox_received ON inbox (received_at);
        CREATE INDEX inbox_orphaned ON inbox (received_at) WHERE state = 'orphaned';
    """)
    insert = ("INSERT INTO inbox (tenant, correlation_id, answer, answered_at, body, body_sha256, source, "
              "state, received_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING")

    def rows(k):
        now = int(time.time() * 1000)
        return [("default", "dec_" + uuid.uuid4().hex[:24], "yes", None, BODY.encode(), "0" * 64,
                 "callback", "new", now) for _ in range(k)]

    conn.execute("BEGIN")
    conn.executemany(insert, rows(fill))
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    # Made before the clock starts, so the rate is SQLite's, not uuid's.
    ready = [rows(batch) for _ in range(int(SECS * 60_000 / batch) + 1)]
    n, start = 0, time.perf_counter()
    for batch_rows in ready:
        if time.perf_counter() - start >= SECS:
            break
        conn.execute("BEGIN")
        conn.executemany(insert, batch_rows)
        conn.execute("COMMIT")
        n += len(batch_rows)
    rate = n / (time.perf_counter() - start)
    done(conn, path)
    return rate


for run in range(2):
    b1 = baseline()
    half, full, keyless = inbox(32), inbox(64), inbox(64, unique=False)
    b2 = baseline()
    b = (b1 + b2) / 2
    print(f"run {run}: baseline {b1:.0f} and {b2:.0f} commits/s; inbox in batches of 32: {half:.0f}/s "
          f"({half / b:.2f}x), of 64: {full:.0f}/s ({full / b:.2f}x); "
          f"of 64 without the unique key: {keyless:.0f}/s ({keyless / b:.2f}x)", flush=True)

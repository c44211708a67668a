#!/usr/bin/env python3
"""The reconciler's retention read on SQLite, with many finished operations.

approvald's reconciler asks every sweep (5 s by default) for finished
operations old enough to archive. Without statistics SQLite's planner read
that through `operations_state`: every finished operation, then a sort.
approvald now names `operations_finished` on SQLite (decisions §37). This
builds approvald's migrated schema (migrations/sqlite) in a temporary
directory, fills it with N finished operations none of which is old enough
yet (a deployment's last week), and times the read both ways, with the plan
of each.

    python3 benches/sqlite_sweep_plan.py [N]   # N = 1,000,000 by default; ~1 minute
"""
import glob
import os
import sqlite3
import sys
import tempfile
import time

N = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHERE = (
    "WHERE due_at IS NULL AND poll_at IS NULL AND inbox_at IS NULL AND updated_at < ? "
    "AND state IN ('succeeded', 'failed', 'expired', 'cancelled', 'denied', "
    "'invalid', 'refused', 'unreachable') "
    "AND (delivery IS NULL OR delivery <> 'pending') AND (receipt IS NULL OR receipt <> 'pending') "
    "ORDER BY updated_at LIMIT 100"
)
READS = {
    "as SQLite picks": f"SELECT id FROM operations {WHERE}",
    "INDEXED BY operations_finished": f"SELECT id FROM operations INDEXED BY operations_finished {WHERE}",
}


def main():
    with tempfile.TemporaryDirectory() as d:
        conn = sqlite3.connect(os.path.join(d, "s.db"), isolation_level=None)
        for f in sorted(glob.glob(os.path.join(ROOT, "migrations", "sqlite", "*.sql"))):
            conn.executescript(open(f).read())
        t0 = 1_800_000_000_000
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO operations (id, tenant, operation_key, fingerprint, thread_id, interrupt_id, "
            "effect, decision_type, spec, decision_request, state, idempotency_key, deadline, "
            "created_at, updated_at, delivery, receipt) VALUES (?, 'default', ?, 'f', ?, 'i', 'e', "
            "'confirm', ?, ?, 'succeeded', ?, ?, ?, ?, 'done', 'recorded')",
            (
                (f"op{i}", f"k{i}", f"t{i}", "x" * 300, "y" * 300, f"ik{i}", t0 * 10, t0 + i, t0 + i)
                for i in range(N)
            ),
        )
        conn.execute("COMMIT")
        print(f"{N} finished operations, none old enough to archive (SQLite {sqlite3.sqlite_version})")
        for name, sql in READS.items():
            plan = "; ".join(r[3] for r in conn.execute(f"EXPLAIN QUERY PLAN {sql}", (t0,)))
            times = []
            for _ in range(5):
                start = time.perf_counter()
                conn.execute(sql, (t0,)).fetchall()
                times.append(time.perf_counter() - start)
            times.sort()
            print(f"{name}: median {times[2] * 1000:.2f} ms of 5 reads ({plan})")
        conn.close()


if __name__ == "__main__":
    main()

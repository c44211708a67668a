#!/usr/bin/env python3
"""What approvald's PostgreSQL backends are waiting on, sampled.

Reads `pg_stat_activity` every 2 ms for SECONDS, keeps the client
backends named `approvald` (its `application_name`), and prints how many
of them were, on average, in each state: running (`active/CPU`: active
with no wait event), waiting for a lock, for the WAL's flush
(`LWLock:WALWrite` waits for another backend's flush, `IO:WALSync` is the
flush itself), for the client (`Client:ClientRead`), or idle; then the
same split per statement (its first 45 characters).

Start it while `approvald bench` runs the phase to look at, e.g. when it
prints "end to end at half speed":

    pip install psycopg2-binary
    python3 benches/pg_wait_events.py [SECONDS] [DSN]
    # defaults: 4 s, host=127.0.0.1 user=postgres dbname=postgres

The sampler's own queries cost the server a little CPU; compare runs
sampled alike.
"""
import collections
import sys
import time

import psycopg2

SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
DSN = sys.argv[2] if len(sys.argv) > 2 else "host=127.0.0.1 user=postgres dbname=postgres"
QUERY = (
    "SELECT state, coalesce(wait_event_type, ''), coalesce(wait_event, ''), left(query, 45) "
    "FROM pg_stat_activity WHERE application_name = 'approvald' AND backend_type = 'client backend'"
)


def category(state, kind, event):
    if state == "idle":
        return "idle"
    if state == "active" and not kind:
        return "active/CPU"
    return f"{state}/{kind}:{event}"


def main():
    conn = psycopg2.connect(DSN)
    conn.autocommit = True
    cur = conn.cursor()
    totals, per_statement, samples = collections.Counter(), collections.Counter(), 0
    end = time.monotonic() + SECONDS
    while time.monotonic() < end:
        cur.execute(QUERY)
        samples += 1
        for state, kind, event, text in cur.fetchall():
            c = category(state, kind, event)
            totals[c] += 1
            if c != "idle":
                per_statement[(c, text)] += 1
        time.sleep(0.002)
    if not samples:
        sys.exit("no samples taken")
    print(f"{samples} samples over {SECONDS:.1f} s; approvald backends on average:")
    for c, n in totals.most_common():
        print(f"  {n / samples:7.3f}  {c}")
    print("per statement (not idle):")
    for (c, text), n in per_statement.most_common(20):
        print(f"  {n / samples:7.3f}  {c:28s} {text}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""PostgreSQL alone doing an approval's writes: what the machine's CPU allows.

An approval on PostgreSQL writes, besides its HTTP: the callback's inbox
row (marking its operation), a thread lease with the first read, four
saves (each a compare-and-set of the `operations` row, with its
transitions, Pushary calls, delivery attempt and the inbox row's mark),
and the last read with the lease given up. This script runs those writes
with `pgbench` on approvald's own migrated schema, with no approvald, no
HTTP and no load generator, and prints the approvals/s PostgreSQL reaches
and the machine's CPU per approval (PostgreSQL, pgbench and the kernel;
`/proc/stat` around each run), beside the single-row commit baseline
`approvald bench` uses:

- `rows`: the five writes the guarantees name and nothing else (the
  inbox row, then the four saves' updates of the operation row), each
  its own statement and durable commit;
- `all`: every statement an approval's visit runs, as above, each step
  one statement (its parts in `WITH`) and one commit, as approvald's
  steps are one statement each;
- `visits`: as `all`, but each approval's lease with the first read, and
  its last read with the release, are statements and transactions of
  their own, as approvald's visits to threads are;

each with N approvals per transaction and statement (a batch), as
approvald's inbox writer and save queue gather them (`approvald bench`
on PostgreSQL measured about six saves per batch at full speed; a
visit's lease and reads are per approval, which `all` batches and
`visits` does not). At 2,000 approvals/s the two cores have 1.0 ms per
approval for everything. There is no batch of one: the batch's form (a
key list from `generate_series`) costs a lone row more executor set-up
than approvald's own single-row statements do.

    python3 benches/pg_approval_writes.py [SECONDS] [ROUNDS] [PGURL]
    # defaults: 10 s per run, 2 rounds, postgres://postgres@127.0.0.1:5432/postgres

Environment: `KINDS` (default `rows,all,visits`) and `BATCHES` (default
`4,8,16,32`) choose the runs; `SPEC_BYTES` (default `300,185`) sizes the
two immutable columns `spec` and `decision_request` of every operation:
`SPEC_BYTES=0,0` measures the writes of a row as narrow as it would be
with them in a table of their own (thirty-fourth session). `OPERATIONS`
(default 100000) is how many operations the table holds; `KEYS=random`
spreads the keys that come from elsewhere (thread, operation key,
Pushary's decision id) over their indexes as real ones are (`ordered`,
the default, keeps them in the operations' order, so a batch's entries
share leaves); `DROP_INDEXES` names indexes (or unique constraints) of
`operations` to drop before the runs, to price their upkeep (thirty-fifth
session).

Needs `psql` and `pgbench` on PATH and a role that may create databases.
It creates `x_approval_writes_<pid>` and drops it at the end.
"""
import os
import pathlib
import re
import subprocess
import sys
import tempfile



def count_arg(i, name, default):
    """The positive whole number at argv[i], or `default`; a usage error
    naming `name` otherwise."""
    if len(sys.argv) <= i:
        return default
    if not sys.argv[i].isdigit() or int(sys.argv[i]) == 0:
        raise SystemExit(f"{name} must be a positive whole number, not {sys.argv[i]!r} (usage: see the top of this file)")
    return int(sys.argv[i])


SECONDS = count_arg(1, "SECONDS", 10)
ROUNDS = count_arg(2, "ROUNDS", 2)
URL = sys.argv[3] if len(sys.argv) > 3 else "postgres://postgres@127.0.0.1:5432/postgres"
ROOT = pathlib.Path(__file__).resolve().parent.parent
DB = f"x_approval_writes_{os.getpid()}"
DB_URL = URL.rsplit("/", 1)[0] + "/" + DB


def env_list(name, default, names=None):
    """The comma-separated list in environment variable `name`: whole
    numbers, or members of `names` when given."""
    items = os.environ.get(name, default).split(",")
    for item in items:
        if (names is None and not item.isdigit()) or (names is not None and item not in names):
            raise SystemExit(f"{name}: {item!r} is not " + (f"one of {', '.join(names)}" if names else "a whole number"))
    return items if names else [int(i) for i in items]


BATCHES = env_list("BATCHES", "4,8,16,32")
if 0 in BATCHES:
    raise SystemExit("BATCHES: a batch holds at least one approval")
KINDS = env_list("KINDS", "rows,all,visits", ("rows", "all", "visits"))
SPEC, REQUEST = (env_list("SPEC_BYTES", "300,185") + [0, 0])[:2]
OPERATIONS = env_list("OPERATIONS", "100000")[0]
if OPERATIONS < max(BATCHES):
    raise SystemExit(f"OPERATIONS: {OPERATIONS} operations cannot fill a batch of {max(BATCHES)}")
DROP = [i for i in os.environ.get("DROP_INDEXES", "").split(",") if i]
for index in DROP:
    if not re.fullmatch(r"operations_[a-z_]+", index):
        raise SystemExit(f"DROP_INDEXES: {index!r} is not the name of an index of `operations`")

# Ids as long as approvald's (a prefix and 26 characters), computed cheaply.
# Operation ids grow with time, as approvald's do; with `KEYS=random` the
# keys that come from elsewhere (the thread, the operation key, Pushary's
# decision id) are spread over their indexes as real ones are.
KEYS = env_list("KEYS", "ordered", ("ordered", "random"))[0]
OP = "'op_' || lpad(g::text, 26, '0')"
if KEYS == "random":
    THREAD = "'thread-' || left(md5('t' || g::text), 26)"
    OPERATION_KEY, DECISION = "'bench-' || md5('k' || g::text)", "'dec_' || left(md5('d' || g::text), 26)"
else:
    THREAD = "'thread-' || lpad(g::text, 26, '0')"
    OPERATION_KEY, DECISION = "'bench-' || g", "'dec_' || lpad(g::text, 26, '0')"


def ids(n, per=1):
    """`generate_series` over this batch's operations (`per` rows each)."""
    return f"generate_series((:b)::int * {n * per} + {per}, (:b)::int * {n * per} + {n * per + per - 1})"


def batch_ops(n):
    return f"id IN (SELECT {OP} FROM {ids(n)} g)"


INBOX = (
    "INSERT INTO inbox (tenant, correlation_id, answer, answered_at, body, body_sha256, source, state, "
    "received_at) SELECT 'default', 'c' || (:r)::bigint || '_' || g, 'yes', '2026-12-06T00:00:00Z', "
    "convert_to(repeat('b', 300), 'UTF8'), md5(g::text) || md5(g::text), 'callback', 'new', 1700000000000 "
    "FROM generate_series(1, {n}) g"
)
SAVES = [
    "UPDATE operations SET state = 'answered', answer = 'yes', consume_inflight = 1, inbox_at = NULL, "
    "updated_at = updated_at + 1, due_at = 1700000030000, poll_at = NULL, resume_seq = 5, "
    "version = version + 1 WHERE {ops}",
    "UPDATE operations SET state = 'permitted', permit_id = 'pmt_ecc561e24b0f33b4314aeea3', "
    "consume_inflight = 0, delivery = 'pending', delivery_inflight = 1, updated_at = updated_at + 1, "
    "due_at = 1700000031000, version = version + 1 WHERE {ops}",
    "UPDATE operations SET state = 'succeeded', delivery = 'done', delivery_inflight = 0, "
    "receipt = 'pending', result = '{{\"ok\": true}}', outcome_status = '200', updated_at = updated_at + 1, "
    "due_at = 1700000032000, resume_seq = NULL, version = version + 1 WHERE {ops}",
    "UPDATE operations SET receipt = 'recorded', receipt_outcome = 'succeeded', updated_at = updated_at + 1, "
    "due_at = NULL, version = version + 1 WHERE {ops}",
]


def transitions(n, frm, to, cause, per=1):
    op = OP.replace("g::text", f"(g / {per})::text")
    return (
        "INSERT INTO transitions (operation_id, from_state, to_state, at, cause, actor) "
        f"SELECT {op}, '{frm}', '{to}', 1700000000000, '{cause}', 'worker' FROM {ids(n, per)} g"
    )


def call(n, kind):
    return (
        "INSERT INTO pushary_calls (operation_id, call, started_at, duration_ms, status_code) "
        f"SELECT {OP}, '{kind}', 1700000000000, 1, 200 FROM {ids(n)} g"
    )


def lease(rows, ops, threads):
    """A visit's two statements: the lease taken with the first read, and
    the last read with the lease let go; `rows` are the lease rows'
    source, `ops` and `threads` the conditions naming the visited
    operations and threads. Each commits without waiting for the WAL's
    flush, as approvald's do (decisions §23)."""
    read = f"SELECT count(*) FROM operations WHERE {ops} AND due_at IS NOT NULL"
    take = (
        f"INSERT INTO thread_leases (tenant, thread_id, owner, until) {rows} ON CONFLICT (tenant, thread_id) "
        "DO UPDATE SET owner = excluded.owner, until = excluded.until"
    )
    release = f"DELETE FROM thread_leases WHERE tenant = 'default' AND {threads}"
    return one_statement([take], read, commit_async=True), one_statement([release], read, commit_async=True)


def visit(n, k):
    """`lease` for the batch's k-th operation alone, by statements of its
    own, as approvald visits a thread."""
    g = f"((:b)::int * {n} + {k + 1})"
    op, thread = OP.replace("g::text", f"{g}::text"), THREAD.replace("g::text", f"{g}::text")
    return lease(f"VALUES ('default', {thread}, 'w', 1700000000000)", f"id = {op}", f"thread_id = {thread}")


def script(kind, n):
    head = [f"\\set b random(0, {OPERATIONS // n - 1})", "\\set r random(1, 1000000000000000)"]
    ops = batch_ops(n)
    if kind == "rows":
        return "\n".join(head + [INBOX.format(n=n) + ";"] + [s.format(ops=ops) + ";" for s in SAVES]) + "\n"
    if kind == "visits":
        takes, releases = zip(*(visit(n, k) for k in range(n)))
    else:
        take, release = lease(
            f"SELECT 'default', {THREAD}, 'w', 1700000000000 FROM {ids(n)} g",
            ops,
            f"thread_id IN (SELECT {THREAD} FROM {ids(n)} g)",
        )
        takes, releases = [take], [release]
    steps = [
        one_statement([INBOX.format(n=n), f"UPDATE operations SET inbox_at = 1700000000000 WHERE {ops}"]),
        *takes,
        one_statement(
            [
                SAVES[0].format(ops=ops),
                transitions(n, "pending", "answered", "answer received via callback"),
                "UPDATE inbox SET state = 'processed', processed_at = 1, operation_id = 'x' WHERE tenant = 'default' "
                f"AND correlation_id IN (SELECT 'c' || (:r)::bigint || '_' || g FROM generate_series(1, {n}) g)",
            ]
        ),
        one_statement(
            [SAVES[1].format(ops=ops), transitions(n, "answered", "permitted", "permit consumed", per=2), call(n, "consume")]
        ),
        one_statement(
            [
                SAVES[2].format(ops=ops),
                transitions(n, "delivering", "succeeded", "the effect target confirmed"),
                "INSERT INTO deliveries (operation_id, attempt, started_at, duration_ms, status_code, response_body) "
                f"SELECT {OP}, 1, 1700000000000, 1, 200, '{{\"ok\": true}}' FROM {ids(n)} g",
            ]
        ),
        one_statement([SAVES[3].format(ops=ops), call(n, "receipt")]),
        *releases,
    ]
    return "\n".join(head + steps) + "\n"


def one_statement(writes, read="SELECT 1", commit_async=False):
    """A step as one statement (its writes as data-modifying `WITH` parts,
    then `read`), sent and committed as approvald sends a step: one round
    trip. `commit_async` sets `synchronous_commit` off for the
    statement's own transaction, as approvald's lease statements do."""
    parts = ", ".join(f"w{i} AS ({w} RETURNING 1)" for i, w in enumerate(writes))
    tail = f"SELECT ({read})" + (", set_config('synchronous_commit', 'off', true)" if commit_async else "")
    return f"WITH {parts} {tail};"


def psql(sql, url=DB_URL):
    subprocess.run(["psql", "-q", "-v", "ON_ERROR_STOP=1", url, "-c", sql], check=True, capture_output=True)


def cpu():
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return fields[0] + fields[1] + fields[2] + fields[5] + fields[6], fields[3] + fields[4]


def run(path, clients, per_script):
    psql("VACUUM")
    busy0, idle0 = cpu()
    out = subprocess.run(
        ["pgbench", "-n", "-M", "prepared", "-c", str(clients), "-j", "2", "-T", str(SECONDS), "-f", path, DB_URL],
        capture_output=True,
        text=True,
    )
    busy1, idle1 = cpu()
    tps = re.search(r"tps = ([0-9.]+)", out.stdout)
    if out.returncode != 0 or not tps or "error" in out.stderr.lower():
        raise SystemExit(f"pgbench failed on {path}:\n{out.stderr[-2000:]}")
    busy, idle = busy1 - busy0, idle1 - idle0
    hz = os.sysconf("SC_CLK_TCK")
    rate = float(tps.group(1)) * per_script
    return rate, 100 * busy / (busy + idle), 1000 * busy / hz / (rate * SECONDS)


def span(results, k, fmt):
    """The least and the most of field `k` over the rounds, as `lo–hi`."""
    lo, hi = min(r[k] for r in results), max(r[k] for r in results)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"


def main():
    psql(f"CREATE DATABASE {DB}", URL)
    try:
        for migration in sorted((ROOT / "migrations" / "postgres").glob("*.sql")):
            subprocess.run(["psql", "-q", "-v", "ON_ERROR_STOP=1", DB_URL, "-f", str(migration)], check=True)
        psql(
            "INSERT INTO operations (id, tenant, operation_key, fingerprint, thread_id, interrupt_id, effect, "
            "decision_type, spec, decision_request, state, decision_id, idempotency_key, deadline, created_at, "
            "updated_at, poll_at, opened_at) "
            f"SELECT {OP}, 'default', {OPERATION_KEY}, md5(g::text) || md5(g::text), {THREAD}, 'int-' || g, "
            f"'bench', 'confirm', repeat('s', {SPEC}), repeat('d', {REQUEST}), 'pending', {DECISION}, "
            "'idem_' || g, 9999999999999, 1700000000000 + g, 1700000000000 + g, 1700000060000 + g, "
            f"1700000000000 + g FROM generate_series(1, {OPERATIONS}) g"
        )
        for index in DROP:
            psql(f"ALTER TABLE operations DROP CONSTRAINT IF EXISTS {index}; DROP INDEX IF EXISTS {index}")
        psql("CREATE TABLE bench_baseline (id BIGSERIAL PRIMARY KEY, body TEXT NOT NULL)")
        psql("VACUUM ANALYZE")
        tmp = pathlib.Path(tempfile.mkdtemp())
        runs = [("baseline: single-row commits", "INSERT INTO bench_baseline (body) VALUES (repeat('x', 300));\n", 64, 1)]
        for kind in KINDS:
            for n in BATCHES:
                runs.append((f"{kind}, {n} per batch", script(kind, n), min(64, max(4, 128 // n)), n))
        results = {name: [] for name, *_ in runs}
        for r in range(ROUNDS):
            for i, (name, text, clients, n) in enumerate(runs):
                path = tmp / f"s{i}.sql"
                path.write_text(text)
                results[name].append(run(str(path), clients, n))
                rate, busy, ms = results[name][-1]
                print(f"round {r + 1}: {name}: {rate:.0f}/s, {busy:.0f}% busy, {ms:.3f} ms", file=sys.stderr)
        print(f"| run ({SECONDS} s each, {ROUNDS} rounds) | clients | per s | machine busy | machine CPU ms each |")
        print("|---|---|---|---|---|")
        for name, _, clients, _ in runs:
            rs = results[name]
            print(f"| {name} | {clients} | {span(rs, 0, '{:.0f}')} | {span(rs, 1, '{:.0f}%')} | {span(rs, 2, '{:.3f}')} |")
    finally:
        psql(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)", URL)


if __name__ == "__main__":
    main()

-- A thread lease is written twice per worker visit (take, release). As a
-- logged table each of those was a durable commit waiting on a WAL flush,
-- two of the six per approval. Unlogged, they write no WAL and wait for no
-- flush. What is given up is only the leases themselves after a server
-- crash or a failover, when the table starts empty: every holder's
-- connection died with the server, each operation still moves only by
-- compare-and-set on its version, a consume or delivery in flight is
-- recorded durably before it is made, and a thread's answers resume in
-- order by `resume_seq`, not by lease (docs/decisions.md §15).
ALTER TABLE thread_leases SET UNLOGGED;

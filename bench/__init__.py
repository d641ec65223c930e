"""idemctl benchmarks: the ledger's cost against the physical floor.

Every figure is a ratio against a floor measured in the same run, on the same
file system, with identically configured connections: raw sqlite3 (or raw
psycopg, or raw PyMySQL) statements doing the least the contract needs. Each figure is a
median with its min-max over several repetitions, because shared machines are
noisy.

    python -m bench            # the full suite, about 11 minutes on 2 cores
    python -m bench --peers    # the same, then idemctl beside its peers (10)
    python -m bench --quick    # every benchmark at tiny sizes: harness check only
    python -m bench --report   # render docs/performance.md from results/latest.json

One module per measurement: cycle (1), middleware (2), contention (3),
growth (4), sweep (5, and the operator commands' memory of 6), memory (6, the
long-running worker), postgres (7), mysql (7b, MariaDB), asgi (8), group_commit (9), peers (10,
with peers_systems: each system through its real entry point, and
peers_facts: the correctness scenarios the test suite also checks). Raw
results go to results/latest.json; `report` renders them."""

"""The operator's tools beyond the ledger's own reads: copying a ledger to
another (`copying`), and whether its database keeps acknowledged
completions across a failover (`replication`, over the facts each engine
reads and assesses in `idemctl.storage.failover`; `replication_mysql` and
`findings` are the old paths of those). The CLI's `copy` and `doctor` use them, through
`Ledger.operator` and `check_failover`.

Nothing is imported here, so that the ledger can use `copying` without
loading the rest."""

"""`idemctl doctor`: whether the ledger's database keeps acknowledged
completions across a failover, checked for its engine: PostgreSQL's
synchronous replication, MariaDB Galera's cluster state and causal reads,
MariaDB/MySQL replication and durability settings; a SQLite file has none."""

from __future__ import annotations

import typer

from ..ledger import Ledger
from ..operations.replication import check_failover
from ..storage import reads_where_it_writes
from .core import EXIT_NO, IdemctlCommand, app, settings
from .documents import failover_check_json
from .options import DbOpt, JsonOpt
from .output import emit_json, one_line


@app.command(cls=IdemctlCommand, epilog="Example: idemctl doctor --db 'postgresql://app@db1,db2/payments'")
def doctor(ctx: typer.Context, json_out: JsonOpt = False, db: DbOpt = None) -> None:
    """Check, for the ledger's engine, that a completion it acknowledged survives a failover (exit 1 on a warning)."""
    s = settings(ctx, db=db)
    # The server the request path writes to: on PostgreSQL, with several hosts
    # in the URL, only a read-write opening is sure to reach the one that accepts writes now.
    with Ledger.open(
        s.db, create=False, readonly=reads_where_it_writes(s.db), busy_timeout_ms=s.busy_timeout_ms
    ) as ledger:
        check = check_failover(ledger.operator)
    if json_out:
        emit_json(failover_check_json(check))
    else:
        typer.echo(f"{one_line(check.where)} ({one_line(check.engine)})")
        for finding in check.findings:
            typer.echo(f"{finding.severity.value}: {one_line(finding.message)}")
    if not check.ok:
        raise typer.Exit(EXIT_NO)

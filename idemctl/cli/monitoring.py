"""`idemctl monitoring`: print the Prometheus rules or the Grafana dashboard
the package ships (idemctl/monitoring/), or where they are installed."""

from __future__ import annotations

from typing import Annotated

import typer

from ..monitoring import MonitoringFile, path, rules_text, text
from .core import IdemctlCommand, UserError, app
from .options import complete_from, flag

WHAT = {"rules": MonitoringFile.RULES, "dashboard": MonitoringFile.DASHBOARD}


@app.command(
    cls=IdemctlCommand,
    epilog=(
        "Example: idemctl monitoring rules --runbook-url https://git.example/ops/idemctl/runbook.md "
        "> /etc/prometheus/rules/idemctl.yml\n\n"
        "Example: idemctl monitoring dashboard > idemctl-dashboard.json  (Grafana: Dashboards, New, Import)"
    ),
)
def monitoring(
    what: Annotated[
        str,
        typer.Argument(
            metavar="WHAT",
            help="rules (Prometheus recording and alerting rules, YAML) or dashboard (Grafana, JSON).",
            show_default=False,
            autocompletion=complete_from(list(WHAT)),
        ),
    ],
    where: Annotated[
        bool, flag("--where", help="Print where the installed file is instead of its text (to read it in place).")
    ] = False,
    runbook_url: Annotated[
        str | None,
        typer.Option(
            "--runbook-url",
            metavar="URL",
            help="With rules: where your team reads docs/runbook.md; each alert's runbook_url becomes URL#section.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Print the Prometheus rules or the Grafana dashboard shipped with idemctl."""
    which = WHAT.get(what)
    if which is None:
        raise UserError(f"WHAT must be rules or dashboard, got {what!r}")
    if runbook_url is not None and which is not MonitoringFile.RULES:
        raise UserError("--runbook-url only applies to `idemctl monitoring rules`")
    if where:
        if runbook_url is not None:
            raise UserError(
                "--where prints where the shipped file is; --runbook-url changes the printed text: give one"
            )
        typer.echo(str(path(which)))
        return
    typer.echo(rules_text(runbook_url=runbook_url) if which is MonitoringFile.RULES else text(which), nl=False)

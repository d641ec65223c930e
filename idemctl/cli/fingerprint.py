"""`idemctl fingerprint`: a request's fingerprint, and what the ledger would
do with it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..fingerprint import check_key, fingerprint_body, header_values
from ..fingerprint import fingerprint as compute_fingerprint
from ..outcomes import Prediction, Verdict
from .core import EXIT_NO, IdemctlCommand, UserError, app, command_policy, open_ledger, settings
from .documents import fingerprint_json
from .escaping import visible
from .options import DbOpt, JsonOpt, TtlOpt
from .output import emit_json
from .words import verdict_words


def _read_body(body: str | None, body_file: str | None) -> bytes:
    if body is not None and body_file is not None:
        raise UserError("give --body or --body-file, not both")
    if body is not None:
        return body.encode("utf-8")
    if body_file is None:
        return b""
    if body_file == "-":
        return typer.get_binary_stream("stdin").read()
    try:
        return Path(body_file).read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read --body-file {body_file}: {exc.strerror or exc}") from None


def _parse_headers(values: list[str]) -> list[tuple[str, str]]:
    """--header values as (name, value) pairs; the value as given, spaces included.

    >>> _parse_headers(["Content-Type: application/json"])
    [('Content-Type', ' application/json')]
    """
    pairs = []
    for value in values:
        name, sep, rest = value.partition(":")
        if not sep or not name.strip():
            raise UserError(f"--header {value!r} is not 'Name: value'")
        pairs.append((name.strip(), rest))
    return pairs


@app.command(
    cls=IdemctlCommand,
    name="fingerprint",
    epilog=(
        "Example: idemctl fingerprint -X POST --path /orders -H 'Content-Type: application/json' "
        '--body \'{"sku":"x"}\' --key order-42 -p acct_A'
    ),
)
def fingerprint_cmd(
    ctx: typer.Context,
    method: Annotated[str, typer.Option("--method", "-X", metavar="METHOD", help="HTTP method.")],
    path: Annotated[
        str, typer.Option("--path", metavar="PATH", help="Path and query exactly as received, e.g. /orders?x=1.")
    ],
    header: Annotated[
        list[str] | None,
        typer.Option("--header", "-H", metavar="'NAME: VALUE'", help="A request header; repeat for several."),
    ] = None,
    body_file: Annotated[
        str | None, typer.Option("--body-file", metavar="FILE|-", help="Raw body bytes from a file, or - for stdin.")
    ] = None,
    body: Annotated[
        str | None, typer.Option("--body", metavar="TEXT", help="Body as UTF-8 text (instead of --body-file).")
    ] = None,
    key: Annotated[
        str | None, typer.Option("--key", "-k", metavar="KEY", help="Compare with this key's stored row.")
    ] = None,
    principal: Annotated[
        str | None, typer.Option("--principal", "-p", metavar="PRINCIPAL", help="Principal of --key.")
    ] = None,
    json_body: Annotated[
        bool,
        typer.Option(
            "--json-body",
            metavar="",
            help="Fingerprint a JSON body in canonical form, as an app with Policy(fingerprint_body='json') does.",
        ),
    ] = False,
    ignore_field: Annotated[
        list[str] | None,
        typer.Option(
            "--ignore-field",
            metavar="FIELD",
            help="With --json-body: a field that does not count (dotted path, e.g. meta.sent_at); repeat for several.",
        ),
    ] = None,
    reuse_status: Annotated[
        int,
        typer.Option(
            "--reuse-status",
            metavar="STATUS",
            help="With --key: the status the app's Policy(reuse_status=...) answers a reused key with, 409 or 422.",
        ),
    ] = 409,
    json_out: JsonOpt = False,
    db: DbOpt = None,
    ttl: TtlOpt = None,
) -> None:
    """Print a request's fingerprint; with --key, whether it would replay or be refused as reused."""
    if reuse_status not in (409, 422):
        raise UserError(f"--reuse-status must be 409 or 422 (the Policy's choices), got {reuse_status}")
    if ignore_field and not json_body:
        raise UserError("--ignore-field needs --json-body")
    if (key is None) != (principal is None):
        raise UserError("--key and --principal go together")
    for option, given in (("--db", db is not None), ("--ttl", ttl is not None)):
        if given and key is None:
            raise UserError(f"{option} only applies with --key (to compare with a stored row)")
    if key is not None:
        key = check_key(key)
    raw = _read_body(body, body_file)
    pairs = _parse_headers(header or [])
    policy = command_policy(settings(ctx, ttl=ttl))
    mode = "json" if json_body else "raw"
    counted, body_form = fingerprint_body(raw, pairs, mode, tuple(ignore_field or ()))
    fp = compute_fingerprint(method, path, pairs, counted, policy.fingerprint_headers)
    prediction: Prediction | None = None
    if key is not None and principal is not None:
        with open_ledger(ctx, db, ttl=ttl) as ledger:
            prediction = ledger.predict(principal, key, fp)
    if json_out:
        headers = header_values(pairs, policy.fingerprint_headers)
        emit_json(fingerprint_json(fp, method, path, headers, len(raw), prediction, body_form))
    else:
        typer.echo(fp)
        if json_body:
            ignored = f", without {', '.join(ignore_field or ())}" if ignore_field else ""
            canonical = "the canonical JSON form (key order and whitespace do not count)"
            form = canonical if body_form == "json" else body_form
            typer.echo(f"body: {form}{ignored}")
        if prediction is not None:
            typer.echo(verdict_words(prediction, reuse_status))
            if prediction.verdict is Verdict.REUSED and prediction.view is not None:
                typer.echo(f"stored: {visible(prediction.view.row.fingerprint)}")
    if prediction is not None and prediction.verdict in (Verdict.NEW, Verdict.REUSED):
        raise typer.Exit(EXIT_NO)

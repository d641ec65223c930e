"""`await ledger.aclose()` straight after a request on PostgreSQL's
asynchronous path: the post-response sweep it scheduled either finishes
before the connections close or does not run, and never opens a pool of its
own that nobody closes (tasks and server connections left behind)."""

from __future__ import annotations

import asyncio
from urllib.parse import parse_qs, urlsplit

import pytest

from idemctl import Ledger
from idemctl.asgi import IdempotencyMiddleware
from tests.adapters.test_gate import call, scope_for

psycopg = pytest.importorskip("psycopg")

pytestmark = pytest.mark.engines("postgres")


async def orders(scope, receive, send):  # type: ignore[no-untyped-def]
    await receive()
    await send({"type": "http.response.start", "status": 201, "headers": []})
    await send({"type": "http.response.body", "body": b"made"})


def server_connections(postgres_server: str, application_name: str) -> int:
    with psycopg.connect(postgres_server, autocommit=True) as admin:
        row = admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (application_name,)
        ).fetchone()
        return int(row[0])


@pytest.mark.parametrize("pause_s", [0.0, 0.001, 0.2], ids=["at-once", "mid-sweep", "after-the-sweep"])
def test_aclose_straight_after_a_request_leaves_no_pool_task_and_no_server_connection(
    make_ledger, ledger_target, postgres_server, pause_s
):
    make_ledger().close()  # the schema; its synchronous pool closed, to count only what follows
    application_name = parse_qs(urlsplit(ledger_target).query)["application_name"][0]

    async def requests() -> tuple[list[int], int]:
        statuses = []
        for n in range(10):
            ledger = Ledger.open(ledger_target)
            app = IdempotencyMiddleware(orders, ledger, principal=lambda scope: scope["user"])
            statuses.append((await call(app, scope_for(f"k{n}")))[0])
            if pause_s:  # none: aclose before the sweep the answer scheduled has started
                await asyncio.sleep(pause_s)
            await ledger.aclose()
            ledger.close()
        await asyncio.sleep(0.2)  # whatever the requests left scheduled gets to run
        return statuses, len([t for t in asyncio.all_tasks() if t is not asyncio.current_task()])

    statuses, pending = asyncio.run(requests())
    assert statuses == [201] * 10
    assert pending == 0
    assert server_connections(postgres_server, application_name) == 0

"""The stand-in for D1's HTTP API answers as Cloudflare does: Cloudflare's
official Python SDK (`cloudflare`, its d1 query types) reads its answers,
its errors arrive as the SDK's exception classes for those statuses, and
idemctl's engine reads the same answers."""

from __future__ import annotations

import pytest

from .runtime import ACCOUNT, DATABASE, TOKEN, Runtime

pytestmark = pytest.mark.slow


@pytest.fixture
def sdk(runtime: Runtime):  # type: ignore[no-untyped-def]
    try:
        import cloudflare
    except ImportError:
        import os

        if os.environ.get("CI"):
            pytest.fail("CI checks the stand-in against Cloudflare's SDK: pip install cloudflare", pytrace=False)
        pytest.skip("Cloudflare's SDK is not installed (pip install cloudflare)")
    return cloudflare


def test_the_sdk_reads_the_stand_ins_query_and_raw_answers(runtime: Runtime, sdk) -> None:  # type: ignore[no-untyped-def]
    from cloudflare.types.d1 import QueryResult
    from cloudflare.types.d1.database_raw_response import DatabaseRawResponse

    client = sdk.Cloudflare(api_token=TOKEN, base_url=runtime.base, max_retries=0)
    page = client.d1.database.query(DATABASE, account_id=ACCOUNT, sql="SELECT ?1 AS a, ?2 AS b", params=["x", "y"])
    results = list(page)
    assert len(results) == 1 and isinstance(results[0], QueryResult)
    assert results[0].success is True
    assert results[0].results == [{"a": "x", "b": "y"}]
    assert results[0].meta is not None and results[0].meta.changed_db is False
    raw = list(client.d1.database.raw(DATABASE, account_id=ACCOUNT, sql="SELECT 1 AS one, 'two' AS two"))
    assert isinstance(raw[0], DatabaseRawResponse)
    assert raw[0].results is not None
    assert (raw[0].results.columns, raw[0].results.rows) == (["one", "two"], [[1, "two"]])
    batch = list(
        client.d1.database.query(
            DATABASE, account_id=ACCOUNT, batch=[{"sql": "SELECT 1 AS n"}, {"sql": "SELECT ? AS n", "params": ["2"]}]
        )
    )
    assert [r.results for r in batch] == [[{"n": 1}], [{"n": "2"}]]


def test_the_stand_ins_errors_are_the_sdks_errors_for_those_statuses(runtime: Runtime, sdk) -> None:  # type: ignore[no-untyped-def]
    bad = sdk.Cloudflare(api_token="not-the-token", base_url=runtime.base, max_retries=0)
    with pytest.raises(sdk.PermissionDeniedError) as refused:
        bad.d1.database.query(DATABASE, account_id=ACCOUNT, sql="SELECT 1")
    assert refused.value.status_code == 403
    assert refused.value.body == {
        "result": None,
        "success": False,
        "errors": [{"code": 10000, "message": "Authentication error"}],
        "messages": [],
    }
    client = sdk.Cloudflare(api_token=TOKEN, base_url=runtime.base, max_retries=0)
    with pytest.raises(sdk.NotFoundError) as missing:
        client.d1.database.query("no-such-database", account_id=ACCOUNT, sql="SELECT 1")
    assert missing.value.body["errors"][0]["code"] == 7404  # type: ignore[index]
    with pytest.raises(sdk.BadRequestError) as failed:
        client.d1.database.query(DATABASE, account_id=ACCOUNT, sql="SELECT * FROM no_such_table")
    assert failed.value.body["errors"][0]["code"] == 7500  # type: ignore[index]
    assert "no such table: no_such_table" in failed.value.body["errors"][0]["message"]  # type: ignore[index]
    runtime.faults(rateLimited=1, retryAfter="0")
    with pytest.raises(sdk.RateLimitError) as limited:
        client.d1.database.query(DATABASE, account_id=ACCOUNT, sql="SELECT 1")
    assert limited.value.response.headers["retry-after"] == "0"

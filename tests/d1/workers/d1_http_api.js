// A stand-in for Cloudflare's D1 HTTP API, served over the same D1 binding the
// recipe's Worker writes: POST /client/v4/accounts/{account}/d1/database/{db}/query
// (and /raw), one statement ({"sql", "params"}) or a batch ({"batch": [...]},
// one transaction, as env.DB.batch runs it). The envelope, status codes and
// error codes are Cloudflare's (checked against the official Python SDK's
// response types in tests/d1/test_stand_in.py):
//   200 {"result": [{"results", "success", "meta"}], "success": true, "errors": [], "messages": []}
//   400 6003 (error_chain 6111): no "Authorization: Bearer ..." header
//   403 10000 "Authentication error": a token that is not this API's
//   403 7403: an account the token cannot reach
//   404 7404: no such database
//   404 7003: a path the API does not route
//   400 7400: a body that is not the query's JSON
//   400 7500: the statement failed (D1's error text)
//   429 971 with Retry-After: rate limited
// POST /__faults sets what the next calls suffer (tests only: a run of 429s,
// a delay, a run of 503s); it is not part of Cloudflare's API.
const faults = { rateLimited: 0, retryAfter: "1", delayMs: 0, delays: 0, unavailable: 0, calls: 0 };

function envelope(status, result, errors = [], headers = {}) {
  return new Response(
    JSON.stringify({ result, success: errors.length === 0, errors, messages: [] }),
    { status, headers: { "content-type": "application/json", ...headers } },
  );
}

function failure(status, code, message, extra = {}, headers = {}) {
  return envelope(status, null, [{ code, message, ...extra }], headers);
}

function asArrays(results) {
  const columns = results.length ? Object.keys(results[0]) : [];
  return { columns, rows: results.map((row) => columns.map((c) => row[c])) };
}

export default {
  async fetch(request, env) {
    const url = new URL(request.url);
    if (url.pathname === "/__faults") {
      if (request.method === "POST") Object.assign(faults, await request.json());
      return new Response(JSON.stringify(faults), { headers: { "content-type": "application/json" } });
    }
    const route = url.pathname.match(/^\/client\/v4\/accounts\/([^/]+)\/d1\/database\/([^/]+)\/(query|raw)$/);
    if (!route || request.method !== "POST") {
      return failure(404, 7003, `Could not route to ${url.pathname}, perhaps your object identifier is invalid?`);
    }
    const [, account, database, form] = route;
    const auth = request.headers.get("authorization") ?? "";
    const bearer = auth.match(/^Bearer (\S+)$/);
    if (!bearer) {
      return failure(400, 6003, "Invalid request headers", {
        error_chain: [{ code: 6111, message: "Invalid format for Authorization header" }],
      });
    }
    if (bearer[1] !== env.API_TOKEN) return failure(403, 10000, "Authentication error");
    if (account !== env.ACCOUNT_ID) {
      return failure(403, 7403, "The given account is not valid or is not authorized to access this service");
    }
    if (database !== env.DATABASE_ID) return failure(404, 7404, `The database ${database} could not be found`);
    faults.calls += 1;
    if (faults.rateLimited > 0) {
      faults.rateLimited -= 1;
      return failure(429, 971, "Please wait and consider throttling your request speed", {}, {
        "retry-after": faults.retryAfter,
      });
    }
    if (faults.unavailable > 0) {
      faults.unavailable -= 1;
      return failure(503, 7500, "D1 is temporarily unavailable");
    }
    if (faults.delays > 0) {
      faults.delays -= 1;
      await new Promise((resolve) => setTimeout(resolve, faults.delayMs));
    }
    let body;
    try {
      body = await request.json();
    } catch {
      return failure(400, 7400, "Malformed JSON in request body");
    }
    const batch = Array.isArray(body?.batch) ? body.batch : null;
    const queries = batch ?? [body];
    if (!queries.length || queries.some((q) => typeof q?.sql !== "string")) {
      return failure(400, 7400, "Malformed JSON in request body");
    }
    let outcomes;
    try {
      const statements = queries.map((q) => env.DB.prepare(q.sql).bind(...(q.params ?? [])));
      outcomes = batch ? await env.DB.batch(statements) : [await statements[0].all()];
    } catch (e) {
      return failure(400, 7500, String(e?.message ?? e));
    }
    return envelope(
      200,
      outcomes.map((o) => ({
        results: form === "raw" ? asArrays(o.results ?? []) : o.results ?? [],
        success: o.success,
        meta: o.meta,
      })),
    );
  },
};

-- The recipe's ledger table and index, translated to PostgreSQL with the same
-- table, column and index names, so the same queries, tools and runbooks work
-- on both engines. Never change this file: later versions add tables and
-- nullable columns that the recipe's own statements ignore.
--
-- Two deliberate type choices:
--  * times are BIGINT milliseconds since the epoch (INTEGER is 32-bit here);
--  * response_body is BYTEA, not TEXT. A PostgreSQL TEXT value cannot hold
--    bytes that are not valid UTF-8, nor even valid UTF-8 containing U+0000,
--    and SQLite's "TEXT when valid UTF-8, else BLOB" has no equivalent in one
--    PostgreSQL column. idemctl stores the exact response bytes and, on read,
--    hands back text when they decode as UTF-8 and bytes otherwise, which is
--    exactly what it stored on SQLite: replays are byte-exact on both.
--    To read a body in psql: convert_from(response_body, 'UTF8').
CREATE TABLE IF NOT EXISTS idempotency_keys (
  principal         TEXT NOT NULL,                   -- server-derived account/user id, never client-supplied
  key               TEXT NOT NULL,
  fingerprint       TEXT NOT NULL,
  status            TEXT NOT NULL DEFAULT 'pending', -- 'pending' | 'completed'
  generation        INTEGER NOT NULL DEFAULT 1,      -- fencing token, bumped on takeover
  response_status   INTEGER,
  response_body     BYTEA,                           -- bounded by the policy's body cap
  response_headers  TEXT,                            -- JSON-encoded allowlisted headers
  created_at        BIGINT NOT NULL,                 -- ms since epoch
  updated_at        BIGINT NOT NULL,                 -- ms since epoch
  PRIMARY KEY (principal, key)
);

CREATE INDEX IF NOT EXISTS idx_idempotency_keys_updated_at ON idempotency_keys (updated_at);

-- idemctl schema version 3: a key's identity.
--
-- A client may send the Idempotency-Key as an RFC 8941 sf-string ("k", as
-- the IETF draft does) or as a bare token (k). idemctl reads both as the key
-- k, but the recipe's Worker, and idemctl before it parsed sf-strings,
-- stored the header as it came: the row of "k" holds the quotes. key_id is
-- the key a stored value names, computed by the database from the key
-- column, so it is right for every writer: the string inside a value that
-- begins with a double quote (backslash escapes undone, anything after the
-- closing quote ignored), any other value as it is. The unique index makes
-- "k" and k one reservation for every writer at once: a claim of k fails
-- while a row "k" exists for the same principal, and an older writer's
-- INSERT of "k" fails while a row k exists, so neither runs the mutation a
-- second time. idemctl looks rows up by (principal, key_id).
--
-- Inside the value, \\ and \" are first replaced by the control characters
-- 0x01 and 0x02 (never in a key), so the first remaining double quote is the
-- one that closes the string. A value with no closing quote is its own key.
-- E'' literals: their backslashes mean the same whatever
-- standard_conforming_strings says. Adding a stored column rewrites the
-- table once, under an exclusive lock (docs/runbook.md).
ALTER TABLE idempotency_keys ADD COLUMN IF NOT EXISTS key_id TEXT GENERATED ALWAYS AS (
  CASE
    WHEN substr(key, 1, 1) <> '"'
      OR strpos(replace(replace(substr(key, 2), E'\\\\', E'\x01'), E'\\"', E'\x02'), '"') = 0
    THEN key
    ELSE replace(replace(substr(
           replace(replace(substr(key, 2), E'\\\\', E'\x01'), E'\\"', E'\x02'), 1,
           strpos(replace(replace(substr(key, 2), E'\\\\', E'\x01'), E'\\"', E'\x02'), '"') - 1),
         E'\x01', E'\\'), E'\x02', '"')
  END
) STORED;

CREATE UNIQUE INDEX IF NOT EXISTS idx_idempotency_keys_key_id ON idempotency_keys (principal, key_id);

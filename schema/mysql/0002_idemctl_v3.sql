-- idemctl schema version 3: a key's identity.
--
-- A client may send the Idempotency-Key as an RFC 8941 sf-string ("k", as
-- the IETF draft does) or as a bare token (k). idemctl reads both as the key
-- k, but a row copied from a ledger the recipe's Worker (or idemctl before it
-- parsed sf-strings) wrote holds the header as it came: the row of "k" holds
-- the quotes. key_id is the key a stored value names, computed by the
-- database from the key column, so it is right for every writer: the string
-- inside a value that begins with a double quote (backslash escapes undone,
-- anything after the closing quote ignored), any other value as it is. The
-- unique index makes "k" and k one reservation: a claim of k finds a row "k"
-- of the same principal in its way. idemctl looks rows up by
-- (principal, key_id).
--
-- Inside the value, \\ and \" are first replaced by the bytes 0x01 and 0x02
-- (never in a key), so the first remaining double quote is the one that
-- closes the string. A value with no closing quote is its own key. Hex
-- literals, so no backslash depends on the server's sql_mode. One ALTER:
-- the column and its index arrive together or not at all (MySQL has no
-- IF NOT EXISTS here: an init run again after a later failure finds them,
-- and goes on).
ALTER TABLE idempotency_keys
  ADD COLUMN key_id VARBINARY(255) GENERATED ALWAYS AS (
    CASE
      WHEN SUBSTRING(`key`, 1, 1) <> X'22'
        OR LOCATE(X'22', REPLACE(REPLACE(SUBSTRING(`key`, 2), X'5C5C', X'01'), X'5C22', X'02')) = 0
      THEN `key`
      ELSE REPLACE(REPLACE(SUBSTRING(
             REPLACE(REPLACE(SUBSTRING(`key`, 2), X'5C5C', X'01'), X'5C22', X'02'), 1,
             LOCATE(X'22', REPLACE(REPLACE(SUBSTRING(`key`, 2), X'5C5C', X'01'), X'5C22', X'02')) - 1),
           X'01', X'5C'), X'02', X'22')
    END
  ) STORED,
  ADD UNIQUE INDEX idx_idempotency_keys_key_id (principal, key_id);

-- idemctl schema version 2 for MariaDB (10.6 and later) and MySQL (8.0 and
-- later), in one file: no database written by the recipe or by an older
-- idemctl exists on these engines, so there is nothing to upgrade from.
-- The same tables, columns and index names as schema/sqlite and
-- schema/postgres, so the same queries, tools and runbooks work on all three.
-- Only CREATE TABLE IF NOT EXISTS, with the indexes inside it: MySQL has no
-- CREATE INDEX IF NOT EXISTS, and `init` may run this again after a partial
-- failure (DDL is not transactional here; inits on one server serialise on
-- GET_LOCK, and on a Galera cluster, where that lock is per node, the DDL
-- is ordered cluster-wide and the version row is decided by one INSERT).
--
-- Deliberate type choices:
--  * principal and key are VARBINARY: compared byte for byte. The utf8mb4
--    collations are PAD SPACE (MySQL's utf8mb4_bin too), which would make
--    the keys 'k' and 'k ' one row, and the _ci ones would merge 'K' and 'k'.
--    A key is at most 255 printable ASCII bytes; a principal at most 512
--    bytes of UTF-8, on every engine (idemctl refuses a longer one before
--    any statement). The column holds up to 1024, so the primary key stays
--    inside InnoDB's 3072-byte limit with ROW_FORMAT=DYNAMIC whatever the
--    table's character set, and a later idemctl may raise the limit
--    without an ALTER TABLE.
--  * response_body is LONGBLOB: the exact response bytes, valid UTF-8 or
--    not; idemctl hands back text when they decode as UTF-8 and bytes
--    otherwise, as on the other engines. A statement carrying it must fit
--    the server's max_allowed_packet (docs/mysql.md).
--  * text that is not an identifier is utf8mb4 with a binary collation.
--  * times are BIGINT milliseconds since the epoch.

-- Which idemctl schema this database holds. A version newer than the running
-- idemctl knows makes it refuse to write rather than guess. Made first: an
-- init that finds idempotency_keys without it knows no idemctl made that
-- table (an init on another Galera node may be between its statements).
CREATE TABLE IF NOT EXISTS idemctl_schema_version (
  version     INTEGER PRIMARY KEY,
  applied_at  BIGINT NOT NULL                        -- ms since epoch
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

CREATE TABLE IF NOT EXISTS idempotency_keys (
  principal         VARBINARY(1024) NOT NULL,        -- server-derived account/user id, never client-supplied
  `key`             VARBINARY(255) NOT NULL,
  fingerprint       VARCHAR(255) NOT NULL,
  status            VARCHAR(16) NOT NULL DEFAULT 'pending', -- 'pending' | 'completed'
  generation        INTEGER NOT NULL DEFAULT 1,      -- fencing token, bumped on takeover
  response_status   INTEGER,
  response_body     LONGBLOB,                        -- bounded by the policy's body cap
  response_headers  MEDIUMTEXT,                      -- JSON-encoded allowlisted headers
  created_at        BIGINT NOT NULL,                 -- ms since epoch
  updated_at        BIGINT NOT NULL,                 -- ms since epoch
  token             BIGINT,                          -- fencing token drawn by every claim and takeover
  PRIMARY KEY (principal, `key`),
  INDEX idx_idempotency_keys_updated_at (updated_at)
) ENGINE=InnoDB ROW_FORMAT=DYNAMIC DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

-- Durable record of late completions that the fencing token rejected: each
-- row means a mutation may have run twice and an operator should look.
CREATE TABLE IF NOT EXISTS idemctl_fenced_out (
  id                     BIGINT AUTO_INCREMENT PRIMARY KEY,
  principal              VARBINARY(1024) NOT NULL,
  `key`                  VARBINARY(255) NOT NULL,
  superseded_generation  INTEGER NOT NULL,          -- the late owner's generation
  current_generation     INTEGER,                   -- what the row held then (NULL: row gone)
  computed_status        INTEGER NOT NULL,          -- status the late owner computed
  fenced_at              BIGINT NOT NULL,           -- ms since epoch
  INDEX idx_idemctl_fenced_out_fenced_at (fenced_at),
  INDEX idx_idemctl_fenced_out_principal_key (principal, `key`)
) ENGINE=InnoDB ROW_FORMAT=DYNAMIC DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

-- idemctl schema version 1: additive tables only.

-- Which idemctl schema this file holds. A version newer than the running
-- idemctl knows makes it refuse to write rather than guess.
CREATE TABLE IF NOT EXISTS idemctl_schema_version (
  version     INTEGER PRIMARY KEY,
  applied_at  INTEGER NOT NULL                       -- ms since epoch
);

-- Durable record of late completions that the fencing token rejected: each
-- row means a mutation may have run twice and an operator should look.
CREATE TABLE IF NOT EXISTS idemctl_fenced_out (
  id                     INTEGER PRIMARY KEY,
  principal              TEXT NOT NULL,
  key                    TEXT NOT NULL,
  superseded_generation  INTEGER NOT NULL,          -- the late owner's generation
  current_generation     INTEGER,                   -- what the row held then (NULL: row gone)
  computed_status        INTEGER NOT NULL,          -- status the late owner computed
  fenced_at              INTEGER NOT NULL           -- ms since epoch
);

CREATE INDEX IF NOT EXISTS idx_idemctl_fenced_out_fenced_at ON idemctl_fenced_out (fenced_at);
CREATE INDEX IF NOT EXISTS idx_idemctl_fenced_out_principal_key ON idemctl_fenced_out (principal, key);

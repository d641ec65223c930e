-- idemctl schema version 2: the fencing token.
--
-- A random 63-bit number drawn by every claim and every takeover. Completing
-- or releasing a reservation needs its generation AND its token to match, so
-- an owner whose row was deleted (release, purge, sweep) and claimed again
-- cannot complete or release the new reservation, although the new one
-- starts again at generation 1. Nullable and unused by the recipe's own
-- statements, which keep working unchanged; rows they write carry NULL and
-- can only be completed by a writer that knows nothing of tokens.
ALTER TABLE idempotency_keys ADD COLUMN token INTEGER;

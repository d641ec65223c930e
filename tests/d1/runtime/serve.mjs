// Starts the D1 tests' runtime: one miniflare (workerd) with ONE D1 database
// bound to two Workers, the recipe's (recipe_worker.js around the recipe's
// code, its TypeScript types stripped here by esbuild) and the stand-in for
// D1's HTTP API (d1_http_api.js), persisted in the directory given. Prints
// one JSON line once serving ({"url", "sqlite"}); stops when stdin closes.
// Usage: node serve.mjs STATE_DIR TOKEN ACCOUNT_ID DATABASE_ID
import { build } from "esbuild";
import { Miniflare, Log, LogLevel } from "miniflare";
import { readdirSync, readFileSync } from "node:fs";
import { join, dirname } from "node:path";
import { fileURLToPath } from "node:url";

const [state, token, account, database] = process.argv.slice(2);
const here = dirname(fileURLToPath(import.meta.url));
const workers = join(here, "..", "workers");

const recipe = await build({
  entryPoints: [join(workers, "recipe_worker.js")],
  bundle: true,
  format: "esm",
  write: false,
  target: "es2022",
  logLevel: "silent",
});

const d1 = { DB: database };
const mf = new Miniflare({
  host: "127.0.0.1",
  port: 0,
  // No Request.cf from the network: the tests run offline.
  cf: false,
  d1Persist: join(state, "d1"),
  log: new Log(LogLevel.WARN),
  workers: [
    {
      name: "recipe",
      modules: true,
      script: recipe.outputFiles[0].text,
      compatibilityDate: "2025-01-01",
      d1Databases: d1,
    },
    {
      name: "d1-http-api",
      modules: true,
      script: readFileSync(join(workers, "d1_http_api.js"), "utf8"),
      compatibilityDate: "2025-01-01",
      d1Databases: d1,
      routes: ["*/client/v4/*", "*/__faults"],
      bindings: { API_TOKEN: token, ACCOUNT_ID: account, DATABASE_ID: database },
    },
  ],
});
const url = await mf.ready;
// The database's file appears with its first statement: make one.
await (await mf.getD1Database("DB", "recipe")).prepare("SELECT 1").all();
const dir = join(state, "d1", "miniflare-D1DatabaseObject");
const sqlite = readdirSync(dir).filter((f) => f.endsWith(".sqlite")).map((f) => join(dir, f))[0];
process.stdout.write(JSON.stringify({ url: url.href, sqlite }) + "\n");

let stopping = false;
async function stop() {
  if (stopping) return;
  stopping = true;
  await mf.dispose();
  process.exit(0);
}
process.stdin.on("end", stop);
process.stdin.on("close", stop);
process.stdin.resume();
process.on("SIGTERM", stop);
process.on("SIGINT", stop);

// SPDX-License-Identifier: ISC
// bench/peer/graphile_worker.js: one graphile-worker process for make
// bench-peer (bench/peer/peer.py starts two).  Its one task, `post`, sends
// the job's body to the job's target the way the dispatcher's HTTP provider
// does: POST, the same headers and JSON body, Idempotency-Key, one
// keep-alive connection per concurrent job; anything but a 200 fails the job.
//
//   node graphile_worker.js migrate   install graphile-worker's schema, exit
//   node graphile_worker.js run       work until SIGTERM; prints "ready"
//                                     once it listens for jobs
//
// Environment: PEER_GRAPHILE_DSN (postgres://...), PEER_GRAPHILE_CONCURRENCY
// (24), PEER_GRAPHILE_LOCAL_QUEUE (jobs fetched and locked per fetch, 250),
// PEER_GRAPHILE_COMPLETE_DELAY (ms over which completions are batched, 0).
// NODE_PATH points at the npm install (bench/peer/install.sh).
"use strict";
const http = require("http");
const { run, runMigrations, Logger } = require("graphile-worker");

const env = (name, dflt) => (process.env[name] === undefined || process.env[name] === "" ? dflt : process.env[name]);
const concurrency = Number(env("PEER_GRAPHILE_CONCURRENCY", "24"));
const localQueue = Number(env("PEER_GRAPHILE_LOCAL_QUEUE", "250"));
const completeDelay = Number(env("PEER_GRAPHILE_COMPLETE_DELAY", "0"));

// graphile-worker logs every job at info; only warnings and errors are
// worth the bench's time.
const logger = new Logger(() => (level, message) => {
  if (level === "error" || level === "warning") process.stderr.write(`graphile ${level}: ${message}\n`);
});

// The "batch" setting of graphile-worker's performance guide: a local queue
// (one fetch locks many jobs), batched completions, a pool of concurrency
// connections at most.
const preset = {
  worker: {
    connectionString: env("PEER_GRAPHILE_DSN", ""),
    concurrentJobs: concurrency,
    maxPoolSize: concurrency,
    pollInterval: 2000,
    localQueue: { size: localQueue },
    completeJobBatchDelay: completeDelay,
    failJobBatchDelay: completeDelay,
  },
};

const agent = new http.Agent({ keepAlive: true, maxSockets: concurrency });

function post(job) {
  const body = Buffer.from(JSON.stringify(job.body));
  const headers = Object.assign({}, job.headers, {
    "Content-Type": "application/json",
    "Content-Length": body.length,
    "Idempotency-Key": job.key,
  });
  return new Promise((resolve, reject) => {
    const req = http.request(job.target, { method: "POST", agent, headers }, (res) => {
      res.resume();
      res.on("end", () => (res.statusCode === 200 ? resolve() : reject(new Error(`HTTP ${res.statusCode}`))));
      res.on("error", reject);
    });
    req.on("error", reject);
    req.end(body);
  });
}

async function main() {
  const mode = process.argv[2];
  if (mode === "migrate") {
    await runMigrations({ preset, logger });
    return;
  }
  if (mode !== "run") throw new Error("usage: graphile_worker.js migrate|run");
  const runner = await run({ preset, logger, noHandleSignals: true, taskList: { post: (payload) => post(payload) } });
  const stop = () => { runner.stop().then(() => process.exit(0), () => process.exit(1)); };
  process.on("SIGTERM", stop);
  process.on("SIGINT", stop);
  process.stdout.write("ready\n");
  await runner.promise;
}

main().catch((e) => {
  process.stderr.write(`graphile_worker.js: ${e && e.stack ? e.stack : e}\n`);
  process.exit(1);
});

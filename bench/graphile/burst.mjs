// A burst of jobs all due at one instant through graphile-worker, for bench/first_delivery.py.
// Reads one JSON line of settings on argv[2]; says "ready" once the worker runs (asleep: nothing due), then
// reads the due time (epoch seconds) on stdin, adds the burst in one call, and prints one JSON line of results
// once every job has run: when each handler started (epoch ms), so the caller measures from the due time.
import { Logger, makeWorkerUtils, run } from "graphile-worker";
import readline from "node:readline";

const spec = JSON.parse(process.argv[2]);
const seen = new Set();
let first = null;
let last = null;
let calls = 0;
let done;
const finished = new Promise((resolve) => { done = resolve; });

const taskList = {
  deliver: async (payload) => {
    const now = Date.now();
    calls += 1;
    if (first === null || now < first) first = now;
    seen.add(payload.i);
    if (seen.size >= spec.n) {
      last = now;
      done();
    }
  },
};

// Silent: its log lines would go to stdout, where the results go.
const logger = new Logger(() => () => {});
const preset = {
  worker: {
    logger,
    connectionString: spec.url,
    schema: spec.schema,
    concurrentJobs: spec.concurrency,
    maxPoolSize: spec.concurrency + 2,
    pollInterval: spec.poll_ms,
    ...(spec.local_queue > 0 ? { localQueue: { size: spec.local_queue } } : {}),
    completeJobBatchDelay: spec.complete_batch_ms,
    failJobBatchDelay: spec.complete_batch_ms,
  },
};

const utils = await makeWorkerUtils({ preset });
await utils.migrate();
const runner = await run({ preset, taskList, noHandleSignals: true });
// A first job through the worker: its connections and prepared statements are open before the clock starts.
await utils.addJob("deliver", { i: -1 });
while (!seen.has(-1)) await new Promise((r) => setTimeout(r, 10));
seen.delete(-1);
first = null;
calls = 0;
console.log("ready");

const lines = readline.createInterface({ input: process.stdin });
const due = Number((await lines[Symbol.asyncIterator]().next()).value);
const runAt = new Date(due * 1000).toISOString();
const stored = Date.now();
// One statement: graphile_worker.add_jobs with the whole burst, as an application adding a batch would.
await utils.withPgClient((client) => client.query(
  `SELECT count(*) FROM ${spec.schema}.add_jobs((SELECT array_agg(ROW('deliver', json_build_object('i', g), NULL, $2::timestamptz, NULL, NULL, NULL, NULL)::${spec.schema}.job_spec) FROM generate_series(0, $1::int - 1) g))`,
  [spec.n, runAt]));
const storedIn = Date.now() - stored;
await finished;
await runner.stop();
await utils.release();
console.log(JSON.stringify({ first_ms: first, last_ms: last, calls, distinct: seen.size, store_ms: storedIn }));
process.exit(0);

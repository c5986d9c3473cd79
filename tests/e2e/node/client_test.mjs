// Checks the lmrpc gRPC contract from Node.js: the proto files straight from proto/, @grpc/grpc-js on the wire.
//
//   node client_test.mjs HOST:PORT [--googleapis DIR] [--api-key KEY]
//
// DIR holds google/rpc/status.proto and google/rpc/error_details.proto (the Python package
// googleapis-common-protos ships them in site-packages); without it the repo's .venv is searched. With --api-key every call carries `authorization: Bearer KEY`, and the
// "auth" check shows a call without it is UNAUTHENTICATED while health answers without one.
// Prints a JSON summary on stdout; exits 1 if any check failed (each failure explained on stderr).

import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";
import protobuf from "protobufjs";

const HERE = path.dirname(fileURLToPath(import.meta.url));
const REPO = path.resolve(HERE, "..", "..", "..");
const PROTO_ROOT = path.join(REPO, "proto");
const DEADLINE_MS = 120_000;

function parseArgs(argv) {
  const args = { target: "", googleapis: "", apiKey: "" };
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === "--googleapis") args.googleapis = argv[++i] ?? "";
    else if (argv[i] === "--api-key") args.apiKey = argv[++i] ?? "";
    else if (!args.target) args.target = argv[i];
    else throw new Error(`unexpected argument ${argv[i]}`);
  }
  if (!args.target) throw new Error("usage: node client_test.mjs HOST:PORT [--googleapis DIR] [--api-key KEY]");
  return args;
}

function findGoogleapis(given) {
  const candidates = given ? [given] : [];
  if (!given) {
    const lib = path.join(REPO, ".venv", "lib");
    for (const py of fs.existsSync(lib) ? fs.readdirSync(lib) : []) {
      candidates.push(path.join(lib, py, "site-packages"));
    }
  }
  for (const dir of candidates) {
    if (fs.existsSync(path.join(dir, "google", "rpc", "error_details.proto"))) return dir;
  }
  throw new Error(`google/rpc/error_details.proto not found in ${candidates.join(", ") || "(nothing)"}; `
    + "pass --googleapis DIR");
}

// Adds `authorization: Bearer KEY` to every call of a client (an insecure channel takes no call credentials).
function withApiKey(key) {
  return (options, nextCall) => new grpc.InterceptingCall(nextCall(options), {
    start(metadata, listener, next) {
      metadata.set("authorization", `Bearer ${key}`);
      next(metadata, listener);
    },
  });
}

function loadServices(target, apiKey) {
  const definition = protoLoader.loadSync(["lmrpc/v1/generate.proto", "lmrpc/v1/openai.proto"], {
    keepCase: true, longs: String, enums: String, defaults: true, oneofs: true, includeDirs: [PROTO_ROOT],
  });
  const lmrpc = grpc.loadPackageDefinition(definition).lmrpc.v1;
  const credentials = grpc.credentials.createInsecure();
  const options = apiKey ? { interceptors: [withApiKey(apiKey)] } : {};
  return {
    generate: new lmrpc.GenerateService(target, credentials, options),
    openai: new lmrpc.OpenAIService(target, credentials, options),
    keyless: new lmrpc.GenerateService(target, credentials),
  };
}

function loadRpcTypes(googleapis) {
  const root = new protobuf.Root();
  // Imports resolve against the googleapis dir; google/protobuf/* come bundled with protobufjs.
  root.resolvePath = (_origin, target) => (path.isAbsolute(target) ? target : path.join(googleapis, target));
  root.loadSync(["google/rpc/status.proto", "google/rpc/error_details.proto"], { keepCase: true });
  return { Status: root.lookupType("google.rpc.Status"), root };
}

// grpc.health.v1.Health/Check for the whole server (service ""), on the wire by hand: the request is empty, and the
// reply's field 1 (varint) is the status (1 SERVING, 2 NOT_SERVING).
function healthCheck(target) {
  const client = new grpc.Client(target, grpc.credentials.createInsecure());
  return new Promise((resolve, reject) => {
    client.makeUnaryRequest("/grpc.health.v1.Health/Check", () => Buffer.alloc(0), (buf) => buf, {},
      new grpc.Metadata(), { deadline: deadline() }, (err, reply) => {
        client.close();
        if (err) reject(err);
        else resolve(reply.length >= 2 && reply[0] === 0x08 ? ["UNKNOWN", "SERVING", "NOT_SERVING"][reply[1]] : "UNKNOWN");
      });
  });
}

const deadline = () => new Date(Date.now() + DEADLINE_MS);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function unary(client, method, request) {
  return new Promise((resolve, reject) => {
    client[method](request, { deadline: deadline() }, (err, reply) => (err ? reject(err) : resolve(reply)));
  });
}

class CheckFailed extends Error {}

function check(condition, message) {
  if (!condition) throw new CheckFailed(message);
}

// (a) A short greedy text prompt streams deltas; only the last one carries finish and usage.
async function checkStream(client) {
  const request = {
    text: ["The capital of France is"],
    sampling_params: [{ max_new_tokens: 12, temperature: 0 }],
    stream: true,
  };
  const deltas = await new Promise((resolve, reject) => {
    const got = [];
    const call = client.Generate(request, { deadline: deadline() });
    call.on("data", (m) => got.push(m));
    call.on("error", reject);
    call.on("end", () => resolve(got));
  });
  check(deltas.length > 1, `expected several deltas, got ${deltas.length}`);
  const last = deltas[deltas.length - 1];
  const finished = deltas.filter((d) => d.finish !== null);
  check(finished.length === 1 && finished[0] === last,
    `exactly the last delta must carry finish; ${finished.length} of ${deltas.length} did`);
  const reason = last.finish.reason;
  check(["FINISH_REASON_LENGTH", "FINISH_REASON_EOS"].includes(reason), `unexpected finish reason ${reason}`);
  check(last.usage !== null, "the last delta has no usage");
  const tokens = deltas.reduce((sum, d) => sum + d.token_ids.length, 0);
  check(last.usage.completion_tokens === tokens,
    `usage.completion_tokens ${last.usage.completion_tokens} != ${tokens} streamed token ids`);
  check(last.usage.prompt_tokens > 0, "usage.prompt_tokens is 0");
  check(deltas.every((d) => d.index === 0 && d.rid === last.rid && d.rid !== ""), "index/rid differ across deltas");
  const text = deltas.map((d) => d.text).join("");
  check(text.trim().length > 0, "the streamed text is empty");
  return { deltas: deltas.length, text, finish_reason: reason, usage: last.usage, rid: last.rid };
}

// (b) Cancelling a long stream after its first delta ends the call CANCELLED and the server drops the request.
async function checkCancel(client) {
  const rid = `node-cancel-${process.pid}-${Date.now()}`;
  const request = {
    text: ["Count from one to one thousand:"],
    sampling_params: [{ max_new_tokens: 4096, temperature: 0, ignore_eos: true }],
    rid: [rid],
    stream: true,
  };
  const outcome = await new Promise((resolve) => {
    let seen = 0;
    const call = client.Generate(request, { deadline: deadline() });
    call.on("data", (m) => {
      seen += 1;
      if (seen === 1) call.cancel();
      if (m.finish !== null) resolve({ seen, error: null, finish: m.finish.reason });
    });
    call.on("error", (err) => resolve({ seen, error: err }));
    call.on("end", () => resolve({ seen, error: null }));
  });
  check(outcome.error !== null, `the cancelled stream ended without an error (finish ${outcome.finish ?? "none"})`);
  const code = grpc.status[outcome.error.code];
  check(outcome.error.code === grpc.status.CANCELLED, `expected CANCELLED, got ${code}: ${outcome.error.details}`);
  check(outcome.seen >= 1, "no delta arrived before the cancel");
  // The server aborts a cancelled call's request: once nothing runs or waits (GetLoad, which changes nothing;
  // Abort would end the request itself), Abort no longer finds it. How soon is not the point: a loaded machine
  // may take a while, so wait up to 30 s.
  const until = Date.now() + 30000;
  let load = await unary(client, "GetLoad", {});
  while ((load.running_outputs > 0 || load.waiting_outputs > 0) && Date.now() < until) {
    await sleep(250);
    load = await unary(client, "GetLoad", {});
  }
  const aborted = await unary(client, "Abort", { rid: [rid] });
  check(!aborted.aborted_rid.includes(rid), `request ${rid} was still running 30 s after the cancel`);
  return { code, deltas_before_cancel: outcome.seen, still_running_after: aborted.aborted_rid };
}

function collect(client, method, request) {
  return new Promise((resolve, reject) => {
    const got = [];
    const call = client[method](request, { deadline: deadline() });
    call.on("data", (m) => got.push(m));
    call.on("error", reject);
    call.on("end", () => resolve(got));
  });
}

function failure(client, method, request) {
  return new Promise((resolve) => {
    const call = client[method](request, { deadline: deadline() });
    call.on("data", () => {});
    call.on("error", resolve);
    call.on("end", () => resolve(null));
  });
}

// (d) OpenAIService.Complete, streamed with usage: chunks of one choice, a last chunk with only the usage.
async function checkComplete(client) {
  const request = {
    prompt: ["The capital of France is"], max_tokens: 6, temperature: 0, stream: true,
    stream_options: { include_usage: true },
  };
  const chunks = await collect(client, "Complete", request);
  const usageChunk = chunks[chunks.length - 1];
  const textChunks = chunks.slice(0, -1);
  check(textChunks.length >= 1, `expected text chunks, got ${chunks.length} messages`);
  check(usageChunk.choices.length === 0 && usageChunk.usage !== null, "the last chunk is not a usage chunk");
  check(textChunks.every((c) => c.choices.length === 1 && c.object === "text_completion" && c.id === usageChunk.id),
    "text chunks must carry one choice each, under one id");
  const finish = textChunks[textChunks.length - 1].choices[0].finish_reason;
  check(["COMPLETION_FINISH_REASON_LENGTH", "COMPLETION_FINISH_REASON_STOP"].includes(finish),
    `unexpected finish_reason ${finish}`);
  const text = textChunks.map((c) => c.choices[0].text).join("");
  check(usageChunk.usage.completion_tokens > 0 && usageChunk.usage.completion_tokens <= 6,
    `completion_tokens ${usageChunk.usage.completion_tokens}`);
  check(usageChunk.usage.total_tokens === usageChunk.usage.prompt_tokens + usageChunk.usage.completion_tokens,
    "total_tokens is not the sum");
  return { chunks: chunks.length, text, finish_reason: finish, usage: usageChunk.usage, model: usageChunk.model };
}

// (e) OpenAIService.ChatComplete, not streamed: one message, the assistant's answer; an empty conversation is
// INVALID_ARGUMENT naming messages.
async function checkChat(client, rpcTypes) {
  const request = { messages: [{ role: "user", content: "Say hello." }], max_tokens: 8, temperature: 0 };
  const replies = await collect(client, "ChatComplete", request);
  check(replies.length === 1, `expected one message, got ${replies.length}`);
  const [reply] = replies;
  check(reply.object === "chat.completion" && reply.id.startsWith("chatcmpl-"), `object ${reply.object}`);
  const [choice] = reply.choices;
  check(choice.message.role === "assistant" && choice.message.content, "no assistant content");
  check(reply.usage.prompt_tokens > 0, "usage.prompt_tokens is 0");
  const invalid = await checkInvalidRequest(client, rpcTypes, "ChatComplete", { messages: [] }, "messages", "empty");
  return { content: choice.message.content, finish_reason: choice.finish_reason, usage: reply.usage, invalid };
}

// (c) An invalid request is INVALID_ARGUMENT with a google.rpc.Status + BadRequest naming the field.
async function checkInvalid(client, rpcTypes) {
  const request = { text: ["hi"], sampling_params: [{ temperature: -1 }] };
  return checkInvalidRequest(client, rpcTypes, "Generate", request, "sampling_params[0].temperature", ">= 0");
}

async function checkInvalidRequest(client, { Status, root }, method, request, field, range) {
  const err = await failure(client, method, request);
  check(err !== null, `${method} accepted an invalid ${field}`);
  const code = grpc.status[err.code];
  check(err.code === grpc.status.INVALID_ARGUMENT, `expected INVALID_ARGUMENT, got ${code}: ${err.details}`);
  const [raw] = err.metadata.get("grpc-status-details-bin");
  check(Buffer.isBuffer(raw), "no grpc-status-details-bin trailer");
  const status = Status.toObject(Status.decode(raw), { longs: String, enums: String, defaults: true });
  check(status.code === grpc.status.INVALID_ARGUMENT, `google.rpc.Status.code is ${status.code}, not 3`);
  check(status.message === err.details, `Status.message ${JSON.stringify(status.message)} != grpc-message`);
  const violations = [];
  for (const any of status.details) {
    const typeName = any.type_url.slice(any.type_url.lastIndexOf("/") + 1);
    if (typeName !== "google.rpc.BadRequest") continue;
    const BadRequest = root.lookupType(typeName);
    violations.push(...BadRequest.toObject(BadRequest.decode(any.value), { defaults: true }).field_violations);
  }
  check(violations.length > 0, `no google.rpc.BadRequest in the details: ${status.details.map((d) => d.type_url)}`);
  const hit = violations.find((v) => v.field === field);
  check(hit !== undefined, `no violation names ${field}: ${JSON.stringify(violations)}`);
  check(hit.description.includes(range), `the violation does not say ${range}: ${hit.description}`);
  return {
    code, status_code: status.code, message: status.message,
    field_violations: violations.map((v) => ({ field: v.field, description: v.description })),
  };
}

// (f) With --api-key: a call without the key is UNAUTHENTICATED, health answers without one, and with the key
// GetLoad answers, its trailers carrying the ORCA load report (endpoint-load-metrics-bin, raw: grpc-js hands every
// trailer to the application, where gRPC's C-core consumes this one for load balancing).
async function checkAuth(client, keyless, target) {
  const denied = await new Promise((resolve) => {
    keyless.GetModelInfo({}, { deadline: deadline() }, (err) => resolve(err));
  });
  check(denied !== null && denied.code === grpc.status.UNAUTHENTICATED,
    `a call without the key: ${denied ? grpc.status[denied.code] : "answered"}`);
  const streamDenied = await failure(keyless, "Generate", { text: ["hi"] });
  check(streamDenied !== null && streamDenied.code === grpc.status.UNAUTHENTICATED, "Generate without the key");
  const health = await healthCheck(target);
  const { load, trailer } = await new Promise((resolve, reject) => {
    let reply = null;
    const call = client.GetLoad({}, { deadline: deadline() }, (err, r) => { if (err) reject(err); else reply = r; });
    call.on("status", (status) => {
      const [raw] = status.metadata.get("endpoint-load-metrics-bin");
      resolve({ load: reply, trailer: raw });
    });
  });
  check(Buffer.isBuffer(trailer) && trailer.length > 0, "no endpoint-load-metrics-bin trailer");
  return {
    unauthenticated: grpc.status[denied.code], unauthenticated_message: denied.details,
    stream_unauthenticated: grpc.status[streamDenied.code], health_without_key: health,
    load: { kv_cache_pages: load.kv_cache_pages, max_running_outputs: load.max_running_outputs },
    orca_report_hex: trailer.toString("hex"),
  };
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const rpcTypes = loadRpcTypes(findGoogleapis(args.googleapis));
  const { generate: client, openai, keyless } = loadServices(args.target, args.apiKey);
  const summary = { target: args.target, ok: true, failures: [] };
  const checks = [["stream", () => checkStream(client)], ["cancel", () => checkCancel(client)],
    ["invalid_argument", () => checkInvalid(client, rpcTypes)], ["complete", () => checkComplete(openai)],
    ["chat", () => checkChat(openai, rpcTypes)]];
  if (args.apiKey) checks.push(["auth", () => checkAuth(client, keyless, args.target)]);
  for (const [name, run] of checks) {
    try {
      summary[name] = await run();
    } catch (err) {
      const message = err instanceof CheckFailed ? err.message : `${err.code !== undefined
        ? `RPC failed with ${grpc.status[err.code]}: ${err.details}` : err.stack}`;
      summary.ok = false;
      summary.failures.push({ check: name, message });
      console.error(`FAILED ${name}: ${message}`);
    }
  }
  client.close();
  openai.close();
  keyless.close();
  console.log(JSON.stringify(summary, null, 2));
  process.exitCode = summary.ok ? 0 : 1;
}

main().catch((err) => {
  console.error(`FAILED: ${err.stack ?? err}`);
  process.exitCode = 2;
});

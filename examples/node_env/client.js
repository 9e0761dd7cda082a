#!/usr/bin/env node
// An rlfleet environment client in Node, built from proto/ alone (no generated code, no rlfleet
// package): @grpc/proto-loader reads proto/rlfleet/*/v1/*.proto at start-up.
//
// It runs one multi-turn `calc` episode: the model's tokenizer facts from GetModelInfo, a fresh
// sandbox, a session opened with chat messages, turns of Generate whose tool results go back as
// chat messages (the session server frames them with the model's own chat template and returns the
// token ids it appended), the calculator run inside the sandbox, the verifier's verdict, and the
// close that publishes the trajectory. The client keeps its own copy of the session's token ids
// (prompt + each observation + each generated turn) and checks it against the trajectory.
//
//   node examples/node_env/client.js --session 127.0.0.1:7002 --sandbox 127.0.0.1:7003 \
//       --verifier 127.0.0.1:7004 --run-id local --task-id calc-1-4e1d2a187ed6 --question "What is 2+3?"
//
// Credentials: --token (`rlfleet token issue`) and --ca-file (<run_dir>/secrets/ca.pem), or
// RLFLEET_TOKEN and RLFLEET_CA_FILE: TLS with the run's CA, the token as `authorization: Bearer`.
//
// Prints the episode as one JSON line; exits 1 on an error (the session is aborted, never left open).
"use strict";

const fs = require("fs");
const path = require("path");
const crypto = require("crypto");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "proto");
const SYSTEM = "You are a calculator agent. Call the calculator as <calc>expression</calc>; " +
  "it replies with the result. Then reply <answer>result</answer>.";
// The tool runs inside the sandbox, never in this process.
const CALCULATOR = `
import ast, operator, sys
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}
def ev(node):
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](ev(node.left), ev(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
        return OPS[type(node.op)](ev(node.operand))
    raise ValueError("unsupported expression")
try:
    value = ev(ast.parse(sys.stdin.read().strip(), mode="eval").body)
    print(int(value) if value == int(value) else value)
except Exception as exc:
    print(f"error: {exc}")
    sys.exit(1)
`;
const TAG = /<([a-z_]+)>([\s\S]*?)<\/\1>/;

function parseArgs(argv) {
  const args = { suite: "calc", maxTurns: 3, temperature: 1.0, token: process.env.RLFLEET_TOKEN,
    caFile: process.env.RLFLEET_CA_FILE };
  const names = { "--session": "session", "--sandbox": "sandbox", "--verifier": "verifier", "--run-id": "runId",
    "--task-id": "taskId", "--question": "question", "--suite": "suite", "--max-turns": "maxTurns",
    "--temperature": "temperature", "--token": "token", "--ca-file": "caFile" };
  for (let i = 2; i < argv.length; i += 2) {
    const name = names[argv[i]];
    if (!name) throw new Error(`unknown argument ${argv[i]}`);
    args[name] = ["maxTurns", "temperature"].includes(name) ? Number(argv[i + 1]) : argv[i + 1];
  }
  for (const required of ["session", "sandbox", "verifier", "runId", "taskId", "question", "token", "caFile"]) {
    if (args[required] === undefined) throw new Error(`--${required} is required`);
  }
  return args;
}

function load() {
  const files = ["rlfleet/session/v1/session.proto", "rlfleet/sandbox/v1/sandbox.proto",
    "rlfleet/verifier/v1/verifier.proto"];
  const definition = protoLoader.loadSync(files, {
    includeDirs: [PROTO_ROOT], keepCase: true, longs: String, enums: String, defaults: true, oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).rlfleet;
}

// A unary call as a promise, with a deadline.
function call(client, method, request, timeoutS = 60) {
  return new Promise((resolve, reject) => {
    client[method](request, { deadline: new Date(Date.now() + timeoutS * 1000) }, (err, reply) => {
      if (err) reject(new Error(`${method}: ${grpc.status[err.code]}: ${err.details}`));
      else resolve(reply);
    });
  });
}

async function episode(args) {
  const api = load();
  const bearer = grpc.credentials.createFromMetadataGenerator((_params, callback) => {
    const metadata = new grpc.Metadata();
    metadata.add("authorization", `Bearer ${args.token}`);
    callback(null, metadata);
  });
  const credentials = grpc.credentials.combineChannelCredentials(
    grpc.credentials.createSsl(fs.readFileSync(args.caFile)), bearer);
  const sessions = new api.session.v1.SessionService(args.session, credentials);
  const sandboxes = new api.sandbox.v1.SandboxService(args.sandbox, credentials);
  const verifier = new api.verifier.v1.VerifierService(args.verifier, credentials);
  const sessionId = `node-${crypto.randomBytes(6).toString("hex")}`;

  const info = await call(sessions, "GetModelInfo", {});
  const stopIds = new Set(info.stop_token_ids);
  const box = await call(sandboxes, "CreateSandbox", { session_id: sessionId }, 30);
  let open = false;
  try {
    const opened = await call(sessions, "OpenSession", {
      session_id: sessionId, run_id: args.runId, task_id: args.taskId, group_id: sessionId, group_size: 1,
      suite: args.suite, split: "train",
      messages: { messages: [{ role: "system", content: SYSTEM }, { role: "user", content: args.question }] },
      sampling: { max_new_tokens: 48, temperature: args.temperature },
    });
    open = true;
    const tokens = [...opened.prompt_token_ids];
    let turns = 0, toolCalls = 0, observation = null;
    const stops = [];
    for (let turn = 0; turn <= args.maxTurns; turn++) {
      const request = { session_id: sessionId };
      if (observation !== null) {
        // A chat message: the server frames it as the template renders the whole conversation
        // (closing a turn cut at max_new_tokens) and answers the ids it appended.
        request.observation = { messages: { messages: [{ role: "tool", content: observation }] },
          add_generation_prompt: true };
      }
      const reply = await call(sessions, "Generate", request, 120);
      tokens.push(...reply.observation_token_ids, ...reply.token_ids);
      turns += 1;
      if (reply.matched_stop_token_id !== undefined && reply.matched_stop_token_id !== null) {
        if (!stopIds.has(reply.matched_stop_token_id)) throw new Error(`stopped on ${reply.matched_stop_token_id}, not a stop id`);
        stops.push(reply.matched_stop_token_id);
      }
      const found = TAG.exec(reply.text);
      if (found === null || found[1] === "answer" || reply.budget_exhausted) break;
      if (found[1] === "calc") {
        const result = await call(sandboxes, "Exec", {
          sandbox_id: box.sandbox_id, argv: ["python3", "-I", "-S", "-c", CALCULATOR],
          stdin: Buffer.from(found[2]), timeout_seconds: 5 }, 30);
        observation = result.stdout.toString().trim() || `error: exit ${result.exit_code}`;
        toolCalls += 1;
      } else {
        observation = `error: unknown tool '${found[1]}'; available: calc`;
      }
    }
    const verdict = await call(verifier, "Verify", { session_id: sessionId, suite: args.suite, task_id: args.taskId,
      sandbox_id: box.sandbox_id }, 120);
    const closed = await call(sessions, "CloseSession", { session_id: sessionId,
      status: "TRAJECTORY_STATUS_COMPLETED", return_trajectory: true });
    open = false;
    const trajectoryIds = closed.trajectory.token_ids;
    return {
      session_id: sessionId, trajectory_id: closed.trajectory_id, turns, tool_calls: toolCalls,
      reward: verdict.reward, passed: verdict.passed, matched_stop_token_ids: stops,
      token_ids: tokens, token_ids_match: JSON.stringify(trajectoryIds) === JSON.stringify(tokens),
      model_type: info.model_type, vocab_size: info.vocab_size,
    };
  } finally {
    if (open) {
      await call(sessions, "AbortSession", { session_id: sessionId, reason: "client error" }, 30).catch(() => {});
    }
    await call(sandboxes, "DestroySandbox", { sandbox_id: box.sandbox_id }, 30).catch(() => {});
    for (const client of [sessions, sandboxes, verifier]) client.close();
  }
}

episode(parseArgs(process.argv))
  .then((result) => { process.stdout.write(JSON.stringify(result) + "\n"); })
  .catch((err) => { process.stderr.write(`${err.stack || err}\n`); process.exit(1); });

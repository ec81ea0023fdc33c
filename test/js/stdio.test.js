// The context-shrink server over stdio through the official MCP TypeScript SDK.
// Run by ./test/test.sh (CONTEXT_SHRINK_PYTHON points at the project's Python).
"use strict";

const { test, before, after } = require("node:test");
const assert = require("node:assert/strict");
const http = require("node:http");
const path = require("node:path");
const fs = require("node:fs");
const os = require("node:os");
const { execFileSync } = require("node:child_process");
const { Client } = require("@modelcontextprotocol/sdk/client/index.js");
const { StdioClientTransport } = require("@modelcontextprotocol/sdk/client/stdio.js");

const ROOT = path.resolve(__dirname, "..", "..");
const PYTHON = process.env.CONTEXT_SHRINK_PYTHON || "python3";
const work = fs.mkdtempSync(path.join(os.tmpdir(), "context-shrink-js-"));
const { messages } = JSON.parse(fs.readFileSync(path.join(ROOT, "examples", "sample-conversation.json"), "utf8"));
let client;
let backend;
const backendRequests = [];

before(async () => {
  // A minimal OpenAI-compatible backend on 127.0.0.1 that writes a fixed summary.
  backend = http.createServer((req, res) => {
    let body = "";
    req.on("data", (chunk) => (body += chunk));
    req.on("end", () => {
      if (req.method !== "POST" || req.url !== "/v1/chat/completions") {
        res.writeHead(404, { "content-type": "application/json" });
        res.end(JSON.stringify({ error: { message: "File Not Found", type: "not_found_error" } }));
        return;
      }
      backendRequests.push({ url: req.url, auth: req.headers.authorization, body: JSON.parse(body) });
      res.writeHead(200, { "content-type": "application/json" });
      const content = "- fixed KeyError in config.py by reading the timeout with a default";
      res.end(JSON.stringify({ choices: [{ message: { role: "assistant", content } }] }));
    });
  });
  await new Promise((resolve) => backend.listen(0, "127.0.0.1", resolve));
  const transport = new StdioClientTransport({
    command: PYTHON,
    args: [path.join(ROOT, "context_shrink.py")],
    env: {
      ...process.env,
      CONTEXT_SHRINK_ROOT: work,
      CONTEXT_SHRINK_ARCHIVE_DIR: path.join(work, "archive"),
      CONTEXT_SHRINK_STATE: `sqlite:${path.join(work, "state.sqlite3")}`,
      CONTEXT_SHRINK_LOG_LEVEL: "WARNING",
      // The summariser is the server's setting (a tool call cannot name another).
      CONTEXT_SHRINK_BASE_URL: `http://127.0.0.1:${backend.address().port}/v1`,
      CONTEXT_SHRINK_API_KEY: "sk-js-test",
      CONTEXT_SHRINK_TOKENIZER: "tiktoken",
    },
    stderr: "pipe",
  });
  client = new Client({ name: "context-shrink-js-tests", version: "1.0.0" });
  await client.connect(transport);
});

after(async () => {
  await client?.close();
  backend?.close();
  fs.rmSync(work, { recursive: true, force: true });
});

test("lists the three tools with their parameters", async () => {
  const { tools } = await client.listTools();
  const byName = Object.fromEntries(tools.map((t) => [t.name, t]));
  assert.deepEqual(Object.keys(byName).sort(), [
    "analyze_context",
    "check_text",
    "compact_context",
    "estimate_context",
    "list_sessions",
    "prune_context",
    "recall_context",
    "shrink_text",
    "trim_context",
  ]);
  assert.deepEqual(Object.keys(byName.estimate_context.inputSchema.properties), [
    "messages",
    "max_context_tokens",
    "messages_path",
    "tools",
    "model",
    "reserve_tokens",
    "session",
  ]);
  assert.equal(byName.compact_context.inputSchema.properties.keep_last.default, 8);
  assert.equal(byName.estimate_context.inputSchema.additionalProperties, false);
});

test("recall_context returns an archived message verbatim", async () => {
  // An earlier version's JSONL archive: imported into the store (CONTEXT_SHRINK_STATE) by the first search.
  const message = { role: "tool", tool_call_id: "c1", content: "Traceback: KeyError 'timeout' in config.py" };
  fs.mkdirSync(path.join(work, "archive"), { recursive: true });
  const time = Math.floor(Date.now() / 1000);
  const entry = { id: "0123456789ab", hash: "0123456789ab".padEnd(64, "0"), index: 3, action: "compact", time, message };
  fs.writeFileSync(path.join(work, "archive", "00112233445566aa.jsonl"), JSON.stringify(entry) + "\n");
  const result = await client.callTool({ name: "recall_context", arguments: { query: "KeyError timeout" } });
  assert.equal(result.isError, false);
  assert.equal(result.structuredContent.found, 1);
  assert.deepEqual(result.structuredContent.entries[0].message, message);
  assert.equal(result.structuredContent.entries[0].conversation, "00112233445566aa");
  assert.equal(result.structuredContent.archive, `sqlite:${path.join(work, "state.sqlite3")}`);
  const phrase = await client.callTool({ name: "recall_context", arguments: { query: '"in config py"' } });
  assert.equal(phrase.structuredContent.found, 1);
  const none = await client.callTool({ name: "recall_context", arguments: { query: '"config in"' } });
  assert.equal(none.structuredContent.found, 0);
});

test("estimate_context", async () => {
  const result = await client.callTool({ name: "estimate_context", arguments: { messages, max_context_tokens: 1000 } });
  assert.equal(result.isError, false);
  assert.equal(result.structuredContent.message_count, messages.length);
  assert.equal(result.structuredContent.should_trim, true);
});

test("trim_context inline and with files", async () => {
  const inline = await client.callTool({ name: "trim_context", arguments: { messages, max_context_tokens: 1200 } });
  assert.equal(inline.structuredContent.fits, true);
  assert.deepEqual(inline.structuredContent.messages.at(-1), messages.at(-1));
  fs.writeFileSync(path.join(work, "history.jsonl"), messages.map((m) => JSON.stringify(m)).join("\n") + "\n");
  const report = await client.callTool({
    name: "trim_context",
    arguments: { messages_path: "history.jsonl", output_path: "trimmed.jsonl", max_context_tokens: 1200 },
  });
  assert.equal(report.structuredContent.messages, null);
  const written = fs.readFileSync(path.join(work, "trimmed.jsonl"), "utf8").trim().split("\n").map(JSON.parse);
  assert.deepEqual(written, inline.structuredContent.messages);
});

test("compact_context: plan, summary and model modes", async () => {
  const args = { messages, max_context_tokens: 1200, keep_last: 2 };
  const plan = await client.callTool({ name: "compact_context", arguments: { ...args, model: "" } });
  assert.equal(plan.structuredContent.mode, "plan");
  assert.equal(plan.structuredContent.needs_summary, true);
  assert.equal(plan.structuredContent.messages, null);

  const given = await client.callTool({ name: "compact_context", arguments: { ...args, summary: "Ran the tests." } });
  assert.equal(given.structuredContent.compacted, true);
  assert.match(given.structuredContent.messages[1].content, /^\[context-shrink summary\]/);

  const model = await client.callTool({
    name: "compact_context",
    arguments: { ...args, model: "fake", max_summary_tokens: 128 },
  });
  assert.equal(model.structuredContent.mode, "model");
  assert.equal(model.structuredContent.compacted, true, model.structuredContent.reason);
  assert.match(model.structuredContent.messages[1].content, /fixed KeyError in config\.py/);
  assert.equal(backendRequests.at(-1).url, "/v1/chat/completions");
  assert.equal(backendRequests.at(-1).auth, "Bearer sk-js-test");
  assert.doesNotMatch(JSON.stringify(model), /sk-js-test/);
});

test("a misspelt argument is a tool error naming the closest one", async () => {
  const bad = await client.callTool({ name: "estimate_context", arguments: { messages, max_context_tokns: 5 } });
  assert.equal(bad.isError, true);
  assert.match(bad.content[0].text, /unknown argument `max_context_tokns`; did you mean `max_context_tokens`\?/);
});

test("bad input is a tool error and the server keeps running", async () => {
  const bad = await client.callTool({ name: "trim_context", arguments: { messages: [{ role: "robot", content: "x" }] } });
  assert.equal(bad.isError, true);
  assert.match(bad.content[0].text, /messages\[0\]\.role 'robot'/);
  const good = await client.callTool({ name: "estimate_context", arguments: { messages: [messages[1]] } });
  assert.equal(good.isError, false);
});

test("examples/js-client.js runs", () => {
  const output = execFileSync(process.execPath, [path.join(ROOT, "examples", "js-client.js")], {
    env: { ...process.env, NODE_PATH: path.join(__dirname, "node_modules"), CONTEXT_SHRINK_PYTHON: PYTHON },
    encoding: "utf8",
    stdio: ["ignore", "pipe", "ignore"],
  });
  assert.match(output, /tools: estimate_context, analyze_context, trim_context, prune_context, compact_context/);
  assert.match(output, /estimate_context: \d+ tokens of 32768/);
});

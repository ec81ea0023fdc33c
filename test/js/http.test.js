// `context-shrink serve` over streamable HTTP through the official MCP TypeScript SDK and the MCP
// Inspector CLI. Run by ./test/test.sh (CONTEXT_SHRINK_PYTHON points at the project's Python).
"use strict";

const { test, before, after } = require("node:test");
const assert = require("node:assert/strict");
const http = require("node:http");
const net = require("node:net");
const path = require("node:path");
const fs = require("node:fs");
const os = require("node:os");
const { spawn, execFile } = require("node:child_process");
const { Client } = require("@modelcontextprotocol/sdk/client/index.js");
const { StreamableHTTPClientTransport } = require("@modelcontextprotocol/sdk/client/streamableHttp.js");
const { CreateMessageRequestSchema } = require("@modelcontextprotocol/sdk/types.js");

const ROOT = path.resolve(__dirname, "..", "..");
const PYTHON = process.env.CONTEXT_SHRINK_PYTHON || "python3";
const TOKEN = "js-test-token-0123456789";
const work = fs.mkdtempSync(path.join(os.tmpdir(), "context-shrink-js-http-"));
const { messages } = JSON.parse(fs.readFileSync(path.join(ROOT, "examples", "sample-conversation.json"), "utf8"));
let server;
let url;
let backend;

function freePort() {
  return new Promise((resolve) => {
    const probe = net.createServer().listen(0, "127.0.0.1", () => {
      const { port } = probe.address();
      probe.close(() => resolve(port));
    });
  });
}

async function connect(options = {}) {
  const transport = new StreamableHTTPClientTransport(new URL(`${url}/mcp`), {
    requestInit: { headers: { Authorization: `Bearer ${TOKEN}` } },
  });
  const client = new Client({ name: "context-shrink-js-http", version: "1.0.0" }, options);
  await client.connect(transport);
  return client;
}

before(async () => {
  // The summariser backend: a fixed summary for every request.
  backend = http.createServer((req, res) => {
    req.resume();
    req.on("end", () => {
      res.writeHead(200, { "content-type": "application/json" });
      const content = "- fixed KeyError in config.py by reading the timeout with a default";
      res.end(JSON.stringify({ choices: [{ message: { role: "assistant", content } }] }));
    });
  });
  await new Promise((resolve) => backend.listen(0, "127.0.0.1", resolve));
  const port = await freePort();
  server = spawn(PYTHON, [path.join(ROOT, "context_shrink.py"), "serve", "--port", String(port), "--token", TOKEN], {
    env: {
      ...process.env,
      CONTEXT_SHRINK_ROOT: work,
      CONTEXT_SHRINK_LOG_LEVEL: "WARNING",
      CONTEXT_SHRINK_BASE_URL: `http://127.0.0.1:${backend.address().port}/v1`, // the summariser
      CONTEXT_SHRINK_TOKENIZER: "tiktoken",
    },
    stdio: ["ignore", "ignore", "pipe"],
  });
  server.stderr.resume();
  url = `http://127.0.0.1:${port}`;
  for (let i = 0; i < 300; i++) {
    try {
      if ((await fetch(`${url}/health`)).ok) return;
    } catch {
      /* not listening yet */
    }
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
  throw new Error("context-shrink serve did not start");
});

after(() => {
  server?.kill();
  backend?.close();
  fs.rmSync(work, { recursive: true, force: true });
});

test("lists the tools and calls estimate, trim and compact over HTTP", async () => {
  const client = await connect();
  const { tools } = await client.listTools();
  assert.ok(["estimate_context", "trim_context", "compact_context"].every((n) => tools.some((t) => t.name === n)));
  const estimate = await client.callTool({ name: "estimate_context", arguments: { messages, max_context_tokens: 1000 } });
  assert.equal(estimate.structuredContent.message_count, messages.length);
  const trimmed = await client.callTool({ name: "trim_context", arguments: { messages, max_context_tokens: 1200 } });
  assert.equal(trimmed.structuredContent.fits, true);
  const progress = [];
  const args = { messages, max_context_tokens: 1200, keep_last: 2, max_summary_tokens: 128 };
  const model = await client.callTool(
    { name: "compact_context", arguments: { ...args, model: "fake" } },
    undefined,
    { onprogress: (p) => progress.push(p.progress) },
  );
  assert.equal(model.structuredContent.compacted, true, model.structuredContent.reason);
  assert.equal(progress.length, model.structuredContent.model_calls);
  const bad = await client.callTool({ name: "trim_context", arguments: { messages: [{ role: "robot", content: "x" }] } });
  assert.equal(bad.isError, true);
  assert.match(bad.content[0].text, /messages\[0\]\.role 'robot'/);
  const misspelt = await client.callTool({ name: "trim_context", arguments: { messages, target_raito: 0.6 } });
  assert.equal(misspelt.isError, true);
  assert.match(misspelt.content[0].text, /unknown argument `target_raito`; did you mean `target_ratio`\?/);
  await client.close();
});

test("compact_context samples the client's model over HTTP", async () => {
  const client = await connect({ capabilities: { sampling: {} } });
  let asked = 0;
  client.setRequestHandler(CreateMessageRequestSchema, async () => {
    asked += 1;
    return { role: "assistant", model: "js", content: { type: "text", text: "- sampled: the config fix, tests next" } };
  });
  const result = await client.callTool({
    name: "compact_context",
    arguments: { messages, max_context_tokens: 1200, keep_last: 2, max_summary_tokens: 128 },
  });
  assert.equal(result.structuredContent.mode, "sampling");
  assert.equal(result.structuredContent.compacted, true, result.structuredContent.reason);
  assert.equal(asked, result.structuredContent.model_calls);
  await client.close();
});

test("a request without the token is refused", async () => {
  const reply = await fetch(`${url}/mcp`, { method: "POST", body: "{}", headers: { "content-type": "application/json" } });
  assert.equal(reply.status, 401);
});

test("the MCP Inspector CLI lists the tools over HTTP", async () => {
  const cli = path.join(__dirname, "node_modules", ".bin", "mcp-inspector");
  const args = ["--cli", `${url}/mcp`, "--transport", "http", "--method", "tools/list"];
  const output = await new Promise((resolve, reject) =>
    execFile(cli, [...args, "--header", `Authorization: Bearer ${TOKEN}`], { timeout: 120000 }, (err, stdout, stderr) =>
      err ? reject(new Error(`${err.message}\n${stderr}`)) : resolve(stdout),
    ),
  );
  const names = JSON.parse(output).tools.map((t) => t.name);
  assert.ok(names.includes("compact_context") && names.includes("recall_context"), output.slice(0, 500));
});

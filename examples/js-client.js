// Start the context-shrink MCP server over stdio with the official TypeScript SDK and call a tool.
//
//   npm install @modelcontextprotocol/sdk
//   node examples/js-client.js
//
// CONTEXT_SHRINK_PYTHON picks the Python that runs the server (default: python3).
"use strict";

const path = require("node:path");
const fs = require("node:fs");
const { Client } = require("@modelcontextprotocol/sdk/client/index.js");
const { StdioClientTransport } = require("@modelcontextprotocol/sdk/client/stdio.js");

async function main() {
  const here = __dirname;
  const server = path.join(here, "..", "context_shrink.py");
  const { messages } = JSON.parse(fs.readFileSync(path.join(here, "sample-conversation.json"), "utf8"));
  const transport = new StdioClientTransport({
    command: process.env.CONTEXT_SHRINK_PYTHON || "python3",
    args: [server],
    cwd: here,
    stderr: "inherit",
  });
  const client = new Client({ name: "context-shrink-js-example", version: "1.0.0" });
  await client.connect(transport);
  try {
    const { tools } = await client.listTools();
    console.log("tools:", tools.map((t) => t.name).join(", "));
    const result = await client.callTool({ name: "estimate_context", arguments: { messages } });
    const estimate = result.structuredContent;
    console.log(
      `estimate_context: ${estimate.tokens} tokens of ${estimate.max_context_tokens} (${estimate.tokenizer}), ` +
        `should_trim=${estimate.should_trim}`,
    );
  } finally {
    await client.close();
  }
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});

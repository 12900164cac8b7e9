// An MCP client on the official TypeScript SDK (@modelcontextprotocol/sdk),
// driven by ctxsync's tests; the same scenario and output as client.py.
//
// node client.cjs --url URL --key KEY [--prompt NAME --read URI] [--call NAME --arguments JSON]
//   [--change-file PATH --change-to JSON --call-after NAME]
// The SDK is resolved from CTXSYNC_MCP_SERVERS_DIR (tests/mcp-servers/install.sh).
"use strict";

const fs = require("node:fs");
const os = require("node:os");
const path = require("node:path");
const { createRequire } = require("node:module");
const { parseArgs } = require("node:util");

const DEADLINE_MS = 30_000;

const dir =
  process.env.CTXSYNC_MCP_SERVERS_DIR ||
  path.join(os.homedir(), ".cache", "ctxsync", "mcp-servers");
const sdk = createRequire(path.join(dir, "package.json"));
const { Client } = sdk("@modelcontextprotocol/sdk/client/index.js");
const { StreamableHTTPClientTransport } = sdk(
  "@modelcontextprotocol/sdk/client/streamableHttp.js",
);
const { ToolListChangedNotificationSchema } = sdk("@modelcontextprotocol/sdk/types.js");

const { values: args } = parseArgs({
  options: {
    url: { type: "string" },
    key: { type: "string" },
    call: { type: "string" },
    arguments: { type: "string", default: "{}" },
    "change-file": { type: "string" },
    "change-to": { type: "string", default: "[]" },
    "call-after": { type: "string" },
    prompt: { type: "string" },
    read: { type: "string" },
  },
});

function resultJson(result) {
  return {
    is_error: Boolean(result.isError),
    content: result.content,
    structured: result.structuredContent ?? null,
  };
}

async function listAll(client, method = "listTools", field = "tools", key = "name") {
  const names = [];
  let cursor;
  do {
    const page = await client[method](cursor ? { cursor } : undefined);
    names.push(...page[field].map((item) => item[key]));
    cursor = page.nextCursor;
  } while (cursor);
  return names;
}

async function main() {
  const out = {};
  let notified;
  const changed = new Promise((resolve) => {
    notified = resolve;
  });
  const started = performance.now();
  const transport = new StreamableHTTPClientTransport(new URL(args.url), {
    requestInit: { headers: { Authorization: `Bearer ${args.key}` } },
  });
  const client = new Client({ name: "ctxsync-test", version: "1.0.0" });
  client.setNotificationHandler(ToolListChangedNotificationSchema, () => notified(true));
  await client.connect(transport);
  out.protocol = transport.protocolVersion ?? null;
  out.tools = await listAll(client);
  out.connect_to_list_ms = performance.now() - started;
  const toolArguments = JSON.parse(args.arguments);
  if (args.prompt) {
    out.prompts = await listAll(client, "listPrompts", "prompts");
    out.resources = await listAll(client, "listResources", "resources", "uri");
    const prompt = await client.getPrompt({ name: args.prompt });
    out.prompt_text = prompt.messages[0].content.text;
    const read = await client.readResource({ uri: args.read });
    out.read_uri = read.contents[0].uri;
  }
  if (args.call) {
    out.first_call = resultJson(await client.callTool({ name: args.call, arguments: toolArguments }));
  }
  if (args["change-file"]) {
    fs.writeFileSync(args["change-file"], args["change-to"]);
    let timer;
    const deadline = new Promise((resolve) => {
      timer = setTimeout(() => resolve(false), DEADLINE_MS);
    });
    out.list_changed = await Promise.race([changed, deadline]);
    clearTimeout(timer);
    out.tools_after = await listAll(client);
    out.second_call = resultJson(
      await client.callTool({ name: args["call-after"], arguments: toolArguments }),
    );
  }
  await transport.terminateSession();
  await client.close();
  process.stdout.write(JSON.stringify(out) + "\n");
}

main().catch((error) => {
  process.stderr.write(`mcp client failed: ${error && error.stack ? error.stack : error}\n`);
  process.exit(1);
});

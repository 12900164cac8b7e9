// A stateless (2026-07-28) client on the official TypeScript SDK v2 client
// (@modelcontextprotocol/client) whose tool calls are asked for input: it
// declares elicitation and sampling, answers them in the SDK's
// multi-round-trip driver (input_required results, retried with
// inputResponses), and prints what it was asked and what the calls answered,
// and the progress steps of a call that asks nothing.
//
// node stateless_rounds.mjs --url URL --key KEY
// The SDK is resolved from CTXSYNC_MCP_SERVERS_DIR (tests/mcp-servers/install.sh).

import os from "node:os";
import path from "node:path";
import { createRequire } from "node:module";
import { parseArgs } from "node:util";

const DEADLINE_MS = 60_000;
const ANSWER = { name: "Ada Lovelace", check: true, email: "ada@example.com" };
const SAMPLED = "a sampled reply";

const dir =
  process.env.CTXSYNC_MCP_SERVERS_DIR ||
  path.join(os.homedir(), ".cache", "ctxsync", "mcp-servers");
const sdk = createRequire(path.join(dir, "package.json"));
const { Client, StreamableHTTPClientTransport } = sdk("@modelcontextprotocol/client");

const { values: args } = parseArgs({
  options: { url: { type: "string" }, key: { type: "string" } },
});

function text(result) {
  return (result.content || [])
    .filter((c) => c.type === "text")
    .map((c) => c.text)
    .join("\n");
}

async function main() {
  const out = {};
  const transport = new StreamableHTTPClientTransport(new URL(args.url), {
    requestInit: { headers: { Authorization: `Bearer ${args.key}` } },
  });
  const client = new Client(
    { name: "ctxsync-rounds-test", version: "1.0.0" },
    {
      versionNegotiation: { mode: "auto" },
      capabilities: { sampling: {}, elicitation: { form: {} } },
    },
  );
  client.setRequestHandler("elicitation/create", async (request) => {
    out.elicitation = request.params.message;
    return { action: "accept", content: ANSWER };
  });
  client.setRequestHandler("sampling/createMessage", async (request) => {
    out.sampling = request.params.messages.map((m) => m.content.text);
    return { model: "test-model", role: "assistant", content: { type: "text", text: SAMPLED } };
  });
  await client.connect(transport);
  out.protocol = client.getNegotiatedProtocolVersion() ?? null;
  const elicited = await client.callTool({ name: "trigger-elicitation-request", arguments: {} });
  out.elicitation_result_has_answer = text(elicited).includes(ANSWER.name);
  const sampled = await client.callTool({
    name: "trigger-sampling-request",
    arguments: { prompt: "say hello", maxTokens: 20 },
  });
  out.sampling_result_has_reply = text(sampled).includes(SAMPLED);
  // A call that asks nothing: its progress comes on its own request's stream.
  const progress = [];
  await client.callTool(
    { name: "trigger-long-running-operation", arguments: { duration: 1, steps: 3 } },
    { onprogress: (p) => progress.push([p.progress, p.total]) },
  );
  out.progress = progress.sort((a, b) => a[0] - b[0]);
  await client.close();
  process.stdout.write(JSON.stringify(out) + "\n");
}

const deadline = setTimeout(() => {
  process.stderr.write(`mcp client failed: no result within ${DEADLINE_MS} ms\n`);
  process.exit(1);
}, DEADLINE_MS);
main()
  .then(() => clearTimeout(deadline))
  .catch((error) => {
    process.stderr.write(`mcp client failed: ${error && error.stack ? error.stack : error}\n`);
    process.exit(1);
  });

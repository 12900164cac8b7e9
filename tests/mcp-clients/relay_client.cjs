// An MCP client on the official TypeScript SDK (@modelcontextprotocol/sdk,
// a 2025-11-25 session) that uses what server-everything offers besides
// tools: progress, logging, completions, resource templates, subscriptions,
// elicitation and sampling; driven by ctxsync's relay tests, once against
// server-everything directly and once through the catalog, to compare.
//
// node relay_client.cjs --url URL [--key KEY] [--cancel-tool NAME --cancel-arguments JSON]
//   [--ask-tool NAME]
//
// Declares sampling and elicitation (form). Answers an elicitation with
// ANSWER below and a sampling request with SAMPLED. Prints one JSON object:
// what it saw. With --cancel-tool it only calls that tool, aborts the call
// after CANCEL_AFTER_MS and reports how the call ended. With --ask-tool it
// only calls that tool (whose server asks it to sample, wanting progress)
// and reports the answer. Its sampling answers send progress 1/2 and 2/2
// first whenever the request carries a progressToken.
// The SDK is resolved from CTXSYNC_MCP_SERVERS_DIR (tests/mcp-servers/install.sh).
"use strict";

const os = require("node:os");
const path = require("node:path");
const { createRequire } = require("node:module");
const { parseArgs } = require("node:util");

const DEADLINE_MS = 30_000;
const CANCEL_AFTER_MS = 500;
const ANSWER = { name: "Ada Lovelace", check: true, email: "ada@example.com" };
const SAMPLED = "a sampled reply";

const dir =
  process.env.CTXSYNC_MCP_SERVERS_DIR ||
  path.join(os.homedir(), ".cache", "ctxsync", "mcp-servers");
const sdk = createRequire(path.join(dir, "package.json"));
const { Client } = sdk("@modelcontextprotocol/sdk/client/index.js");
const { StreamableHTTPClientTransport } = sdk(
  "@modelcontextprotocol/sdk/client/streamableHttp.js",
);
const {
  CreateMessageRequestSchema,
  ElicitRequestSchema,
  LoggingMessageNotificationSchema,
  ResourceUpdatedNotificationSchema,
} = sdk("@modelcontextprotocol/sdk/types.js");

const { values: args } = parseArgs({
  options: {
    url: { type: "string" },
    key: { type: "string" },
    "cancel-tool": { type: "string" },
    "cancel-arguments": { type: "string", default: "{}" },
    "ask-tool": { type: "string" },
  },
});

/** Resolves once `predicate` holds, checked whenever `poke` is called. */
function waiter() {
  const waits = [];
  return {
    poke() {
      for (const w of waits.splice(0)) {
        if (w.predicate()) w.resolve(true);
        else waits.push(w);
      }
    },
    until(predicate) {
      if (predicate()) return Promise.resolve(true);
      return new Promise((resolve) => {
        let timer;
        const entry = {
          predicate,
          resolve: (value) => {
            clearTimeout(timer);
            resolve(value);
          },
        };
        waits.push(entry);
        timer = setTimeout(() => resolve(false), DEADLINE_MS);
      });
    },
  };
}

function text(result) {
  return (result.content || [])
    .filter((c) => c.type === "text")
    .map((c) => c.text)
    .join("\n");
}

async function main() {
  const out = {};
  const events = waiter();
  const logs = [];
  const updated = [];
  const transport = new StreamableHTTPClientTransport(new URL(args.url), {
    requestInit: args.key ? { headers: { Authorization: `Bearer ${args.key}` } } : {},
  });
  const client = new Client(
    { name: "ctxsync-relay-test", version: "1.0.0" },
    { capabilities: { sampling: {}, elicitation: { form: {} } } },
  );
  client.setRequestHandler(ElicitRequestSchema, async (request) => {
    out.elicitation = {
      message: request.params.message,
      fields: Object.keys(request.params.requestedSchema.properties).sort(),
    };
    return { action: "accept", content: ANSWER };
  });
  client.setRequestHandler(CreateMessageRequestSchema, async (request, extra) => {
    out.sampling = {
      messages: request.params.messages.map((m) => m.content.text),
      max_tokens: request.params.maxTokens,
    };
    // Progress on the question, when its asker wants it: 1 of 2, 2 of 2.
    const progressToken = request.params._meta?.progressToken;
    if (progressToken !== undefined) {
      for (const progress of [1, 2]) {
        await extra.sendNotification({
          method: "notifications/progress",
          params: { progressToken, progress, total: 2 },
        });
      }
    }
    return {
      model: "test-model",
      role: "assistant",
      content: { type: "text", text: SAMPLED },
    };
  });
  client.setNotificationHandler(LoggingMessageNotificationSchema, (n) => {
    logs.push({ level: n.params.level, logger: n.params.logger ?? null, data: n.params.data });
    events.poke();
  });
  client.setNotificationHandler(ResourceUpdatedNotificationSchema, (n) => {
    updated.push(n.params.uri);
    events.poke();
  });
  await client.connect(transport);

  if (args["ask-tool"]) {
    const asked = await client.callTool({ name: args["ask-tool"], arguments: { prompt: "say hi" } });
    out.ask_result = text(asked);
    await transport.terminateSession();
    await client.close();
    process.stdout.write(JSON.stringify(out) + "\n");
    return;
  }

  if (args["cancel-tool"]) {
    const controller = new AbortController();
    setTimeout(() => controller.abort("the user gave up"), CANCEL_AFTER_MS);
    const started = performance.now();
    try {
      await client.callTool(
        { name: args["cancel-tool"], arguments: JSON.parse(args["cancel-arguments"]) },
        undefined,
        { signal: controller.signal, timeout: DEADLINE_MS },
      );
      out.cancelled = false;
    } catch (error) {
      out.cancelled = controller.signal.aborted;
      out.error = String(error && error.message ? error.message : error);
    }
    out.ended_after_ms = Math.round(performance.now() - started);
    await transport.terminateSession();
    await client.close();
    process.stdout.write(JSON.stringify(out) + "\n");
    return;
  }

  const tools = (await client.listTools()).tools.map((t) => t.name);
  out.tools_offered = [
    "trigger-long-running-operation",
    "trigger-elicitation-request",
    "trigger-sampling-request",
    "toggle-simulated-logging",
    "toggle-subscriber-updates",
  ].filter((name) => tools.includes(name));

  // Progress: every step, in the server's numbers.
  const progress = [];
  const long = await client.callTool(
    { name: "trigger-long-running-operation", arguments: { duration: 1, steps: 4 } },
    undefined,
    {
      onprogress: (p) => {
        progress.push([p.progress, p.total]);
        events.poke();
      },
      timeout: DEADLINE_MS,
    },
  );
  // Notifications and the result are not ordered on the wire: wait for all.
  await events.until(() => progress.length >= 4);
  out.progress = progress.sort((a, b) => a[0] - b[0]);
  out.long_result = text(long);

  // Completions of a prompt argument and of a resource template variable.
  const department = await client.complete({
    ref: { type: "ref/prompt", name: "completable-prompt" },
    argument: { name: "department", value: "S" },
  });
  out.prompt_completion = department.completion.values;
  const teamLead = await client.complete({
    ref: { type: "ref/prompt", name: "completable-prompt" },
    argument: { name: "name", value: "" },
    context: { arguments: { department: "Sales" } },
  });
  out.context_completion = teamLead.completion.values;

  // Templates: listed with the server's own URI templates; a matching URI read.
  const templates = await client.listResourceTemplates();
  out.templates = templates.resourceTemplates.map((t) => t.uriTemplate).sort();
  const read = await client.readResource({ uri: "demo://resource/dynamic/text/3" });
  out.templated_read = { uri: read.contents[0].uri, mime: read.contents[0].mimeType };
  const template = out.templates.find((t) => t.includes("/text/"));
  const templateCompletion = await client.complete({
    ref: { type: "ref/resource", uri: template },
    argument: { name: "resourceId", value: "" },
  });
  out.template_completion_count = templateCompletion.completion.values.length;

  // Elicitation: the question reaches us, our answer reaches the server.
  const elicited = await client.callTool({ name: "trigger-elicitation-request", arguments: {} });
  out.elicitation_result_has_answer = text(elicited).includes(ANSWER.name);

  // Sampling: the server's request reaches us, our reply reaches the server.
  const sampled = await client.callTool({
    name: "trigger-sampling-request",
    arguments: { prompt: "say hello", maxTokens: 20 },
  });
  out.sampling_result_has_reply = text(sampled).includes(SAMPLED);

  // Logging at the level we set; messages carry a logger.
  await client.setLoggingLevel("debug");
  await client.callTool({ name: "toggle-simulated-logging", arguments: {} });
  out.logged = await events.until(() =>
    logs.some((l) => typeof l.data === "string" && l.data.includes("-level message")),
  );
  const simulated = logs.find((l) => typeof l.data === "string" && l.data.includes("-level message"));
  out.log_logger = simulated ? simulated.logger : null;
  await client.callTool({ name: "toggle-simulated-logging", arguments: {} });

  // Subscriptions: updates of the URI we subscribed to reach us.
  const resources = (await client.listResources()).resources.map((r) => r.uri);
  const subscribedUri = resources[0];
  await client.subscribeResource({ uri: subscribedUri });
  await client.callTool({ name: "toggle-subscriber-updates", arguments: {} });
  out.updated = await events.until(() => updated.includes(subscribedUri));
  out.updates_only_subscribed = updated.every((u) => u === subscribedUri);
  await client.callTool({ name: "toggle-subscriber-updates", arguments: {} });
  await client.unsubscribeResource({ uri: subscribedUri });

  await transport.terminateSession();
  await client.close();
  process.stdout.write(JSON.stringify(out) + "\n");
}

main().catch((error) => {
  process.stderr.write(`mcp client failed: ${error && error.stack ? error.stack : error}\n`);
  process.exit(1);
});

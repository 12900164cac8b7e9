// An MCP server offering exactly what the server scenarios of the official
// conformance suite (@modelcontextprotocol/conformance 0.1.16) call: its
// tools, prompts and resources by the names and with the behaviours the
// scenarios check. Put behind the catalog, the suite tests the gateway's relay
// of each feature rather than the upstream.
//
// node conformance-upstream.mjs              stdio (how the catalog starts upstreams)
// node conformance-upstream.mjs --http PORT  streamable HTTP at http://127.0.0.1:PORT/mcp
//
// Built on the low-level Server of the official TypeScript SDK v1, resolved
// from CTXSYNC_MCP_SERVERS_DIR (tests/mcp-servers/install.sh), so that every
// list and result is sent as written here (the json-schema-2020-12 scenario
// checks that $schema, $defs and additionalProperties arrive untouched).

import http from "node:http";
import os from "node:os";
import path from "node:path";
import { randomUUID } from "node:crypto";
import { createRequire } from "node:module";
import { parseArgs } from "node:util";

const dir =
  process.env.CTXSYNC_MCP_SERVERS_DIR ||
  path.join(os.homedir(), ".cache", "ctxsync", "mcp-servers");
const sdk = createRequire(path.join(dir, "package.json"));
const { Server } = sdk("@modelcontextprotocol/sdk/server/index.js");
const { StdioServerTransport } = sdk("@modelcontextprotocol/sdk/server/stdio.js");
const { StreamableHTTPServerTransport } = sdk("@modelcontextprotocol/sdk/server/streamableHttp.js");
const types = sdk("@modelcontextprotocol/sdk/types.js");
const { McpError, ErrorCode } = types;

// A 1x1 red PNG and a minimal WAV, as the scenarios ask for.
const PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg==";
const WAV = "UklGRiYAAABXQVZFZm10IBAAAAABAAEAQB8AAAB9AAACABAAZGF0YQIAAAA=";
const text = (t) => ({ content: [{ type: "text", text: t }] });
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const noArgs = { type: "object", properties: {} };

// name -> [description, inputSchema, handler(args, extra, server)]
const TOOLS = {
  test_simple_text: ["Returns simple text", noArgs, () => text("This is a simple text response for testing.")],
  test_image_content: ["Returns an image", noArgs, () => ({ content: [{ type: "image", data: PNG, mimeType: "image/png" }] })],
  test_audio_content: ["Returns audio", noArgs, () => ({ content: [{ type: "audio", data: WAV, mimeType: "audio/wav" }] })],
  test_embedded_resource: ["Returns an embedded resource", noArgs, () => ({
    content: [{ type: "resource", resource: { uri: "test://embedded-resource", mimeType: "text/plain", text: "This is an embedded resource content." } }],
  })],
  test_multiple_content_types: ["Returns text, an image and a resource", noArgs, () => ({
    content: [
      { type: "text", text: "Multiple content types test:" },
      { type: "image", data: PNG, mimeType: "image/png" },
      { type: "resource", resource: { uri: "test://mixed-content-resource", mimeType: "application/json", text: '{"test":"data","value":123}' } },
    ],
  })],
  // Three info logs 50 ms apart, on the call's own stream, honouring logging/setLevel.
  test_tool_with_logging: ["Logs three messages while it runs", noArgs, async (_args, extra, server) => {
    for (const [i, data] of ["Tool execution started", "Tool processing data", "Tool execution completed"].entries()) {
      if (i > 0) await sleep(50);
      if (!server.isMessageIgnored("info", extra.sessionId)) {
        await extra.sendNotification({ method: "notifications/message", params: { level: "info", logger: "conformance-upstream", data } });
      }
    }
    return text("Tool with logging executed successfully");
  }],
  // Progress 0, 50, 100 of 100, only when the caller asked for it with a progress token.
  test_tool_with_progress: ["Reports progress while it runs", noArgs, async (_args, extra) => {
    const progressToken = extra._meta?.progressToken;
    for (const progress of [0, 50, 100]) {
      if (progress > 0) await sleep(50);
      if (progressToken !== undefined) {
        await extra.sendNotification({ method: "notifications/progress", params: { progressToken, progress, total: 100 } });
      }
    }
    // The TypeScript SDK client handles a notification a microtask after a response
    // read with it, and drops progress for a request already answered: keep them apart.
    await sleep(20);
    return text("Tool with progress executed successfully");
  }],
  // A tool error is a result with isError, not a JSON-RPC error.
  test_error_handling: ["Always fails", noArgs, () => ({ ...text("This tool intentionally returns an error for testing"), isError: true })],
  // Asks the client to sample, on the call's stream (sendRequest relates it to the call);
  // a tool error when the client did not declare sampling.
  test_sampling: ["Asks the client's LLM", { type: "object", properties: { prompt: { type: "string" } }, required: ["prompt"] }, async ({ prompt }, extra, server) => {
    if (!server.getClientCapabilities()?.sampling) return { ...text("The client does not support sampling"), isError: true };
    const result = await extra.sendRequest(
      { method: "sampling/createMessage", params: { messages: [{ role: "user", content: { type: "text", text: prompt } }], maxTokens: 100 } },
      types.CreateMessageResultSchema,
    );
    return text(`LLM response: ${result.content?.text ?? JSON.stringify(result.content)}`);
  }],
  test_elicitation: ["Asks the user", { type: "object", properties: { message: { type: "string" } }, required: ["message"] }, ({ message }, extra, server) =>
    elicit(extra, server, message, {
      username: { type: "string", description: "User's response" },
      email: { type: "string", description: "User's email address" },
    }, ["username", "email"], "User response")],
  // SEP-1034: a default for each primitive type.
  test_elicitation_sep1034_defaults: ["Asks with defaults", noArgs, (_args, extra, server) =>
    elicit(extra, server, "Please review and update the form fields with defaults", {
      name: { type: "string", description: "User name", default: "John Doe" },
      age: { type: "integer", description: "User age", default: 30 },
      score: { type: "number", description: "User score", default: 95.5 },
      status: { type: "string", description: "User status", enum: ["active", "inactive", "pending"], default: "active" },
      verified: { type: "boolean", description: "Verification status", default: true },
    })],
  // SEP-1330: the five enum shapes.
  test_elicitation_sep1330_enums: ["Asks with every enum shape", noArgs, (_args, extra, server) =>
    elicit(extra, server, "Please select options from the enum fields", {
      untitledSingle: { type: "string", enum: ["option1", "option2", "option3"] },
      titledSingle: { type: "string", oneOf: [{ const: "value1", title: "First Option" }, { const: "value2", title: "Second Option" }, { const: "value3", title: "Third Option" }] },
      legacyEnum: { type: "string", enum: ["opt1", "opt2", "opt3"], enumNames: ["Option One", "Option Two", "Option Three"] },
      untitledMulti: { type: "array", items: { type: "string", enum: ["option1", "option2", "option3"] } },
      titledMulti: { type: "array", items: { anyOf: [{ const: "value1", title: "First Choice" }, { const: "value2", title: "Second Choice" }, { const: "value3", title: "Third Choice" }] } },
    })],
  // SEP-1613: a JSON Schema 2020-12 input schema, to be relayed as is.
  json_schema_2020_12_tool: ["Tool with JSON Schema 2020-12 features", {
    $schema: "https://json-schema.org/draft/2020-12/schema",
    type: "object",
    $defs: { address: { type: "object", properties: { street: { type: "string" }, city: { type: "string" } } } },
    properties: { name: { type: "string" }, address: { $ref: "#/$defs/address" } },
    additionalProperties: false,
  }, (args) => text(`JSON Schema 2020-12 tool called with: ${JSON.stringify(args)}`)],
  // SEP-1699: over HTTP, closes the call's SSE stream before answering, so the
  // client must come back with Last-Event-ID; the SDK offers closeSSEStream
  // only where the client can resume (an event store and protocol >= 2025-11-25).
  test_reconnection: ["Closes its SSE stream mid-call", noArgs, async (_args, extra) => {
    extra.closeSSEStream?.();
    await sleep(100);
    return text("Reconnection test completed successfully.");
  }],
};

// A form elicitation on the call's stream; a tool error when the client did not declare elicitation.
async function elicit(extra, server, message, properties, required = [], label = "Elicitation completed") {
  if (!server.getClientCapabilities()?.elicitation) return { ...text("The client does not support elicitation"), isError: true };
  const result = await extra.sendRequest(
    { method: "elicitation/create", params: { message, requestedSchema: { type: "object", properties, required } } },
    types.ElicitResultSchema,
  );
  return text(`${label}: action=${result.action}, content=${JSON.stringify(result.content ?? {})}`);
}

const RESOURCES = {
  "test://static-text": { name: "static-text", mimeType: "text/plain", text: "This is the content of the static text resource." },
  "test://static-binary": { name: "static-binary", mimeType: "image/png", blob: PNG },
  "test://watched-resource": { name: "watched-resource", mimeType: "text/plain", text: "Watched resource content" },
};
const TEMPLATE = /^test:\/\/template\/([^/]+)\/data$/;

function readResource(uri) {
  const id = TEMPLATE.exec(uri)?.[1];
  if (id !== undefined) {
    return { uri, mimeType: "application/json", text: JSON.stringify({ id, templateTest: true, data: `Data for ID: ${id}` }) };
  }
  const found = RESOURCES[uri];
  if (!found) throw new McpError(-32002, `Resource not found: ${uri}`, { uri });
  const { name: _name, ...contents } = found;
  return { uri, ...contents };
}

// name -> [description, arguments, messages(args)]
const PROMPTS = {
  test_simple_prompt: ["A prompt without arguments", [], () => [user({ type: "text", text: "This is a simple prompt for testing." })]],
  test_prompt_with_arguments: ["A prompt with two arguments", [
    { name: "arg1", description: "First test argument", required: true },
    { name: "arg2", description: "Second test argument", required: true },
  ], ({ arg1, arg2 }) => [user({ type: "text", text: `Prompt with arguments: arg1='${arg1}', arg2='${arg2}'` })]],
  test_prompt_with_embedded_resource: ["A prompt embedding a resource", [
    { name: "resourceUri", description: "URI of the resource to embed", required: true },
  ], ({ resourceUri }) => [
    user({ type: "resource", resource: { uri: resourceUri, mimeType: "text/plain", text: "Embedded resource content for testing." } }),
    user({ type: "text", text: "Please process the embedded resource above." }),
  ]],
  test_prompt_with_image: ["A prompt with an image", [], () => [
    user({ type: "image", data: PNG, mimeType: "image/png" }),
    user({ type: "text", text: "Please analyze the image above." }),
  ]],
};
const user = (content) => ({ role: "user", content });

// What completion/complete offers for each argument.
const COMPLETIONS = { arg1: ["paris", "park", "party"], arg2: ["hello", "world"], id: ["123", "456"] };

function makeServer() {
  const server = new Server(
    { name: "ctxsync-conformance-upstream", version: "1.0.0" },
    // logging also makes the SDK answer logging/setLevel and track the level per session.
    { capabilities: { tools: {}, resources: { subscribe: true }, prompts: {}, logging: {}, completions: {} } },
  );
  const handle = (schema, fn) => server.setRequestHandler(schema, fn);

  handle(types.ListToolsRequestSchema, () => ({
    tools: Object.entries(TOOLS).map(([name, [description, inputSchema]]) => ({ name, description, inputSchema })),
  }));
  handle(types.CallToolRequestSchema, (request, extra) => {
    const tool = TOOLS[request.params.name];
    if (!tool) throw new McpError(ErrorCode.InvalidParams, `Unknown tool: ${request.params.name}`);
    return tool[2](request.params.arguments ?? {}, extra, server);
  });

  handle(types.ListResourcesRequestSchema, () => ({
    resources: Object.entries(RESOURCES).map(([uri, { name, mimeType }]) => ({ uri, name, description: `The ${name} resource`, mimeType })),
  }));
  handle(types.ListResourceTemplatesRequestSchema, () => ({
    resourceTemplates: [{ uriTemplate: "test://template/{id}/data", name: "template", description: "Data for an id", mimeType: "application/json" }],
  }));
  handle(types.ReadResourceRequestSchema, (request) => ({ contents: [readResource(request.params.uri)] }));
  // Subscriptions are only acknowledged: nothing here ever changes.
  const subscriptions = new Set();
  handle(types.SubscribeRequestSchema, (request) => (subscriptions.add(request.params.uri), {}));
  handle(types.UnsubscribeRequestSchema, (request) => (subscriptions.delete(request.params.uri), {}));

  handle(types.ListPromptsRequestSchema, () => ({
    prompts: Object.entries(PROMPTS).map(([name, [description, args]]) => ({ name, description, arguments: args })),
  }));
  handle(types.GetPromptRequestSchema, (request) => {
    const prompt = PROMPTS[request.params.name];
    if (!prompt) throw new McpError(ErrorCode.InvalidParams, `Unknown prompt: ${request.params.name}`);
    return { messages: prompt[2](request.params.arguments ?? {}) };
  });

  handle(types.CompleteRequestSchema, (request) => {
    const { name, value } = request.params.argument;
    const values = (COMPLETIONS[name] ?? []).filter((v) => v.startsWith(value));
    return { completion: { values, total: values.length, hasMore: false } };
  });
  return server;
}

// Streamable HTTP with sessions: one Server per session, an in-memory event
// store so a closed SSE stream can be resumed (SEP-1699), and a Host check
// against DNS rebinding (the dns-rebinding-protection scenario).
function serveHttp(port) {
  const sessions = new Map();
  const allowedHosts = ["127.0.0.1", "localhost", "[::1]"].map((host) => `${host}:${port}`);
  http.createServer(async (req, res) => {
    if (new URL(req.url, "http://x").pathname !== "/mcp") return res.writeHead(404).end();
    const id = req.headers["mcp-session-id"];
    let transport = id && sessions.get(id);
    if (!transport) {
      // An unknown session is 404 (the client starts over); GET and DELETE need one.
      if (id) return reject(res, 404, -32001, "Session not found");
      if (req.method !== "POST") return reject(res, 400, -32000, "Mcp-Session-Id header is required");
      // A POST without a session is an initialize (the transport rejects anything else).
      transport = new StreamableHTTPServerTransport({
        sessionIdGenerator: randomUUID,
        onsessioninitialized: (sid) => sessions.set(sid, transport),
        eventStore: memoryEventStore(),
        retryInterval: 1000,
        enableDnsRebindingProtection: true,
        allowedHosts,
      });
      transport.onclose = () => sessions.delete(transport.sessionId);
      await makeServer().connect(transport);
    }
    await transport.handleRequest(req, res);
  }).listen(port, "127.0.0.1", () => process.stderr.write(`conformance-upstream: http://127.0.0.1:${port}/mcp\n`));
}

function reject(res, status, code, message) {
  res.writeHead(status, { "content-type": "application/json" })
    .end(JSON.stringify({ jsonrpc: "2.0", id: null, error: { code, message } }));
}

function memoryEventStore() {
  const events = []; // { id, streamId, message }, in the order stored
  return {
    async storeEvent(streamId, message) {
      const id = `${streamId}.${events.length}`;
      events.push({ id, streamId, message });
      return id;
    },
    async getStreamIdForEventId(id) {
      return events.find((event) => event.id === id)?.streamId;
    },
    async replayEventsAfter(lastEventId, { send }) {
      const at = events.findIndex((event) => event.id === lastEventId);
      const { streamId } = events[at];
      for (const event of events.slice(at + 1)) {
        // Priming events are stored as {} and carry nothing to replay.
        if (event.streamId === streamId && Object.keys(event.message).length > 0) await send(event.id, event.message);
      }
      return streamId;
    },
  };
}

const { values: args } = parseArgs({ options: { http: { type: "string" } } });
if (args.http !== undefined) serveHttp(Number(args.http));
else await makeServer().connect(new StdioServerTransport());

// An MCP client for the stateless revision (2026-07-28) on the official
// TypeScript SDK v2 client (@modelcontextprotocol/client), driven by
// ctxsync's tests; the same scenario and output as stateless_client.py.
//
// node stateless_client.mjs --url URL --key KEY --call NAME [--arguments JSON]
//   [--handle H] [--listen-seconds N [--change-file PATH --change-to TEXT]]
//   [--call-after NAME]
//
// Connects with versionNegotiation mode 'auto' (probes `server/discover`,
// speaks 2026-07-28 statelessly, falls back to the initialize handshake on an
// older server) and the tenant key as a bearer token; every list is sent with
// cacheMode 'refresh', so it reaches the server whatever the hints say. Lists
// every tool (the SDK follows nextCursor), keeping the first page's cache hints
// (`ttlMs`, `cacheScope`, `_meta`), and calls --call. Every request carries
// `_meta: {"ctxsync.dev/pins": H}` (--handle, else the handle the first list
// page answered, once known). With --listen-seconds it then opens
// `subscriptions/listen` for tool list changes, writes --change-to to
// --change-file once the listen is acknowledged, and reports whether
// `notifications/tools/list_changed` arrived in time (on a pre-2026
// connection, which has no listen, it waits for the unsolicited notification
// instead and says so on stderr). With --call-after it lists again and calls
// that tool.
// Prints one JSON object on stdout; exits 0 unless the client itself failed.
// The SDK is resolved from CTXSYNC_MCP_SERVERS_DIR (tests/mcp-servers/install.sh).

import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { createRequire } from "node:module";
import { parseArgs } from "node:util";

const DEADLINE_MS = 120_000;
const PINS_META = "ctxsync.dev/pins";

const dir =
  process.env.CTXSYNC_MCP_SERVERS_DIR ||
  path.join(os.homedir(), ".cache", "ctxsync", "mcp-servers");
const sdk = createRequire(path.join(dir, "package.json"));
const { Client, StreamableHTTPClientTransport, SdkError, SdkErrorCode } = sdk(
  "@modelcontextprotocol/client",
);

const { values: args } = parseArgs({
  options: {
    url: { type: "string" },
    key: { type: "string" },
    call: { type: "string" },
    arguments: { type: "string", default: "{}" },
    handle: { type: "string" },
    "listen-seconds": { type: "string" },
    "change-file": { type: "string" },
    "change-to": { type: "string", default: "[]" },
    "call-after": { type: "string" },
  },
});
for (const required of ["url", "key", "call"]) {
  if (args[required] === undefined) throw new Error(`--${required} is required`);
}

function note(message) {
  process.stderr.write(`stateless_client.mjs: ${message}\n`);
}

/**
 * A Client whose requests carry the pin handle once it is known. Lists and
 * calls also pass it as `_meta` in their params; the SDK's 2026-07-28 `_meta`
 * envelope (a protected hook) adds it to what takes no `_meta` of ours: the
 * `subscriptions/listen` request and the later pages of the SDK's own page
 * walk, which it learns from the first page's response.
 */
class PinnedClient extends Client {
  pins = undefined;

  _outboundMetaEnvelope() {
    const envelope = super._outboundMetaEnvelope();
    if (envelope === undefined || this.pins === undefined) return envelope;
    return { ...envelope, [PINS_META]: this.pins };
  }

  _onresponse(response) {
    const result = response && response.result;
    if (this.pins === undefined && result && Array.isArray(result.tools)) {
      const meta = result._meta;
      if (meta && Object.hasOwn(meta, PINS_META)) this.pins = meta[PINS_META];
    }
    super._onresponse(response);
  }

  meta() {
    return this.pins === undefined ? undefined : { [PINS_META]: this.pins };
  }
}

function resultJson(result) {
  return {
    is_error: Boolean(result.isError),
    content: result.content,
    structured: result.structuredContent ?? null,
  };
}

/** Every tool's name, and the first page's hints (the SDK keeps page 1's on the aggregate). */
async function listTools(client) {
  const meta = client.meta();
  const listing = await client.listTools(meta ? { _meta: meta } : undefined, {
    cacheMode: "refresh",
  });
  const hints = {
    ttlMs: typeof listing.ttlMs === "number" ? listing.ttlMs : null,
    cacheScope: typeof listing.cacheScope === "string" ? listing.cacheScope : null,
    meta: listing._meta ?? null,
  };
  return [listing.tools.map((tool) => tool.name), hints];
}

async function call(client, name, toolArguments) {
  const meta = client.meta();
  const params = { name, arguments: toolArguments, ...(meta && { _meta: meta }) };
  return resultJson(await client.callTool(params));
}

function change() {
  if (args["change-file"]) fs.writeFileSync(args["change-file"], args["change-to"]);
}

function within(promise, ms) {
  let timer;
  const deadline = new Promise((resolve) => {
    timer = setTimeout(() => resolve(false), ms);
  });
  return Promise.race([promise, deadline]).finally(() => clearTimeout(timer));
}

/** Whether notifications/tools/list_changed arrived within --listen-seconds. */
async function listenForChange(client, changed, seconds) {
  let subscription;
  try {
    subscription = await client.listen({ toolsListChanged: true });
  } catch (error) {
    if (error instanceof SdkError && error.code === SdkErrorCode.MethodNotSupportedByProtocolVersion) {
      note(
        `subscriptions/listen needs 2026-07-28, the connection negotiated ${client.getNegotiatedProtocolVersion()}; ` +
          "waiting for an unsolicited notifications/tools/list_changed instead",
      );
      change();
      return within(changed, seconds * 1000);
    }
    note(`subscriptions/listen failed: ${error && error.message ? error.message : error}`);
    change();
    return false;
  }
  try {
    if (!subscription.honoredFilter.toolsListChanged) {
      note("the server acknowledged the listen without tools list changes");
    }
    change();
    const ended = subscription.closed.then((how) => {
      if (how !== "local") note(`the server ended the listen stream (${how})`);
      return false;
    });
    return await within(Promise.race([changed, ended]), seconds * 1000);
  } finally {
    await subscription.close();
  }
}

async function main() {
  const out = {};
  let notified;
  const changed = new Promise((resolve) => {
    notified = resolve;
  });
  const transport = new StreamableHTTPClientTransport(new URL(args.url), {
    requestInit: { headers: { Authorization: `Bearer ${args.key}` } },
  });
  const client = new PinnedClient(
    { name: "ctxsync-test", version: "1.0.0" },
    { versionNegotiation: { mode: "auto" } },
  );
  client.pins = args.handle;
  client.setNotificationHandler("notifications/tools/list_changed", () => notified(true));
  await client.connect(transport);
  out.protocol = client.getNegotiatedProtocolVersion() ?? null;
  [out.tools, out.list_hints] = await listTools(client);
  const toolArguments = JSON.parse(args.arguments);
  out.first_call = await call(client, args.call, toolArguments);
  if (args["listen-seconds"] !== undefined) {
    out.list_changed = await listenForChange(client, changed, Number(args["listen-seconds"]));
  }
  if (args["call-after"]) {
    [out.tools_after] = await listTools(client);
    out.second_call = await call(client, args["call-after"], toolArguments);
  }
  if (transport.sessionId !== undefined) await transport.terminateSession();
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

// Preload (`node --import`) for the MCP conformance CLI, which sends no
// headers of its own: every fetch it makes carries MCP_AUTH_HEADER (the
// catalog's `/mcp` answers only requests with a tenant key).
const header = process.env.MCP_AUTH_HEADER; // "Bearer <tenant key>"
const realFetch = globalThis.fetch;
globalThis.fetch = (input, init = {}) => {
  const headers = new Headers(init.headers ?? (input instanceof Request ? input.headers : undefined));
  if (header && !headers.has("authorization")) headers.set("authorization", header);
  return realFetch(input, { ...init, headers });
};

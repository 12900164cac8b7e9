// Drives the context page in the system Chromium for
// tests/e2e/tests/context_page.rs, one command at a time: each stdin line is
// a JSON command, each answer one stdout line `OK <json>` or `ERR <message>`.
// Waits end on the page's state within the command's deadline, never on a sleep.
//
// Every response body the page received and every server-sent event message
// (Chrome DevTools protocol) is kept, so the test can search the traffic.
import { createRequire } from "node:module";
import readline from "node:readline";

const require = createRequire(process.env.CTXSYNC_BROWSER_DIR + "/");
const { chromium } = require("playwright-core");

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  headless: true,
  args: ["--no-sandbox", "--disable-dev-shm-usage"],
});
let context, page;
const traffic = [];
const requests = [];

async function newPage(viewport) {
  if (context) await context.close();
  context = await browser.newContext({ viewport });
  page = await context.newPage();
  const cdp = await context.newCDPSession(page);
  await cdp.send("Network.enable");
  cdp.on("Network.eventSourceMessageReceived", (e) => traffic.push(e.data));
  page.on("request", (r) => requests.push(r.url() + "\n" + JSON.stringify(r.headers())));
  page.on("response", async (r) => {
    const type = r.headers()["content-type"] || "";
    if (type.includes("event-stream")) return;
    try { traffic.push(await r.text()); } catch (_) { /* a redirect, or gone */ }
  });
}

const deadline = (cmd) => cmd.timeout_ms || 30000;

async function agentState(predicate, cmd) {
  await page.waitForFunction(predicate, cmd, { timeout: deadline(cmd), polling: "raf" });
  return page.evaluate(() => window.ctxsyncPage.renders);
}

async function tabToAgent(cmd) {
  // One evaluation per look: a locator resolved before a live redraw would
  // name the row's old link, no longer the one with the focus.
  const onLink = () => page.evaluate((id) => {
    const a = document.activeElement;
    return !!a && a.tagName === "A" && !!a.closest(`tr[data-agent-id="${id}"]`);
  }, cmd.agent_id);
  await page.locator("#search").focus();
  for (let i = 0; i < 50; i++) {
    if (await onLink()) break;
    await page.keyboard.press("Tab");
  }
  if (!(await onLink())) throw new Error("the agent's link is not reachable with Tab");
}

const commands = {
  async open(cmd) {
    await newPage(cmd.viewport || { width: 1280, height: 800 });
    await page.goto(cmd.url);
    return {};
  },
  async wait_login(cmd) {
    await page.locator("#login").waitFor({ state: "visible", timeout: deadline(cmd) });
    return { focused: await page.evaluate(() => document.activeElement && document.activeElement.id) };
  },
  // Types the key with the keyboard and submits with Enter.
  async login(cmd) {
    await page.locator("#key").focus();
    await page.keyboard.type(cmd.key);
    await page.keyboard.press("Enter");
    await page.locator("#login").waitFor({ state: "hidden", timeout: deadline(cmd) });
    await page.waitForFunction(() => window.ctxsyncPage.live, null, { timeout: deadline(cmd) });
    return {};
  },
  async wait_row(cmd) {
    const row = page.locator(`tr[data-agent-id="${cmd.agent_id}"]`);
    await row.waitFor({ state: "visible", timeout: deadline(cmd) });
    return { text: await row.innerText() };
  },
  // Reaches the agent's link with Tab from the search field; says how many
  // times the list had been drawn by then.
  async tab_to_agent(cmd) {
    await tabToAgent(cmd);
    return { list_renders: await page.evaluate(() => window.ctxsyncPage.listRenders) };
  },
  // Once the list has been drawn again since `since`: which agent's row holds the focus.
  async focused_after_render(cmd) {
    await page.waitForFunction((c) => window.ctxsyncPage.listRenders > c.since, cmd, { timeout: deadline(cmd), polling: "raf" });
    return await page.evaluate(() => {
      const a = document.activeElement;
      const row = a && a.closest("tr[data-agent-id]");
      return { tag: a ? a.tagName : null, agent_id: row ? row.dataset.agentId : null };
    });
  },
  // Opens the focused link with Enter.
  async enter(cmd) {
    await page.keyboard.press("Enter");
    await page.locator("#agent").waitFor({ state: "visible", timeout: deadline(cmd) });
    return {};
  },
  // Reaches the agent's link with Tab and opens it with Enter.
  async open_agent(cmd) {
    await tabToAgent(cmd);
    return commands.enter(cmd);
  },
  async goto_hash(cmd) {
    await page.evaluate((h) => { location.hash = h; }, cmd.hash);
    return {};
  },
  async wait_phase(cmd) {
    const renders = await agentState((c) => {
      const b = document.getElementById("agent-body");
      return b && b.dataset.phase === c.phase && b.dataset.stale === String(c.stale) && Number(b.dataset.tools) >= (c.min_tools || 0);
    }, cmd);
    return { renders };
  },
  async wait_text(cmd) {
    await page.locator(cmd.selector).filter({ hasText: cmd.text }).first().waitFor({ state: "visible", timeout: deadline(cmd) });
    return {};
  },
  // The catalog view: a configured server's row and both charts drawn.
  async wait_catalog(cmd) {
    const row = page.locator(`#catalog tr[data-server-id="${cmd.server_id}"]`);
    await row.waitFor({ state: "visible", timeout: deadline(cmd) });
    const charts = page.locator("#catalog svg[data-chart][role=img]");
    await page.waitForFunction(() => document.querySelectorAll("#catalog svg[data-chart]").length === 2, null, { timeout: deadline(cmd) });
    return {
      row: await row.innerText(),
      warmup: await row.getAttribute("data-warmup"),
      charts: await charts.evaluateAll((svgs) => svgs.map((s) => ({ chart: s.dataset.chart, label: s.getAttribute("aria-label"), title: s.querySelector("title") && s.querySelector("title").textContent }))),
    };
  },
  async expand_first_tool() {
    const tool = page.locator("details.tool").first();
    await tool.locator("summary").focus();
    await page.keyboard.press("Enter");
    return { schema: await tool.locator("pre").innerText() };
  },
  async renders() {
    return { renders: await page.evaluate(() => window.ctxsyncPage.renders) };
  },
  async screenshot(cmd) {
    await page.screenshot({ path: cmd.path, fullPage: true });
    return { path: cmd.path };
  },
  // Whether `needle` is anywhere in the page's text, its HTML, the storage
  // outside the key, the requests, or the traffic received so far.
  async search(cmd) {
    const html = await page.content();
    const text = await page.evaluate(() => document.body.innerText);
    return {
      in_page: html.includes(cmd.needle) || text.includes(cmd.needle),
      in_traffic: traffic.some((t) => t.includes(cmd.needle)),
      in_requests: requests.some((r) => r.includes(cmd.needle)),
      traffic_items: traffic.length,
    };
  },
  async close() {
    await browser.close();
    return {};
  },
};

const lines = readline.createInterface({ input: process.stdin });
console.log("OK " + JSON.stringify({ ready: true }));
for await (const line of lines) {
  if (!line.trim()) continue;
  let cmd;
  try {
    cmd = JSON.parse(line);
    const result = await commands[cmd.op](cmd);
    console.log("OK " + JSON.stringify(result));
    if (cmd.op === "close") break;
  } catch (e) {
    console.log("ERR " + (cmd && cmd.op) + ": " + String(e && e.message || e).split("\n")[0]);
  }
}
process.exit(0);

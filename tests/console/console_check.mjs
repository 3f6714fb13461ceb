// Drives the agentenv console in Debian's headless Chromium and prints what it saw as one JSON line.
// Env: CONSOLE_URL, API_KEY, PARENT, CHILDREN (comma list), SHOT_DIR, CHROMIUM (default /usr/bin/chromium).
import { chromium } from "playwright-core";

const { CONSOLE_URL, API_KEY, PARENT, SHOT_DIR } = process.env;
const CHILDREN = process.env.CHILDREN.split(",");
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium", headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
});
const out = { errors: [] };
try {
  const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
  page.on("pageerror", (e) => out.errors.push(String(e)));
  page.on("console", (m) => { if (m.type() === "error") out.errors.push(m.text()); });
  const show = async (hash, view) => {
    await page.evaluate((h) => { window.agentenvConsole.rendered = null; location.hash = h; }, hash);
    await page.waitForFunction((v) => window.agentenvConsole.rendered === v || window.agentenvConsole.error, view, { timeout: 60000 });
  };

  await page.goto(CONSOLE_URL + "/console/", { waitUntil: "load" });
  out.title = await page.title();
  await page.fill("#api-key", API_KEY);
  await page.click("#key-form button");
  await page.waitForSelector(`tr[data-sandbox-id="${PARENT}"]`, { timeout: 60000 });
  for (const c of CHILDREN) await page.waitForSelector(`tr[data-sandbox-id="${c}"]`, { timeout: 30000 });
  out.listed = await page.$$eval("#sandboxes tbody tr[data-sandbox-id]", (rows) => rows.map((r) => ({
    id: r.dataset.sandboxId, text: r.innerText })));
  out.nodes = await page.$$eval("#nodes .node", (ns) => ns.map((n) => n.innerText));
  await page.screenshot({ path: `${SHOT_DIR}/console-overview.png`, fullPage: true });

  // metadata filter: only this run's sandboxes
  await page.fill("#f-metadata", `run=${process.env.RUN}`);
  await page.click("#filters button");
  await page.waitForFunction((n) => document.querySelectorAll("#sandboxes tbody tr[data-sandbox-id]").length === n, CHILDREN.length + 1, { timeout: 30000 });
  out.filtered = await page.$$eval("#sandboxes tbody tr[data-sandbox-id]", (rows) => rows.map((r) => r.dataset.sandboxId));

  await show("#/lineage", "lineage");
  await page.waitForTimeout(500);  // layout animation off, but let the canvas paint
  out.tree = await page.evaluate((parent) => {
    const cy = window.agentenvConsole.state.cy;
    const p = cy.getElementById(parent);
    const kids = p.outgoers("node");
    return { nodes: cy.nodes().length, parentY: p.position("y"), parentX: p.position("x"),
      children: kids.map((n) => ({ id: n.id(), y: n.position("y"), x: n.position("x") })),
      parentOf: p.incomers("node").map((n) => n.id()), visible: p.visible() };
  }, PARENT);
  await page.screenshot({ path: `${SHOT_DIR}/console-lineage.png` });

  await show(`#/sandbox/${PARENT}`, "sandbox");
  await page.waitForSelector("#chart-cpu canvas", { timeout: 30000 });
  out.detail = await page.evaluate(() => {
    const painted = (c) => {  // non-transparent pixels: the chart really drew something
      const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
      let n = 0;
      for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++;
      return n;
    };
    return { ...window.agentenvConsole.detail,
      canvases: [...document.querySelectorAll(".chart canvas")].map(painted),
      logs: [...document.querySelectorAll("#d-logs tbody tr")].map((r) => r.innerText),
      procs: [...document.querySelectorAll("#d-procs tbody tr")].map((r) => r.innerText),
      state: document.querySelector("#d-state").textContent };
  });
  await page.screenshot({ path: `${SHOT_DIR}/console-sandbox.png`, fullPage: true });

  await show("#/snapshots", "snapshots");
  out.templates = await page.$$eval("#templates tbody tr", (rows) => rows.map((r) => r.innerText));
  await show("#/events", "events");
  out.events = await page.$$eval("#events tbody tr", (rows) => rows.map((r) => r.dataset.type + " " + r.cells[3].innerText));
  out.error = await page.evaluate(() => window.agentenvConsole.error || null);
} finally {
  await browser.close();
}
console.log(JSON.stringify(out));

// dashboard.js - opens the scheduler's dashboard in Debian's chromium (playwright-core),
// with every request not to 127.0.0.1 blocked, waits for the plots to fill and to move
// on, saves a screenshot, and prints what it saw as JSON (test_dashboard.py checks it).
// Usage: node dashboard.js URL SCREENSHOT.png
"use strict";
const { chromium } = require("playwright-core");

const [url, shot] = process.argv.slice(2);

function state() {
  const plots = {};
  for (const p of document.querySelectorAll(".plot")) plots[p.id] = Number(p.dataset.points || 0);
  return {
    updates: Number(document.body.dataset.updates || 0),
    last: Number(document.body.dataset.last || 0),
    points: plots,
    canvases: document.querySelectorAll(".plot canvas").length,
    rows: [...document.querySelectorAll("#nodes tbody tr")].map(tr => [...tr.children].map(td => td.textContent)),
    job: document.getElementById("job").textContent,
  };
}

(async () => {
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    headless: true,
    args: ["--no-sandbox", "--disable-gpu"],
  });
  try {
    const page = await browser.newPage({ viewport: { width: 1280, height: 1000 } });
    const blocked = [], errors = [];
    await page.route("**/*", route => {
      const u = new URL(route.request().url());
      if (u.hostname === "127.0.0.1") return route.continue();
      blocked.push(u.href);
      return route.abort();
    });
    page.on("pageerror", e => errors.push(String(e)));
    page.on("console", m => { if (m.type() === "error") errors.push(m.text()); });
    await page.goto(url, { waitUntil: "load", timeout: 15000 });
    await page.waitForFunction(() => Number(document.querySelector("#plot-throughput").dataset.points || 0) > 2 &&
                                     Number(document.body.dataset.updates || 0) >= 2, null, { timeout: 30000 });
    const first = await page.evaluate(state);
    await page.waitForFunction(last => Number(document.body.dataset.last || 0) > last + 1.5, first.last,
                               { timeout: 15000 });
    const second = await page.evaluate(state);
    await page.screenshot({ path: shot, fullPage: true });
    console.log(JSON.stringify({ first, second, blocked, errors }));
  } finally {
    await browser.close();
  }
})().catch(e => { console.error(String(e && e.stack || e)); process.exit(1); });

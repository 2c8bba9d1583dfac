// The chat page at `/` in a real headless Chromium (Debian's /usr/bin/chromium, driven by playwright-core): it
// loads without the network, takes the API key, streams a reply in pieces, shows the reasoning apart and folds it,
// shows tokens/s and the time to first token, stops a reply (and the server stops generating it), starts a new
// chat, and fits a phone's width. Usage: node page.mjs http://HOST:PORT API_KEY [SCREENSHOT_DIR]
// Run by crates/tern-server/tests/page.rs; exits non-zero with a message on the first failure.

import { join } from "node:path";
import { check, serverReady, until, withBrowser } from "./lib.mjs";

const [root, key, shots] = process.argv.slice(2);
if (!root || !key) {
  console.error("usage: node page.mjs ROOT API_KEY [SCREENSHOT_DIR]");
  process.exit(2);
}

async function metric(name) {
  const r = await fetch(`${root}/metrics`, { headers: { Authorization: `Bearer ${key}` } });
  const line = (await r.text()).split("\n").find((l) => l.startsWith(name + " "));
  return Number(line.split(" ")[1]);
}

await serverReady(root);
await withBrowser("page.mjs", async (context) => {
  const page = context.pages()[0] || (await context.newPage());
  const external = [];
  page.on("request", (req) => { if (!req.url().startsWith(root)) external.push(req.url()); });
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));

  // Load: the server wants a key, so the page says so; with the key it finds the model.
  await page.goto(`${root}/`);
  check((await page.title()) === "tern", "title");
  await until("the key prompt", async () => (await page.textContent("#model")).includes("API key"));
  await page.click("#settings-toggle");
  await page.fill("#api-key", key);
  await page.dispatchEvent("#api-key", "change");
  await until("the model name", async () => {
    const t = await page.textContent("#model");
    return t && !t.includes("API key") && !t.includes("connecting") && t;
  });
  await page.fill("#system", "You are terse.");
  await page.dispatchEvent("#system", "change");
  await page.fill("#max-tokens", "40");
  await page.dispatchEvent("#max-tokens", "change");
  await page.uncheck("#thinking");
  await page.click("#settings-toggle");

  // A streamed reply: the content element changes many times before the reply is done.
  await page.evaluate(() => {
    window.__updates = 0;
    new MutationObserver(() => { window.__updates++; })
      .observe(document.getElementById("thread"), { subtree: true, childList: true, characterData: true });
  });
  await page.fill("#input", "Hello there");
  await page.press("#input", "Enter");
  await until("the reply", () => page.$(".msg.assistant[data-done]"));
  const content = await page.textContent(".msg.assistant .content");
  const stats = await page.textContent(".msg.assistant .stats");
  const updates = await page.evaluate(() => window.__updates);
  check(content.length > 0, "reply text");
  check(updates >= 5, `streamed in pieces (${updates} updates)`);
  check(/\d+ tokens/.test(stats) && /tokens\/s/.test(stats) && /first token \d+ ms/.test(stats), `stats: ${stats}`);
  check((await page.textContent(".msg.user")) === "Hello there", "the question is shown");
  console.log(`reply: ${content.length} characters, ${updates} updates; ${stats}`);

  // Reasoning on: shown apart, open while it streams, folded once the answer starts (or when clicked).
  await page.click("#settings-toggle");
  await page.check("#thinking");
  await page.fill("#max-tokens", "30");
  await page.dispatchEvent("#max-tokens", "change");
  await page.click("#settings-toggle");
  await page.fill("#input", "Think first");
  await page.click("#send");
  await until("the second reply", async () => (await page.$$(".msg.assistant[data-done]")).length === 2);
  const second = (await page.$$(".msg.assistant")).at(-1);
  const reasoning = await second.$("details.reasoning");
  check(await reasoning.isVisible(), "the reasoning block is shown");
  check((await (await reasoning.$(".text")).textContent()).length > 0, "reasoning text");
  const wasOpen = await reasoning.evaluate((d) => d.open);
  await (await reasoning.$("summary")).click();
  check((await reasoning.evaluate((d) => d.open)) !== wasOpen, "the reasoning folds and unfolds");
  if (shots) await page.screenshot({ path: join(shots, "page-desktop.png"), fullPage: true });

  // Stop: a long reply is stopped mid-way; the page says so and the server stops generating.
  await page.click("#settings-toggle");
  await page.uncheck("#thinking");
  await page.fill("#max-tokens", "1500");
  await page.dispatchEvent("#max-tokens", "change");
  await page.click("#settings-toggle");
  await page.fill("#input", "Tell me a long story");
  await page.click("#send");
  await until("the stop button", () => page.isVisible("#stop"));
  const third = (await page.$$(".msg.assistant")).at(-1);
  await until("some streamed text", async () => (await (await third.$(".content")).textContent()).length > 10);
  await page.click("#stop");
  await until("the stopped reply", async () => (await third.getAttribute("data-done")) === "stopped");
  check((await (await third.$(".stats")).textContent()).includes("stopped"), "stats say stopped");
  check(await page.isVisible("#send") && !(await page.isVisible("#stop")), "send is back");
  await until("the server to stop the request", async () => (await metric("tern_requests_running")) === 0, 10000);
  const stoppedAt = (await (await third.$(".content")).textContent()).length;
  await new Promise((r) => setTimeout(r, 300));
  check((await (await third.$(".content")).textContent()).length === stoppedAt, "no text after stop");

  // New chat: the thread is empty again.
  await page.click("#new-chat");
  check((await page.$$(".msg")).length === 0 && (await page.isVisible("#empty")), "new chat is empty");

  // A phone: nothing wider than the screen, the input and send button on screen.
  await page.setViewportSize({ width: 390, height: 844 });
  await page.click("#settings-toggle");
  await page.fill("#max-tokens", "60");
  await page.dispatchEvent("#max-tokens", "change");
  await page.click("#settings-toggle");
  await page.fill("#input", "Hi from a phone");
  await page.click("#send");
  await until("the phone reply", () => page.$(".msg.assistant[data-done]"));
  const fits = await page.evaluate(() => document.documentElement.scrollWidth <= window.innerWidth);
  check(fits, "no horizontal scrolling at 390 px");
  const send = await page.$("#send");
  const box = await send.boundingBox();
  check(box && box.x + box.width <= 390 && box.y + box.height <= 844, `send button on screen: ${JSON.stringify(box)}`);
  if (shots) await page.screenshot({ path: join(shots, "page-phone.png"), fullPage: true });

  check(external.length === 0, `requests left the server: ${external}`);
  check(errors.length === 0, `page errors: ${errors}`);
});

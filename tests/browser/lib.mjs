// Shared by the chat page's browser tests (page.mjs, page_images.mjs): checks, polling, the server's readiness and
// a headless Chromium (Debian's /usr/bin/chromium) in a throwaway profile.

import { chromium } from "playwright-core";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

export function check(cond, what) {
  if (!cond) throw new Error("check failed: " + what);
}

export async function until(what, fn, ms = 30000) {
  const t0 = Date.now();
  for (;;) {
    const v = await fn();
    if (v) return v;
    if (Date.now() - t0 > ms) throw new Error("timed out waiting for " + what);
    await new Promise((r) => setTimeout(r, 50));
  }
}

export async function serverReady(root) {
  await until(`the server at ${root} to be ready`, async () => {
    try {
      return (await fetch(`${root}/health`)).status === 200;
    } catch {
      return false;
    }
  }, 120000);
}

// Run `body(context)` in a fresh headless Chromium; exits the process, non-zero (with the error) if it threw.
export async function withBrowser(name, body) {
  const profile = mkdtempSync(join(tmpdir(), "tern-page-"));
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: "/usr/bin/chromium",
    headless: true,
    chromiumSandbox: false,
    args: ["--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
           "--disable-component-update", "--disable-sync"],
    viewport: { width: 1100, height: 800 },
  });
  const t0 = Date.now();
  let failed = false;
  try {
    await body(context);
    console.log(`${name}: ok (${((Date.now() - t0) / 1000).toFixed(1)} s)`);
  } catch (e) {
    failed = true;
    console.error(e.stack || String(e));
  } finally {
    await context.close();
    rmSync(profile, { recursive: true, force: true });
  }
  process.exit(failed ? 1 : 0);
}

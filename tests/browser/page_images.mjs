// Images on the chat page, in a real headless Chromium: against a server on a random vision-language model, images
// are attached from the file button and pasted from the clipboard, previewed and removed (by keyboard), sent as
// OpenAI `image_url` parts with data: URLs beside the text, shown as thumbnails in the history and answered by a
// streamed reply; an image over the server's byte limit is refused with the server's message, the message goes back
// to the input and the page keeps going; a file that is not an image is not attached. Against a text-only model the
// page shows the server's "does not read images" message and then answers text. The composer fits a phone.
// Usage: node page_images.mjs VL_ROOT TEXT_ROOT FIXTURES_DIR [SCREENSHOT_DIR] (servers without an API key; the
// vision-language one allows 16,000 bytes per image). Run by crates/tern-server/tests/page.rs.

import { readFileSync } from "node:fs";
import { join } from "node:path";
import { check, serverReady, until, withBrowser } from "./lib.mjs";

const [vlRoot, textRoot, fixtures, shots] = process.argv.slice(2);
if (!vlRoot || !textRoot || !fixtures) {
  console.error("usage: node page_images.mjs VL_ROOT TEXT_ROOT FIXTURES_DIR [SCREENSHOT_DIR]");
  process.exit(2);
}
const file = (name) => join(fixtures, name);
const bytes = (name) => readFileSync(file(name));

// Open the page at `root` with short replies and no reasoning; its requests to the chat API are kept in `sent`.
async function open(context, root, sent, external, errors) {
  const page = await context.newPage();
  page.on("request", (req) => {
    if (!req.url().startsWith(root)) external.push(req.url());
    else if (req.url().endsWith("/v1/chat/completions")) sent.push(JSON.parse(req.postData()));
  });
  page.on("pageerror", (e) => errors.push(String(e)));
  await page.goto(`${root}/`);
  await until("the model name", async () => {
    const t = await page.textContent("#model");
    return t && !t.includes("connecting") && !t.includes("loading") && t;
  });
  await page.click("#settings-toggle");
  await page.fill("#max-tokens", "16");
  await page.dispatchEvent("#max-tokens", "change");
  await page.uncheck("#thinking");
  await page.click("#settings-toggle");
  return page;
}

// The previews above the input: [{alt, loaded}].
const previews = (page) => page.$$eval("#attachments img", (imgs) =>
  imgs.map((i) => ({ alt: i.alt, loaded: i.complete && i.naturalWidth > 0 })));

// Paste `files` ([{name, type, b64}]) into the message input, as the clipboard would.
async function paste(page, files) {
  await page.focus("#input");
  await page.evaluate((files) => {
    const dt = new DataTransfer();
    for (const f of files) {
      const raw = Uint8Array.from(atob(f.b64), (c) => c.charCodeAt(0));
      dt.items.add(new File([raw], f.name, { type: f.type }));
    }
    const e = new ClipboardEvent("paste", { clipboardData: dt, bubbles: true, cancelable: true });
    document.getElementById("input").dispatchEvent(e);
  }, files);
}

// The reply to the last message: its content, stats and error text once done.
async function lastReply(page, n) {
  await until(`reply ${n}`, async () => (await page.$$(".msg.assistant[data-done]")).length === n);
  const last = (await page.$$(".msg.assistant")).at(-1);
  const text = async (sel) => ((await last.$(sel)) ? await (await last.$(sel)).textContent() : "");
  return { content: await text(".content"), stats: await text(".stats"), error: await text(".error") };
}

await serverReady(vlRoot);
await serverReady(textRoot);
await withBrowser("page_images.mjs", async (context) => {
  const external = [];
  const errors = [];

  // --- The vision-language model.
  const sent = [];
  const page = await open(context, vlRoot, sent, external, errors);
  check(await page.isVisible("#attach"), "the attach button is shown");
  check((await page.getAttribute("#attach", "aria-label")).includes("image"), "the attach button is labelled");

  // The file button opens a chooser: two images, previewed.
  const [chooser] = await Promise.all([page.waitForEvent("filechooser"), page.click("#attach")]);
  check(chooser.isMultiple(), "several images can be chosen at once");
  await chooser.setFiles([file("tall.png"), file("alpha.png")]);
  await until("two previews", async () => (await previews(page)).length === 2);
  await until("the previews to load", async () => (await previews(page)).every((p) => p.loaded));
  check((await previews(page)).map((p) => p.alt).join() === "tall.png,alpha.png", "previews named by file");

  // Removed by keyboard: Tab to the second preview's remove button and press Enter.
  const remove = await page.$('#attachments button[aria-label*="alpha.png"]');
  check(remove, "each preview has a labelled remove button");
  await remove.focus();
  await page.keyboard.press("Enter");
  await until("one preview", async () => (await previews(page)).length === 1);
  check((await previews(page))[0].alt === "tall.png", "the other image stays");

  // Pasted: a JPEG from the clipboard is attached; a text file is not (and the page says so).
  await paste(page, [{ name: "notes.txt", type: "text/plain", b64: Buffer.from("hello").toString("base64") }]);
  await until("the note on the text file", async () => (await page.textContent("#attach-note")).includes("notes.txt"));
  check((await previews(page)).length === 1, "a text file is not attached");
  await paste(page, [{ name: "wide.jpg", type: "image/jpeg", b64: bytes("wide.jpg").toString("base64") }]);
  await until("the pasted preview", async () => (await previews(page)).length === 2);
  check((await previews(page))[1].alt === "wide.jpg", "the pasted image is previewed");
  if (shots) await page.screenshot({ path: join(shots, "page-images-compose.png") });

  // Sent beside the text: two image_url parts with the files' bytes as data: URLs, then the text.
  await page.fill("#input", "What is in these pictures?");
  await page.press("#input", "Enter");
  const first = await lastReply(page, 1);
  check(!first.error, `no error: ${first.error}`);
  check(first.content.length > 0, "a reply to the images");
  check(/\d+ tokens/.test(first.stats) && /first token \d+ ms/.test(first.stats), `streamed: ${first.stats}`);
  const parts = sent.at(-1).messages.at(-1).content;
  check(Array.isArray(parts) && parts.length === 3, `three content parts: ${JSON.stringify(parts).slice(0, 200)}`);
  check(parts[0].type === "image_url" && parts[0].image_url.url === "data:image/png;base64," +
        bytes("tall.png").toString("base64"), "the first part is tall.png as a data: URL");
  check(parts[1].type === "image_url" && parts[1].image_url.url === "data:image/jpeg;base64," +
        bytes("wide.jpg").toString("base64"), "the second part is wide.jpg as a data: URL");
  check(parts[2].type === "text" && parts[2].text === "What is in these pictures?", "the text part");
  check((await previews(page)).length === 0 && (await page.isHidden("#attachments")), "the previews are cleared");

  // The history shows the thumbnails (loaded: the page's policy allows data: images) and the text.
  const user = (await page.$$(".msg.user")).at(-1);
  const thumbs = await user.$$eval(".images img", (imgs) => imgs.map((i) => i.naturalWidth > 0 && i.alt));
  check(thumbs.join() === "tall.png,wide.jpg", `thumbnails in the history: ${thumbs}`);
  check((await user.textContent()) === "What is in these pictures?", "the text in the history");
  const thumb = await user.$(".images button");
  const h0 = (await thumb.boundingBox()).height;
  check(h0 > 0 && h0 <= 8 * 16 + 1, `a thumbnail, not the full image: ${h0} px`);
  await thumb.click();
  check((await thumb.getAttribute("aria-expanded")) === "true", "a click enlarges the thumbnail");
  await thumb.click();
  console.log(`images: reply ${first.content.length} characters; ${first.stats}`);

  // A follow-up in text: the images stay in the conversation sent.
  await page.fill("#input", "And the colours?");
  await page.click("#send");
  const second = await lastReply(page, 2);
  check(!second.error && second.content.length > 0, `a reply to the follow-up: ${second.error}`);
  const again = sent.at(-1).messages.filter((m) => m.role === "user");
  check(again.length === 2 && Array.isArray(again[0].content) && again[1].content === "And the colours?",
        "the earlier images are sent again with the history");

  // An image over the server's limit: its message in the conversation, the message back in the input.
  await page.setInputFiles("#file", file("big.png"));
  await until("the big preview", async () => (await previews(page)).length === 1);
  await page.fill("#input", "This one is big");
  await page.click("#send");
  const refused = await lastReply(page, 3);
  check(refused.error.includes("--max-image-bytes"), `the server's message is shown: ${refused.error}`);
  check((await page.$$(".msg.user[data-unanswered]")).length === 1, "the refused message is marked");
  check((await page.inputValue("#input")) === "This one is big", "the text is back in the input");
  check((await previews(page)).length === 1, "the image is back in the previews");
  await page.click('#attachments button[aria-label*="big.png"]');
  await page.click("#send");
  const fourth = await lastReply(page, 4);
  check(!fourth.error && fourth.content.length > 0, "the page goes on after the refusal");
  const users = sent.at(-1).messages.filter((m) => m.role === "user");
  check(users.length === 3 && users[2].content === "This one is big", "the refused turn is not in the history");
  if (shots) await page.screenshot({ path: join(shots, "page-images-desktop.png"), fullPage: true });

  // A phone: the composer with a preview fits, the buttons on screen.
  await page.setViewportSize({ width: 390, height: 844 });
  await page.setInputFiles("#file", [file("exact.png"), file("wide.jpg")]);
  await until("the phone previews", async () => (await previews(page)).length === 2);
  check(await page.evaluate(() => document.documentElement.scrollWidth <= window.innerWidth), "no scrolling at 390 px");
  for (const id of ["#attach", "#send"]) {
    const box = await (await page.$(id)).boundingBox();
    check(box && box.x >= 0 && box.x + box.width <= 390 && box.y + box.height <= 844, `${id} on screen`);
  }
  if (shots) await page.screenshot({ path: join(shots, "page-images-phone.png"), fullPage: true });
  await page.close();

  // --- The text-only model: the server's refusal shown, then text answered.
  const sentText = [];
  const tpage = await open(context, textRoot, sentText, external, errors);
  await tpage.setInputFiles("#file", file("exact.png"));
  await until("the preview", async () => (await previews(tpage)).length === 1);
  await tpage.fill("#input", "Describe this");
  await tpage.press("#input", "Enter");
  const no = await lastReply(tpage, 1);
  check(no.error.includes("does not read images"), `the server's message is shown: ${no.error}`);
  check((await tpage.$$(".msg.user .images img")).length === 1, "the refused message shows its thumbnail");
  await tpage.focus('#attachments button[aria-label*="exact.png"]');
  await tpage.keyboard.press("Enter");
  check((await previews(tpage)).length === 0, "the image removed");
  await tpage.press("#input", "Enter");
  const text = await lastReply(tpage, 2);
  check(!text.error && text.content.length > 0, `text is answered after the refusal: ${text.error}`);
  check(sentText.at(-1).messages.at(-1).content === "Describe this", "sent as plain text");
  console.log(`text-only: "${no.error}"`);

  check(external.length === 0, `requests left the server: ${external}`);
  check(errors.length === 0, `page errors: ${errors}`);
});

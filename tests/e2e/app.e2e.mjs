// End-to-end: the real quince-app binary in WebKitGTK, driven through tauri-driver, on a fresh
// profile with the demo model. Every state is photographed into $E2E_SHOTS.
//
//   node tests/e2e/app.e2e.mjs   (tests/e2e/run.sh sets up Xvfb, tauri-driver and a profile)

import assert from "node:assert/strict";
import { execFileSync, spawnSync } from "node:child_process";
import { mkdirSync, writeFileSync } from "node:fs";
import { join, resolve } from "node:path";
import { Keys, Session } from "./webdriver.mjs";

const DRIVER = process.env.E2E_DRIVER ?? "http://127.0.0.1:4444";
const APP = resolve(process.env.E2E_APP ?? "target/debug/quince-app");
const SHOTS = resolve(process.env.E2E_SHOTS ?? "target/e2e-shots");
const IMAGE = resolve("tests/golden/vision/images/rgb_640x480.png");
mkdirSync(SHOTS, { recursive: true });

let step = 0;
async function shot(s, name) {
  step += 1;
  const file = join(SHOTS, `${String(step).padStart(2, "0")}-${name}.png`);
  writeFileSync(file, await s.screenshot());
  console.log(`  screenshot ${file}`);
}

/** Everything on screen the checks look at, read in one round trip. */
function view(s) {
  return s.execute(`
    const q = (el, sel) => el.querySelector('[data-testid="' + sel + '"]');
    const messages = [...document.querySelectorAll('[data-testid="message"]')].map((m) => ({
      id: m.dataset.id, role: m.dataset.role, state: m.dataset.state,
      text: q(m, 'message-content')?.innerText ?? '',
      branch: q(m, 'branch-label')?.innerText ?? null,
      thumbs: [...m.querySelectorAll('[data-testid="message-thumb"]')].map((i) => i.complete ? i.naturalWidth : -1),
      stats: q(m, 'reply-stats')?.innerText ?? null,
    }));
    return {
      messages,
      streaming: document.querySelector('[data-streaming]')?.dataset.streaming === 'true',
      model: q(document, 'model-status')?.innerText ?? null,
      conversations: [...document.querySelectorAll('[data-testid="conversation-item"]')].map((c) => c.innerText.trim()),
      error: q(document, 'error-banner')?.innerText ?? null,
      waiting: q(document, 'waiting-for-model')?.innerText ?? null,
      queued: q(document, 'queued')?.innerText ?? null,
      unanswered: q(document, 'unanswered') !== null,
    };`);
}

/** Waits until `predicate(view)` holds and returns that view; a timeout shows the last view. */
async function waitForView(s, what, predicate, timeoutMs = 30000, everyMs = 100) {
  let seen = null;
  try {
    return await s.waitFor(what, async () => {
      seen = await view(s);
      return predicate(seen) ? seen : null;
    }, timeoutMs, everyMs);
  } catch (error) {
    error.message += `\nlast view: ${JSON.stringify(seen, null, 1)}`;
    throw error;
  }
}

// The demo model the app ships: trained on the Debian `fortunes` corpus (tests/models/).
const DEMO = "Demo (small, trained on fortunes)";
const last = (v, role) => v.messages.filter((m) => m.role === role).at(-1);

async function waitForModel(s, timeoutMs = 60000) {
  await s.waitFor("the demo model to load", async () => (await view(s)).model === DEMO, timeoutMs);
}

async function setMaxTokens(s, n) {
  await (await s.find('[data-testid="settings-button"]')).click();
  const field = await s.waitForElement('[data-testid="max-tokens"]');
  await field.clear();
  await field.type(String(n));
  await (await s.find('[data-testid="settings-save"]')).click();
  await s.waitFor("the settings panel to close", async () => (await s.findAll('[data-testid="max-tokens"]')).length === 0);
}

async function send(s, text) {
  const input = await s.find('[data-testid="composer-input"]');
  await input.type(text);
  await input.type(Keys.ENTER);
}

async function waitForReply(s, count, timeoutMs = 120000) {
  return s.waitFor(`reply ${count} to finish`, async () => {
    const v = await view(s);
    const replies = v.messages.filter((m) => m.role === "assistant");
    return replies.length === count && !v.streaming && replies.at(-1).state !== "streaming" ? v : null;
  }, timeoutMs);
}

async function main() {
  console.log(`e2e: ${APP}`);
  let s = await Session.start(DRIVER, APP);
  try {
    // First run: the demo model is found among the resources and loads. Its first load builds
    // MLX's kernels (run.sh gives the app a fresh TMPDIR, as on a fresh install), so it takes
    // a while; a message sent meanwhile is stored at once, shown as waiting for the model,
    // and answered when the load ends.
    await s.waitFor("the demo model to start loading", async () => (await view(s)).model === "Loading…", 30000);
    await (await s.waitForElement('[data-testid="new-chat"]')).click();
    await s.waitForElement('[data-testid="empty-state"]');
    await setMaxTokens(s, 16);
    await send(s, "Hello, who are you?");
    let v = await waitForView(s, "the message to wait for the model", (v) => v.waiting && v.messages.length === 1);
    assert.ok(v.waiting.startsWith(`Waiting for ${DEMO} to load…`), v.waiting);
    assert.equal(v.messages[0].text, "Hello, who are you?");
    assert.equal(v.model, "Loading…", "sent while the model loads");
    await shot(s, "waiting-for-model");
    // Building the kernels takes about half a minute on two idle cores.
    await waitForModel(s, 240000);
    v = await waitForReply(s, 1);
    assert.equal(last(v, "assistant").state, "complete");
    assert.ok(!v.waiting && !v.unanswered && !v.error, JSON.stringify(v));
    await shot(s, "answered-after-load");

    // A conversation: tokens stream in, then the stats line.
    await (await s.find('[data-testid="new-chat"]')).click();
    await s.waitForElement('[data-testid="empty-state"]');
    await setMaxTokens(s, 96);
    await send(s, "Hello there! Who are you?");
    const lengths = new Set();
    await s.waitFor("the reply to stream", async () => {
      const v = await view(s);
      const reply = last(v, "assistant");
      if (reply && v.streaming) lengths.add(reply.text.length);
      return !v.streaming && reply && reply.state !== "streaming";
    }, 120000, 20);
    const growing = [...lengths].filter((n) => n > 0);
    assert.ok(growing.length >= 2, `saw the reply grow while streaming (lengths ${[...lengths]})`);
    v = await view(s);
    assert.equal(last(v, "assistant").state, "complete");
    assert.match(last(v, "assistant").stats, /TTFT .* ms · .* tok\/s/);
    await s.waitFor("the title made from the first message", async () =>
      (await view(s)).conversations[0]?.split("\n")[0] === "Hello there! Who are you?");
    await shot(s, "streamed-reply");

    // Stop a reply as soon as it streams (the demo's replies are a fortune long: a few seconds
    // at the debug build's pace).
    await setMaxTokens(s, 4000);
    await send(s, "Tell me a very long story.");
    await s.waitFor("the long reply to start", async () => {
      const v = await view(s);
      return v.streaming && last(v, "assistant")?.text.length > 0;
    }, 60000, 20);
    await (await s.find('[data-testid="stop-button"]')).click();
    v = await waitForReply(s, 2, 30000);
    assert.equal(last(v, "assistant").state, "stopped");
    await shot(s, "stopped");

    // Regenerate it: a second branch of the reply.
    await setMaxTokens(s, 24);
    const regenerate = await s.findAll('[data-testid="regenerate-button"]');
    await regenerate.at(-1).click();
    v = await s.waitFor("the regenerated reply", async () => {
      const v = await view(s);
      const reply = last(v, "assistant");
      return !v.streaming && reply?.branch === "2/2" && reply.state === "complete" ? v : null;
    }, 120000);
    await shot(s, "regenerated");

    // Edit the first message into a branch, then switch between the branches.
    await (await s.findAll('[data-testid="edit-button"]'))[0].click();
    const edit = await s.waitForElement('[data-testid="edit-input"]');
    await edit.clear();
    await edit.type("Hello again, edited!");
    await (await s.find('[data-testid="edit-save"]')).click();
    v = await s.waitFor("the edited branch", async () => {
      const v = await view(s);
      const first = v.messages[0];
      return !v.streaming && first?.branch === "2/2" && v.messages.length === 2 && v.messages[1].state === "complete" ? v : null;
    }, 120000);
    assert.equal(v.messages[0].text, "Hello again, edited!");
    await shot(s, "edited-branch");
    await (await s.findAll('[data-testid="branch-prev"]'))[0].click();
    v = await s.waitFor("the first branch", async () => {
      const v = await view(s);
      return v.messages[0]?.branch === "1/2" && v.messages.length === 4 ? v : null;
    });
    assert.equal(v.messages[0].text, "Hello there! Who are you?");
    assert.equal(v.messages[3].branch, "2/2", "the first branch keeps its regenerated reply");
    await shot(s, "first-branch");
    await (await s.findAll('[data-testid="branch-next"]'))[0].click();
    await s.waitFor("back to the edited branch", async () => (await view(s)).messages[0]?.branch === "2/2");

    // Attach an image and get a reply; the thumbnail is served from the app's folder.
    await (await s.find('[data-testid="attach-input"]')).type(IMAGE);
    await s.waitForElement('[data-testid="composer-thumb"]', 30000);
    await send(s, "What is in this picture?");
    v = await s.waitFor("the image reply", async () => {
      const v = await view(s);
      const reply = last(v, "assistant");
      return !v.streaming && v.messages.length === 4 && reply.state === "complete" ? v : null;
    }, 120000);
    const user = last(v, "user");
    assert.equal(user.text, "What is in this picture?");
    await s.waitFor("the thumbnail to load", async () => last(await view(s), "user").thumbs[0] === 640);
    assert.ok(!v.error, `no error banner: ${v.error}`);
    await shot(s, "image-reply");
  } finally {
    await s.quit();
  }

  // Quit and relaunch on the same profile: everything is still there.
  s = await Session.start(DRIVER, APP);
  try {
    await waitForModel(s);
    const items = await s.waitFor("the conversation list", async () => {
      const items = await s.findAll('[data-testid="conversation-item"]');
      return items.length ? items : null;
    });
    // The chat answered after the first load, and the main one (the most recent, on top).
    assert.equal(items.length, 2);
    await items[0].click();
    const v = await waitForView(s, "the conversation to reopen", (v) => v.messages.length === 4);
    assert.equal(v.messages[0].text, "Hello again, edited!");
    assert.equal(v.messages[0].branch, "2/2");
    assert.equal(v.messages[2].text, "What is in this picture?");
    await s.waitFor("the thumbnail after relaunch", async () => (await view(s)).messages[2].thumbs[0] === 640);
    await shot(s, "relaunched");
    // The next turn resumes from the KV checkpoint saved with the conversation.
    await send(s, "One more thing.");
    const next = await waitForReply(s, 3);
    assert.equal(last(next, "assistant").state, "complete");
    assert.match(last(next, "assistant").stats, /resumed/);
    assert.match(last(next, "assistant").stats, /\d+ reused \+ \d+ prefilled/);
    await shot(s, "resumed-after-relaunch");
    // Speculative decoding, chosen in the chat's settings: prompt lookup, then the demo model
    // drafting for itself (it reads no images, so after this conversation's picture its drafts
    // are mostly wrong); the stats say how drafts fared, and the replies are what plain
    // decoding gives (the engine and chat tests hold them to it).
    for (const [option, pattern, count] of [
      ['option[value="lookup"]', /lookup: \d+% accepted \(\d+\/\d+\)/, 4],
      ['option[value^="draft:"]', /draft: \d+% accepted \(\d+\/[1-9]\d*\)/, 5],
    ]) {
      await (await s.find('[data-testid="settings-button"]')).click();
      await (await s.waitForElement('[data-testid="speculation"]')).click();
      await (await s.find(`[data-testid="speculation"] ${option}`)).click();
      await (await s.find('[data-testid="settings-save"]')).click();
      await s.waitFor("the settings panel to close", async () => (await s.findAll('[data-testid="speculation"]')).length === 0);
      await send(s, "Tell me more, tell me more.");
      const v = await waitForReply(s, count);
      assert.equal(last(v, "assistant").state, "complete");
      assert.match(last(v, "assistant").stats, pattern);
    }
    await shot(s, "speculative-reply");
    // The KV cache, chosen in the chat's settings (each choice priced for the demo model): the
    // reply runs on 4-bit keys and values, and its stats say so.
    await (await s.find('[data-testid="settings-button"]')).click();
    await s.waitForElement('[data-testid="kv-cache"]');
    const kvOptions = await s.execute(`return [...document.querySelectorAll('[data-testid="kv-cache"] option')].map((o) => o.textContent);`);
    assert.ok(kvOptions.length === 4 && kvOptions.every((o) => / per 1,000 tokens$/.test(o)), JSON.stringify(kvOptions));
    await (await s.find('[data-testid="kv-cache"]')).click();
    await (await s.find('[data-testid="kv-cache"] option[value="affine4"]')).click();
    await shot(s, "kv-cache-settings");
    await (await s.find('[data-testid="settings-save"]')).click();
    await s.waitFor("the settings panel to close", async () => (await s.findAll('[data-testid="kv-cache"]')).length === 0);
    await send(s, "And a short one on 4-bit keys.");
    const kv = await waitForReply(s, 6);
    assert.equal(last(kv, "assistant").state, "complete");
    assert.match(last(kv, "assistant").stats, /KV \d+(\.\d)? [KM]B 4-bit/);
    await shot(s, "kv-4bit-reply");

    // The model library downloads a model from the hub (a local stand-in, see run.sh) with a
    // progress bar seen moving; the model joins the library, loads and chats.
    await (await s.find('[data-testid="models-button"]')).click();
    // The recommended models, each with its memory-fit badge, before any network access.
    const catalog = await s.waitFor("the catalog with fit badges", async () => {
      const rows = await s.execute(`return [...document.querySelectorAll('[data-testid="catalog-item"]')]
        .map((r) => ({ repo: r.dataset.repo, fit: r.querySelector('[data-testid="fit-badge"]')?.dataset.fit ?? null }));`);
      return rows.length >= 5 && rows.every((r) => r.fit) ? rows : null;
    });
    assert.ok(catalog.some((r) => r.repo.includes("gemma-4-e4b")), JSON.stringify(catalog));
    await shot(s, "library-catalog");
    await (await s.waitForElement('[data-testid="library-search-input"]')).type("tiny-demo");
    await (await s.find('[data-testid="library-search-button"]')).click();
    const row = '[data-testid="catalog-item"][data-repo="quince-test/tiny-demo"]';
    await (await s.waitForElement(`${row} [data-testid="download-button"]`)).click();
    const moving = await s.waitFor("the download's progress bar to move", async () => {
      const p = await s.execute(`
        const bar = document.querySelector('${row} [data-testid="download-progress"]');
        const status = document.querySelector('${row} [data-testid="download-status"]')?.innerText ?? '';
        return bar ? { done: Number(bar.dataset.done), total: Number(bar.dataset.total), status } : null;`);
      return p && p.done > p.total / 10 && p.done < p.total / 2 && / of /.test(p.status) ? p : null;
    }, 60000, 50);
    console.log(`  download at ${moving.done} of ${moving.total} bytes: ${moving.status}`);
    await shot(s, "download-progress");
    await s.waitFor("the download to finish", async () =>
      (await s.execute(`return document.querySelector('${row}')?.dataset.state ?? null`)) === "done", 120000);
    const downloaded = await s.waitForElement(
      '[data-testid="model-item"][data-path*="models--quince-test--tiny-demo"] button.model-main');
    await shot(s, "downloaded");
    await downloaded.click();
    await s.waitFor("the downloaded model to load", async () => /tiny-demo/.test((await view(s)).model ?? ""), 60000);
    await (await s.find('[data-testid="new-chat"]')).click();
    await s.waitForElement('[data-testid="empty-state"]');
    await setMaxTokens(s, 16);
    await send(s, "Hello from a downloaded model.");
    const chatted = await waitForReply(s, 1);
    assert.equal(last(chatted, "assistant").state, "complete");
    await shot(s, "downloaded-model-chat");

    // Two conversations reply at the same time (the engine decodes both in one batch): a long
    // reply streams in a new chat while the previous chat asks and gets a short one; the
    // sidebar marks each chat that is replying. The downloaded model is the untrained demo,
    // whose replies run to their token limit.
    const shortChat = (await view(s)).conversations.length;
    await (await s.find('[data-testid="new-chat"]')).click();
    await s.waitForElement('[data-testid="empty-state"]');
    await setMaxTokens(s, 4000);
    await send(s, "Tell me a very long story.");
    await s.waitFor("the long reply to stream", async () => {
      const v = await view(s);
      return v.streaming && last(v, "assistant")?.text.length > 0;
    }, 60000, 20);
    const titles = `[...document.querySelectorAll('[data-testid="conversation-item"]')]
      .map((c) => ({ title: c.querySelector('[data-testid="conversation-title"]')?.textContent ?? '',
                     replying: c.dataset.replying === 'true' }))`;
    const replying = () => s.execute(`return ${titles}.filter((c) => c.replying).map((c) => c.title);`);
    const LONG = "Tell me a very long story.";
    const SHORT = "Hello from a downloaded model.";
    assert.deepEqual(await replying(), [LONG]);
    const chat = async (title) => {
      const at = await s.execute(`return ${titles}.findIndex((c) => c.title === arguments[0]);`, title);
      if (at < 0) throw new Error(`no chat titled ${title}: ${JSON.stringify(await s.execute(`return ${titles};`))}`);
      return (await s.findAll('[data-testid="conversation-item"]'))[at];
    };
    assert.equal((await s.findAll('[data-testid="conversation-item"]')).length, shortChat + 1);
    await (await chat(SHORT)).click();
    await waitForView(s, "the previous chat", (v) => v.messages[0]?.text === SHORT && !v.streaming);
    await send(s, "And a short one?");
    const both = await s.waitFor("a reply in the second chat while the first streams", async () => {
      const v = await view(s);
      const reply = last(v, "assistant");
      return v.messages.length === 4 && v.streaming && reply.text.length > 0 ? v : null;
    }, 60000, 20);
    assert.deepEqual((await replying()).sort(), [LONG, SHORT].sort(), JSON.stringify(both));
    await shot(s, "two-chats-replying");
    const short = await waitForReply(s, 2);
    assert.equal(last(short, "assistant").state, "complete");
    assert.deepEqual(await replying(), [LONG], "the long reply still streams");
    // A reply on another KV cache choice (4-bit keys and values) joins the batch beside the
    // long one at once, its rows kept in their own storage: it streams, it is not put in line.
    await (await s.find('[data-testid="settings-button"]')).click();
    await s.waitForElement('[data-testid="kv-cache"]');
    await (await s.find('[data-testid="kv-cache"]')).click();
    await (await s.find('[data-testid="kv-cache"] option[value="affine4"]')).click();
    await (await s.find('[data-testid="settings-save"]')).click();
    await s.waitFor("the settings panel to close", async () => (await s.findAll('[data-testid="kv-cache"]')).length === 0);
    await send(s, "One more, on 4-bit keys.");
    const beside = await waitForView(s, "the 4-bit reply streaming beside the long one", (v) => {
      const reply = last(v, "assistant");
      return v.messages.length === 6 && v.streaming && reply.text.length > 0 ? v : null;
    }, 60000, 20);
    assert.equal(beside.queued, null, "it never waits in line");
    assert.deepEqual((await replying()).sort(), [LONG, SHORT].sort(), JSON.stringify(beside));
    await shot(s, "4-bit-reply-beside-long");
    const ran = await waitForReply(s, 3);
    assert.equal(last(ran, "assistant").state, "complete", JSON.stringify(ran));
    assert.ok(last(ran, "assistant").text.length > 0 && ran.queued === null, JSON.stringify(ran));
    assert.match(last(ran, "assistant").stats, /4-bit/);
    assert.deepEqual(await replying(), [LONG], "the long reply still streams");
    await (await chat(LONG)).click();
    await s.waitFor("the long reply, still streaming", async () => {
      const v = await view(s);
      return v.messages[0]?.text === LONG && v.streaming;
    });
    await (await s.find('[data-testid="stop-button"]')).click();
    const long = await waitForReply(s, 1, 30000);
    assert.equal(last(long, "assistant").state, "stopped");
    assert.deepEqual(await replying(), []);
    await shot(s, "long-reply-stopped");

    // The local server: the switch in the model library serves the loaded model, curl gets a
    // reply from it while the app runs (and 401 without the key), and the switch stops it.
    await (await s.find('[data-testid="models-button"]')).click();
    await (await s.waitForElement('[data-testid="local-server"] summary')).click();
    await (await s.waitForElement('[data-testid="local-server-enabled"]')).click();
    const server = await s.waitFor("the server's URL and key", async () => s.execute(`
      const url = document.querySelector('[data-testid="local-server-url"]')?.innerText;
      const key = document.querySelector('[data-testid="local-server-key"]')?.innerText;
      return url && key ? { url, key } : null;`));
    await s.execute(`document.querySelector('[data-testid="local-server-key"]').scrollIntoView()`);
    await shot(s, "local-server-on");
    const curl = (path, ...args) => {
      const out = execFileSync("curl", ["-s", "-w", "\n%{http_code}", `${server.url}${path}`, ...args],
        { encoding: "utf8" });
      const at = out.lastIndexOf("\n");
      return { body: out.slice(0, at), code: out.slice(at + 1) };
    };
    const asked = curl("/chat/completions", "-H", `Authorization: Bearer ${server.key}`,
      "-H", "Content-Type: application/json",
      "-d", JSON.stringify({ messages: [{ role: "user", content: "Hello over HTTP." }], max_tokens: 4 }));
    assert.equal(asked.code, "200", asked.body);
    const answer = JSON.parse(asked.body);
    assert.equal(typeof answer.choices[0].message.content, "string", asked.body);
    assert.ok(answer.usage.completion_tokens > 0, asked.body);
    assert.equal(curl("/models").code, "401");
    await (await s.find('[data-testid="local-server-enabled"]')).click();
    await s.waitFor("the server to stop", async () =>
      s.execute(`return document.querySelector('[data-testid="local-server-url"]') === null`));
    const refused = spawnSync("curl", ["-s", "-o", "/dev/null", `${server.url}/models`]);
    assert.notEqual(refused.status, 0, "nothing listens once the switch is off");
    await shot(s, "local-server-off");
  } finally {
    await s.quit();
  }
  console.log(`e2e: passed (${step} screenshots in ${SHOTS})`);
}

main().catch((error) => {
  console.error(`e2e: FAILED: ${error.stack ?? error}`);
  process.exit(1);
});

// A small W3C WebDriver client (Node 20's fetch, no dependencies) for tauri-driver.

const W3C_ELEMENT = "element-6066-11e4-a52e-4f735466cecf";
export const Keys = { ENTER: "\uE007", ESCAPE: "\uE00C" };

// tauri-driver forwards each request to WebKitWebDriver over a pooled keep-alive connection;
// when that connection closes under a request, tauri-driver drops ours without an answer
// ("Error serving connection" in its log). The usual cause is a pooled connection closed
// before the request went out, so it is sent again, a few times, and each retry is printed.
const TRANSPORT_RETRIES = 3;

async function call(base, method, path, body) {
  let response;
  for (let attempt = 0; ; attempt++) {
    try {
      response = await fetch(base + path, {
        method,
        headers: { "content-type": "application/json" },
        body: body === undefined ? undefined : JSON.stringify(body),
      });
      break;
    } catch (error) {
      const cause = error.cause?.code ?? error.cause?.message ?? error.message;
      if (attempt >= TRANSPORT_RETRIES) throw new Error(`${method} ${path}: no answer from the driver (${cause})`);
      console.log(`  retrying ${method} ${path}: no answer from the driver (${cause})`);
      await new Promise((r) => setTimeout(r, 250));
    }
  }
  const json = await response.json().catch(() => ({}));
  if (!response.ok || (json.value && json.value.error)) {
    const v = json.value ?? {};
    throw new Error(`${method} ${path}: ${v.error ?? response.status} ${v.message ?? ""}`);
  }
  return json.value;
}

export class Session {
  constructor(base, id) {
    this.base = base;
    this.id = id;
  }

  static async start(base, application) {
    const value = await call(base, "POST", "/session", {
      capabilities: { alwaysMatch: { "tauri:options": { application } } },
    });
    return new Session(base, value.sessionId);
  }

  cmd(method, path, body) {
    return call(this.base, method, `/session/${this.id}${path}`, body);
  }

  async quit() {
    await this.cmd("DELETE", "");
  }

  /** Runs `script` (a function body) in the page with `args`. */
  execute(script, ...args) {
    return this.cmd("POST", "/execute/sync", { script, args });
  }

  async find(css) {
    const value = await this.cmd("POST", "/element", { using: "css selector", value: css });
    if (!value || !value[W3C_ELEMENT]) throw new Error(`no element ${css}: ${JSON.stringify(value)}`);
    return new Element(this, value[W3C_ELEMENT]);
  }

  async findAll(css) {
    const values = await this.cmd("POST", "/elements", { using: "css selector", value: css });
    return values.map((v) => new Element(this, v[W3C_ELEMENT]));
  }

  /** Polls `check` (async, returns a truthy value when done) until it passes or times out. */
  async waitFor(what, check, timeoutMs = 30000, everyMs = 100) {
    const start = Date.now();
    let last;
    for (;;) {
      try {
        const value = await check();
        if (value) return value;
      } catch (error) {
        last = error;
      }
      if (Date.now() - start > timeoutMs) {
        throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}${last ? `: ${last.message}` : ""}`);
      }
      await new Promise((r) => setTimeout(r, everyMs));
    }
  }

  /** The element for `css` once it exists. */
  waitForElement(css, timeoutMs) {
    return this.waitFor(css, () => this.find(css), timeoutMs);
  }

  async screenshot() {
    return Buffer.from(await this.cmd("GET", "/screenshot"), "base64");
  }
}

export class Element {
  constructor(session, id) {
    this.session = session;
    this.id = id;
  }
  cmd(method, path, body) {
    return this.session.cmd(method, `/element/${this.id}${path}`, body);
  }
  click() {
    return this.cmd("POST", "/click", {});
  }
  clear() {
    return this.cmd("POST", "/clear", {});
  }
  type(text) {
    return this.cmd("POST", "/value", { text });
  }
  text() {
    return this.cmd("GET", "/text");
  }
  attribute(name) {
    return this.cmd("GET", `/attribute/${name}`);
  }
}

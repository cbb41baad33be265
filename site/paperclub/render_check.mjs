// Parse math with the site's KaTeX and diagrams with its mermaid, as the browser will, and say
// which fail and why (paperclub.lint runs this with node; nothing is drawn).
//   node render_check.mjs <node_modules folder>   < [{"kind": "math"|"mermaid", "text": ..., "display": bool}]
//   stdout: [null | "error message", ...], one entry per item
import { createRequire } from "node:module";
import { readFileSync } from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const modules = process.argv[2];
const require = createRequire(path.join(modules, "noop.js"));
const katex = require("katex");
const items = JSON.parse(readFileSync(0, "utf8"));
let mermaid = null;
if (items.some((i) => i.kind === "mermaid")) {
  // outside a browser DOMPurify has no DOM to work on (and no addHook); parsing needs no sanitising
  const purifyUrl = pathToFileURL(require.resolve("dompurify").replace(/purify\.cjs\.js$/, "purify.es.mjs")).href;
  const purify = (await import(purifyUrl)).default;
  for (const name of ["addHook", "removeHook", "removeHooks", "removeAllHooks", "setConfig"]) {
    purify[name] = () => {};
  }
  purify.sanitize = (text) => text;
  const url = pathToFileURL(path.join(modules, "mermaid", "dist", "mermaid.core.mjs")).href;
  mermaid = (await import(url)).default;
  mermaid.initialize({ startOnLoad: false });
}
const out = [];
for (const item of items) {
  try {
    if (item.kind === "math") {
      katex.renderToString(item.text, { displayMode: !!item.display, throwOnError: true, strict: "ignore" });
    } else {
      await mermaid.parse(item.text);
    }
    out.push(null);
  } catch (e) {
    out.push(String((e && e.message) || e));
  }
}
process.stdout.write(JSON.stringify(out));

// nexfort status badges for ComfyUI's front end.
//
// Shows, on our nodes, what the engine's counters say (GET /nexfort/stats, served by
// nodes/routes.py): compile state (compiling / compiling in background / compiled / fell back) and cache hits for the
// Compile nodes, entries and hits for the Cache Manager. The same counters feed the Cache Manager
// and the tests.
//
// Refreshes when a prompt starts/finishes or a node finishes, polls while a prompt runs (to catch
// "compiling") or a background compile runs, and once when our nodes appear. A missing route or a server error just hides the
// badges: nothing throws into the UI.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const EXTENSION = "nexfort.status";
const STATS_ROUTE = "/nexfort/stats";
const POLL_MS = 2000;
const NODE_TYPES = new Set(["NexfortCompileModel", "NexfortCompileVAE", "NexfortCompileControlNet", "NexfortCacheManager"]);

// Badge look per state: [label, background].
const LOOK = {
  compiling: ["compiling…", "#9a6b00"],
  // "background": true - a child process compiles while the model runs eager
  background: ["compiling in background…", "#6a4c93"],
  compiled: ["compiled", "#2e7d32"],
  fallback: ["fell back", "#b3261e"],
  pending: ["pending", "#546e7a"],
  idle: ["not run yet", "#546e7a"],
  cache: ["cache", "#1f5fa8"],
};
// When one node produced several models, show the most urgent state.
const PRIORITY = ["compiling", "background", "fallback", "pending", "compiled"];

let stats = null; // last good /nexfort/stats body, or null when unavailable
let inflight = null;
let pollTimer = null;
// true while polling only because a background compile runs (no prompt running)
let backgroundPoll = false;

function classOf(node) {
  return node?.comfyClass ?? node?.constructor?.comfyClass ?? node?.type;
}

function isOurs(node) {
  return NODE_TYPES.has(classOf(node));
}

function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

/** {state, text, color} for a node from the last stats, or null (no badge). */
export function statusFor(node, body = stats) {
  if (!body || typeof body !== "object" || !body.engine) return null;
  if (classOf(node) === "NexfortCacheManager") {
    const entries = Array.isArray(body.cache) ? body.cache : [];
    const hits = entries.reduce((n, e) => n + (Number(e?.hits) || 0), 0);
    return {
      state: "cache",
      text: `nexfort cache: ${entries.length === 1 ? "1 entry" : `${entries.length} entries`} · ${plural(hits, "hit")}`,
      color: LOOK.cache[1],
    };
  }
  const id = String(node.id);
  const models = Object.values(body.engine.models ?? {}).filter(
    (m) => Array.isArray(m?.node_ids) && m.node_ids.map(String).includes(id),
  );
  if (models.length === 0) {
    return { state: "idle", text: `nexfort: ${LOOK.idle[0]}`, color: LOOK.idle[1] };
  }
  const states = models.map((m) => m.state);
  const state = PRIORITY.find((s) => states.includes(s)) ?? "pending";
  const sum = (k) => models.reduce((n, m) => n + (Number(m?.[k]) || 0), 0);
  const parts = [LOOK[state]?.[0] ?? String(state)];
  const fallbacks = sum("fallbacks");
  if (state === "fallback" || fallbacks > 0) parts.push(plural(fallbacks, "fallback"));
  parts.push(plural(sum("cache_hits"), "cache hit"));
  const recompiles = sum("recompiles");
  if (recompiles > 0) parts.push(plural(recompiles, "recompile"));
  // CUDA graphs not replayed: the compiled model ran kernel by kernel (slower, still correct)
  const skips = sum("cudagraph_skips");
  if (skips > 0) parts.push(plural(skips, "CUDA-graph skip"));
  // the traced graph broke (a patch Dynamo cannot trace, usually): compiled in pieces
  const breaks = sum("graph_breaks");
  if (breaks > 0) parts.push(plural(breaks, "graph break"));
  return { state, text: `nexfort: ${parts.join(" · ")}`, color: LOOK[state]?.[1] ?? LOOK.pending[1] };
}

function ourNodes() {
  const graph = app.graph;
  const nodes = graph?.nodes ?? graph?._nodes ?? [];
  return nodes.filter(isOurs);
}

function redraw() {
  for (const node of ourNodes()) node.nexfortStatus = statusFor(node);
  app.graph?.setDirtyCanvas?.(true, true);
}

/** Fetch /nexfort/stats once (concurrent callers share the request) and redraw. */
export function refresh() {
  if (inflight) return inflight;
  inflight = (async () => {
    try {
      const res = await api.fetchApi(STATS_ROUTE, { cache: "no-store" });
      stats = res.ok ? await res.json() : null;
    } catch {
      stats = null;
    } finally {
      inflight = null;
    }
    try {
      redraw();
    } catch (e) {
      console.debug(`[${EXTENSION}] redraw failed`, e);
    }
    followBackground();
    return stats;
  })();
  return inflight;
}

function startPolling() {
  backgroundPoll = false;
  if (pollTimer === null) pollTimer = setInterval(refresh, POLL_MS);
  refresh();
}

function stopPolling() {
  if (pollTimer !== null) clearInterval(pollTimer);
  pollTimer = null;
  refresh();
}

/** Keep polling after a prompt while a child process still compiles, until it is done. */
function followBackground() {
  const models = Object.values(stats?.engine?.models ?? {});
  const running = models.some((m) => m?.state === "background");
  if (running && pollTimer === null) {
    backgroundPoll = true;
    pollTimer = setInterval(refresh, POLL_MS);
  } else if (!running && backgroundPoll) {
    backgroundPoll = false;
    clearInterval(pollTimer);
    pollTimer = null;
  }
}

function makeBadge(node) {
  const s = (node.nexfortStatus = statusFor(node));
  const Badge = globalThis.LGraphBadge;
  if (!Badge) return null;
  return new Badge({ text: s?.text ?? "", fgColor: "#ffffff", bgColor: s?.color ?? LOOK.pending[1] });
}

function attach(node) {
  if (!isOurs(node) || node.__nexfortAttached) return;
  node.__nexfortAttached = true;
  node.nexfortStatus = statusFor(node);
  if (globalThis.LGraphBadge && Array.isArray(node.badges)) {
    // Drawn by the canvas next to ComfyUI's own badges (node id, source).
    node.badges.push(() => makeBadge(node) ?? new globalThis.LGraphBadge({ text: "" }));
  } else {
    // Older front ends without badges: draw the text ourselves under the title.
    const onDrawForeground = node.onDrawForeground;
    node.onDrawForeground = function (ctx, ...rest) {
      const r = onDrawForeground?.apply(this, [ctx, ...rest]);
      const s = (this.nexfortStatus = statusFor(this));
      if (s?.text && !this.flags?.collapsed) {
        ctx.save();
        ctx.font = "11px sans-serif";
        const w = ctx.measureText(s.text).width + 10;
        ctx.fillStyle = s.color;
        ctx.fillRect(this.size[0] - w - 4, 4, w, 16);
        ctx.fillStyle = "#ffffff";
        ctx.textBaseline = "middle";
        ctx.fillText(s.text, this.size[0] - w + 1, 12);
        ctx.restore();
      }
      return r;
    };
  }
  queueMicrotask(refresh);
}

app.registerExtension({
  name: EXTENSION,
  async setup() {
    api.addEventListener("execution_start", startPolling);
    for (const ev of ["execution_success", "execution_error", "execution_interrupted"]) {
      api.addEventListener(ev, stopPolling);
    }
    api.addEventListener("executed", () => refresh());
    api.addEventListener("executing", ({ detail }) => {
      // detail === null: the prompt is done (older servers send no execution_success).
      if (detail === null || detail === undefined) stopPolling();
      else refresh();
    });
    api.addEventListener("reconnected", () => refresh());
    for (const node of ourNodes()) attach(node);
    await refresh();
  },
  nodeCreated(node) {
    attach(node);
  },
  loadedGraphNode(node) {
    attach(node);
  },
});

// For tests and debugging in the browser console.
globalThis.nexfortStatus = { refresh, statusFor, stats: () => stats, extension: EXTENSION };

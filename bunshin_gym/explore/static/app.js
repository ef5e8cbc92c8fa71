// bunshin explore: plain JavaScript, no build step, nothing from the internet.
"use strict";

const $ = (sel, el = document) => el.querySelector(sel);
const el = (tag, attrs = {}, ...kids) => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null) e.setAttribute(k, v);
  }
  for (const k of kids) if (k !== null && k !== undefined) e.append(k);
  return e;
};
const SVG = "http://www.w3.org/2000/svg";
const svg = (tag, attrs = {}) => {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
};
async function api(path) {
  const r = await fetch(path);
  if (!r.ok) throw new Error(`${path}: ${r.status} ${(await r.text()).slice(0, 300)}`);
  return r.json();
}
const fmt = (v, d = 2) => (v === null || v === undefined ? "–" : Number(v).toFixed(d));
const mb = (b) => (b === null || b === undefined ? "–" : (b / 1048576).toFixed(1) + " MB");
const rewardColor = (r) => (r === null || r === undefined ? "#9ca3af" : `hsl(${Math.round(120 * Math.max(0, Math.min(1, r)))},65%,38%)`);

const state = { run: null, page: 0, limit: 50, group: null, tree: null, node: null };

// runs --------------------------------------------------------------------------------------
async function loadRuns() {
  const runs = await api("/api/runs");
  const sel = $("#run");
  sel.innerHTML = "";
  for (const r of runs) sel.append(el("option", { value: r.name, text: r.name }));
  const wanted = new URLSearchParams(location.hash.slice(1)).get("run");
  if (wanted && runs.some((r) => r.name === wanted)) sel.value = wanted;
  if (runs.length) await openRun(sel.value);
  else $("#tree-head").textContent = "no runs found";
}

async function openRun(name) {
  state.run = name;
  state.page = 0;
  history.replaceState(null, "", "#run=" + encodeURIComponent(name));
  for (const sel of [$("#f-epoch"), $("#f-task")]) { sel.innerHTML = ""; sel.append(el("option", { value: "", text: "all" })); }
  $("#f-min").value = $("#f-max").value = "";
  // the run's filters and its first page of groups are asked for together
  const firstPage = loadGroups(true);
  const info = await api(`/api/runs/${encodeURIComponent(name)}`);
  $("#run-info").textContent = `${info.groups} groups, ${info.steps} steps` + (info.bad_lines ? `, ${info.bad_lines} unreadable lines` : "");
  const fill = (sel, values) => {
    sel.innerHTML = "";
    sel.append(el("option", { value: "", text: "all" }));
    for (const v of values) sel.append(el("option", { value: v, text: v || "(none)" }));
  };
  fill($("#f-epoch"), info.epochs);
  fill($("#f-task"), info.tasks);
  await firstPage;
  if (!$("#curves").hidden) loadCurves();
}

function filterQuery() {
  const q = new URLSearchParams({ offset: state.page * state.limit, limit: state.limit });
  if ($("#f-epoch").value) q.set("epoch", $("#f-epoch").value);
  if ($("#f-task").value) q.set("task", $("#f-task").value);
  if ($("#f-min").value !== "") q.set("min_reward", $("#f-min").value);
  if ($("#f-max").value !== "") q.set("max_reward", $("#f-max").value);
  return q;
}

async function loadGroups(openFirst) {
  const page = await api(`/api/runs/${encodeURIComponent(state.run)}/groups?${filterQuery()}`);
  const list = $("#group-list");
  list.innerHTML = "";
  for (const g of page.items) {
    const chips = g.rewards.map((r, i) => el("span", { class: "chip", style: `background:${rewardColor(r)}`, title: `member ${i}`, text: fmt(r, 1) }));
    const li = el("li", { "data-group": g.group, onclick: () => openGroup(g.group) },
      el("div", {}, el("span", { class: "g-task", text: g.task }), " ", el("span", { class: "g-epoch", text: g.epoch })),
      el("div", {}, ...chips, el("span", { class: "g-epoch", text: ` ${g.steps} steps, ${g.served.cache} hits` })));
    list.append(li);
  }
  const pages = Math.max(1, Math.ceil(page.total / state.limit));
  $("#group-count").textContent = `${page.total} groups`;
  $("#page-info").textContent = `page ${state.page + 1} / ${pages}`;
  $("#prev").disabled = state.page === 0;
  $("#next").disabled = state.page + 1 >= pages;
  if (openFirst && page.items.length) await openGroup(page.items[0].group);
  else if (!page.items.length) { $("#tree").innerHTML = ""; $("#tree-head").textContent = "no group matches"; $("#step").innerHTML = ""; }
}

// the tree -----------------------------------------------------------------------------------
const COL = 260, ROW = 150, W = 230;

async function openGroup(gid) {
  state.group = gid;
  for (const li of document.querySelectorAll("#group-list li")) li.classList.toggle("selected", li.dataset.group === gid);
  const t = await api(`/api/runs/${encodeURIComponent(state.run)}/groups/${gid}/tree`);
  if (state.group !== gid) return;  // another group was opened meanwhile: its tree is drawn
  state.tree = t;
  const g = t.group;
  const head = $("#tree-head");
  head.innerHTML = "";
  head.append(el("b", { text: g.task }), el("span", { class: "g-epoch", text: `${g.epoch}, group ${g.group}  ` }),
    el("span", { id: "tree-nodes", "data-count": t.nodes, text: `${t.nodes} nodes, ` }),
    el("span", { id: "tree-hits", "data-count": t.hits, text: `${t.hits} cache hits, ` }),
    el("span", { text: `${t.served.speculation || 0} from speculation, ${t.served.executed || 0} executed; ${t.divergences.length} divergence points; rewards ` }),
    ...t.root.rewards.map((r, i) => el("span", { class: "chip", style: `background:${rewardColor(r)}`, title: `member ${i}`, text: `m${i} ${fmt(r, 1)}` })));
  drawTree(t);
  $("#tree").dataset.group = gid;  // which group the drawn tree is (the list's selection comes first)
  $("#step").innerHTML = "";
}

function drawTree(t) {
  const box = $("#tree");
  box.innerHTML = "";
  let row = 0, maxDepth = 0;
  const placed = [];
  const place = (n, depth) => {
    maxDepth = Math.max(maxDepth, depth);
    if (!n.children.length) n._row = row++;
    else {
      for (const c of n.children) place(c, depth + 1);
      n._row = (n.children[0]._row + n.children[n.children.length - 1]._row) / 2;
    }
    n._x = 10 + depth * COL;
    n._y = 10 + n._row * ROW;
    placed.push(n);
  };
  place(t.root, 0);
  const width = 20 + (maxDepth + 1) * COL, height = 20 + Math.max(1, row) * ROW;
  box.style.width = width + "px";
  box.style.height = height + "px";
  const edges = svg("svg", { class: "edges", width, height });
  for (const n of placed) for (const c of n.children) {
    const x1 = n._x + W, y1 = n._y + 30, x2 = c._x, y2 = c._y + 30, mx = (x1 + x2) / 2;
    edges.append(svg("path", { d: `M${x1},${y1} C${mx},${y1} ${mx},${y2} ${x2},${y2}`, fill: "none", stroke: "#9aa5b8", "stroke-width": Math.min(6, 1 + c.members.length) }));
  }
  box.append(edges);
  for (const n of placed) box.append(nodeCard(n, t));
}

function obsPreview(obs) {
  if (obs && obs.thumb) return el("img", { class: "thumb", src: media(obs.thumb), loading: "lazy", alt: "screenshot" });
  const text = obs && obs.text ? (obs.text.output ?? obs.text.terminal ?? obs.text.url ?? Object.values(obs.text)[0]) : "";
  return text ? el("pre", { class: "obs", text: text.slice(-240) }) : null;
}

function nodeCard(n, t) {
  const root = n.id === "root";
  const badges = Object.entries(n.served).filter(([, v]) => v).map(([k, v]) => el("span", { class: `badge b-${k}`, title: k, text: `${k === "executed" ? "exec" : k === "speculation" ? "spec" : k} ${v}` }));
  const ends = (n.ends || []).map((e) => el("span", { class: "chip", style: `background:${rewardColor(e.reward)}`, text: `m${e.member} ${fmt(e.reward, 1)}` }));
  const card = el("div", {
    class: "node" + (root ? " root" : "") + (n.children.length > 1 ? " diverges" : ""),
    style: `left:${n._x}px;top:${n._y}px`, "data-node": n.id, "data-cache": n.served.cache || 0,
    "data-executed": n.served.executed || 0, "data-speculation": n.served.speculation || 0,
    title: root ? t.root.instruction : n.action, onclick: () => selectNode(n),
  },
    el("div", { class: "act", text: root ? "start (set-up, forked)" : n.action }),
    el("div", { class: "meta" }, ...badges, root ? `${n.members.length} members` : `${fmt(n.duration, 3)} s · m${n.members.join(",m")}`),
    obsPreview(n.obs),
    ends.length ? el("div", { class: "ends" }, "ends: ", ...ends) : null,
    n.error ? el("div", { class: "error", text: n.error }) : null);
  return card;
}

function media(rel) {
  return `/api/runs/${encodeURIComponent(state.run)}/${rel.replace(/^media\//, "media/")}`;
}

async function selectNode(n) {
  state.node = n;
  for (const c of document.querySelectorAll(".node")) c.classList.toggle("selected", c.dataset.node === n.id);
  const view = $("#step");
  if (n.id === "root") {
    view.innerHTML = "";
    view.append(el("h3", { text: "Start of the group" }), el("p", { text: n.instruction }), obsView(n.obs, n.obs && n.obs.text, []));
    return;
  }
  await showStep(n, n.steps[0][0]);
}

async function showStep(n, member) {
  const depth = n.steps.find((s) => s[0] === member)[1];
  const s = await api(`/api/runs/${encodeURIComponent(state.run)}/groups/${state.group}/steps/${member}/${depth}`);
  const view = $("#step");
  view.innerHTML = "";
  const tabs = el("div", { class: "member-tabs" }, "member: ", ...n.steps.map(([m]) =>
    el("button", { class: m === member ? "active" : "", text: `m${m}`, onclick: () => showStep(n, m) })));
  view.append(
    el("h3", { id: "step-title", text: `member ${member}, step ${depth}` }), tabs,
    el("pre", { id: "step-action", text: s.action }),
    el("div", { class: "kv" },
      el("span", {}, el("span", { class: `badge b-${s.served}`, text: s.served })),
      el("span", { text: `tool ${fmt(s.duration, 3)} s` }),
      s.fork_s !== null && s.fork_s !== undefined ? el("span", { text: `ran ${fmt(s.fork_s, 3)} s in a speculative fork` }) : null,
      el("span", { text: `policy ${fmt(s.think_s, 3)} s` }),
      el("span", { text: `reward ${fmt(s.reward, 2)}` }),
      el("span", { text: s.terminated ? "terminated" : s.truncated ? "truncated" : "" }),
      s.episode ? el("span", { class: "g-epoch", text: `episode ${s.episode}` }) : null,
      s.error ? el("span", { class: "error", text: s.error }) : null));
  // a web action's element with a recorded box: drawn where it was, on the screenshot the
  // action was chosen on (the page before it; the result below may be another page)
  const placed = (s.marks || []).filter((m) => m.kind === "element" && m.x !== undefined);
  const onBefore = placed.length > 0 && !!s.before && !!(s.before.shot || s.before.thumb);
  if (onBefore) {
    view.append(el("h4", { class: "shot-title", text: "the action, on the page it was chosen on" }),
      shotView(s.before, placed, "step-before"),
      el("h4", { class: "shot-title", text: "the result" }));
  }
  // on the result's screenshot an element is named, never placed: its point is the page before's
  const rest = (s.marks || []).filter((m) => !(onBefore && placed.includes(m)))
    .map((m) => (m.kind === "element" ? { ...m, x: undefined, y: undefined } : m));
  view.append(obsView(s.obs, s.text, rest));
}

function elementLabel(m) {
  return `${m.label} [${m.element}]` + (m.line ? ` ${m.line}` : "");
}

// a screenshot with the action's marks drawn on it; ids `${id}-shot` and `${id}-marks`
function shotView(obs, marks, id) {
  const [w, h] = obs.size || [1, 1];
  const wrap = el("div", { class: "shot-wrap" }, el("img", { id: `${id}-shot`, src: media(obs.shot || obs.thumb), alt: "screenshot" }));
  const over = svg("svg", { viewBox: `0 0 ${w} ${h}`, preserveAspectRatio: "none", id: `${id}-marks` });
  const font = Math.max(14, w / 70);
  let last = null;
  for (const m of marks || []) {
    if (m.x !== undefined && m.y !== undefined) {
      last = m;
      if (m.box) over.append(svg("rect", { x: m.box.x, y: m.box.y, width: m.box.width, height: m.box.height, fill: "none", stroke: "#ef4444", "stroke-width": 2, "stroke-dasharray": "6 3", class: "mark-box" }));
      over.append(svg("circle", { cx: m.x, cy: m.y, r: Math.max(8, w / 90), fill: "rgba(239,68,68,.25)", stroke: "#ef4444", "stroke-width": Math.max(2, w / 600), class: "mark-point" }));
      over.append(svg("line", { x1: m.x - w / 50, y1: m.y, x2: m.x + w / 50, y2: m.y, stroke: "#ef4444", "stroke-width": 2 }));
      over.append(svg("line", { x1: m.x, y1: m.y - w / 50, x2: m.x, y2: m.y + w / 50, stroke: "#ef4444", "stroke-width": 2 }));
      // a label near the right edge goes to the left of its point
      const right = m.x > w * 0.7;
      const t = svg("text", { x: right ? m.x - w / 60 : m.x + w / 60, y: m.y - w / 80, fill: "#ef4444", stroke: "#fff", "stroke-width": 3, "paint-order": "stroke", "text-anchor": right ? "end" : "start", "font-size": font, "font-weight": "bold", class: m.kind === "element" ? "mark-element-at" : "mark-label" });
      t.textContent = (m.kind === "element" ? elementLabel(m) : m.label).slice(0, 120);
      over.append(t);
    }
  }
  let ty = Math.max(20, h / 30);
  // what has no point to draw at (typed text, keys; a web action's element without a box or
  // off the screenshot, scroll, page change): written as lines, below the last point or from the top left
  const LINES = { type: ["mark-text", "#1d4ed8"], key: ["mark-text", "#1d4ed8"], element: ["mark-element", "#b91c1c"],
    scroll: ["mark-scroll", "#7c3aed"], page: ["mark-page", "#047857"] };
  for (const m of marks || []) {
    if (!LINES[m.kind] || ((m.kind === "scroll" || m.kind === "element") && m.x !== undefined)) continue;
    const label = m.kind === "type" ? `type "${m.text}"` + (m.enter ? " ⏎" : "") : m.kind === "key" ? `${m.label} ${m.keys.join("+")}`
      : m.kind === "element" ? elementLabel(m) + (m.offscreen ? ` (${m.offscreen} the screenshot)` : "")
      : m.kind === "scroll" && m.direction ? `${m.label} ${m.direction === "up" ? "↑" : "↓"}` : m.label;
    const x = last ? Math.min(last.x, w * 0.7) + w / 60 : w / 60, y = last ? last.y + ty + w / 60 : ty;
    const [cls, color] = LINES[m.kind];
    const t = svg("text", { x, y, fill: color, stroke: "#fff", "stroke-width": 3, "paint-order": "stroke", "font-size": font, "font-weight": "bold", class: cls });
    t.textContent = label.slice(0, 120);
    over.append(t);
    ty += Math.max(18, w / 60);
  }
  wrap.append(over);
  return wrap;
}

function obsView(obs, text, marks) {
  const box = el("div", { id: "step-obs" });
  if (obs && (obs.shot || obs.thumb)) box.append(shotView(obs, marks, "step"));
  for (const [k, v] of Object.entries(text || {})) {
    if (!v) continue;
    box.append(el("details", { open: "" }, el("summary", { text: k === "accessibility_tree" ? "accessibility tree" : k }), el("pre", { class: `obs-${k}`, text: v })));
  }
  const values = obs && obs.values ? Object.entries(obs.values).map(([k, v]) => `${k} ${v}`).join(", ") : "";
  if (values) box.append(el("div", { class: "kv", text: values }));
  return box;
}

// curves -------------------------------------------------------------------------------------
const COLORS = ["#2563eb", "#16a34a", "#dc2626", "#9333ea", "#ea580c", "#0891b2"];

function lineChart(title, labels, series, opts = {}) {
  const Wc = 460, Hc = 230, L = 46, R = 10, T = 10, B = 30;
  const box = el("div", { class: "chart" }, el("h4", { text: title }));
  const s = svg("svg", { width: Wc, height: Hc });
  const all = series.flatMap((x) => x.values).filter((v) => v !== null && v !== undefined);
  let lo = opts.min ?? Math.min(...all), hi = opts.max ?? Math.max(...all);
  if (!all.length) { lo = 0; hi = 1; }
  if (hi === lo) { hi = lo + 1; }
  const n = labels.length;
  const X = (i) => L + (n <= 1 ? (Wc - L - R) / 2 : (i * (Wc - L - R)) / (n - 1));
  const Y = (v) => T + (Hc - T - B) * (1 - (v - lo) / (hi - lo));
  for (let k = 0; k <= 4; k++) {
    const v = lo + ((hi - lo) * k) / 4;
    s.append(svg("line", { x1: L, x2: Wc - R, y1: Y(v), y2: Y(v), stroke: "#eceff3" }));
    const t = svg("text", { x: L - 4, y: Y(v) + 4, "text-anchor": "end", "font-size": 10, fill: "#66708a" });
    t.textContent = Math.abs(hi - lo) < 5 ? v.toFixed(2) : v.toFixed(0);
    s.append(t);
  }
  const step = Math.max(1, Math.ceil(n / 10));
  labels.forEach((lab, i) => {
    if (i % step) return;
    const anchor = n > 1 && i === 0 ? "start" : n > 1 && i === n - 1 ? "end" : "middle";
    const t = svg("text", { x: X(i), y: Hc - 12, "text-anchor": anchor, "font-size": 10, fill: "#66708a" });
    t.textContent = String(lab).length > 12 ? String(lab).slice(0, 11) + "…" : lab;
    s.append(t);
  });
  const lines = series.map((ser, k) => {
    const g = svg("g", { "data-series": ser.name });
    const pts = ser.values.map((v, i) => (v === null || v === undefined ? null : [X(i), Y(v)]));
    let d = "", pen = false;  // a missing value lifts the pen
    for (const p of pts) { if (!p) { pen = false; continue; } d += (pen ? "L" : "M") + p[0] + "," + p[1]; pen = true; }
    g.append(svg("path", { d, fill: "none", stroke: ser.color || COLORS[k % COLORS.length], "stroke-width": 2, "stroke-dasharray": ser.dash || "" }));
    pts.forEach((p) => p && g.append(svg("circle", { cx: p[0], cy: p[1], r: 2.5, fill: ser.color || COLORS[k % COLORS.length] })));
    s.append(g);
    return g;
  });
  const cursor = svg("line", { y1: T, y2: Hc - B, stroke: "#94a3b8", visibility: "hidden" });
  s.append(cursor);
  const tip = el("div", { class: "tip", hidden: "" });
  s.addEventListener("mousemove", (ev) => {
    const rect = s.getBoundingClientRect();
    const x = ev.clientX - rect.left;
    const i = n <= 1 ? 0 : Math.max(0, Math.min(n - 1, Math.round(((x - L) / (Wc - L - R)) * (n - 1))));
    cursor.setAttribute("x1", X(i)); cursor.setAttribute("x2", X(i)); cursor.setAttribute("visibility", "visible");
    tip.hidden = false;
    tip.innerHTML = "";
    tip.append(el("div", { text: String(labels[i]) }));
    series.forEach((ser, k) => { if (!lines[k].hidden) tip.append(el("div", { text: `${ser.name}: ${fmt(ser.values[i], 3)}` })); });
    tip.style.left = Math.min(Wc - 150, X(i) + 10) + "px";
    tip.style.top = "30px";
  });
  s.addEventListener("mouseleave", () => { tip.hidden = true; cursor.setAttribute("visibility", "hidden"); });
  const legend = el("div", { class: "legend" }, ...series.map((ser, k) => el("span", {
    style: `color:${ser.color || COLORS[k % COLORS.length]}`, text: "● " + ser.name,
    onclick: (ev) => { lines[k].hidden = !lines[k].hidden; lines[k].style.display = lines[k].hidden ? "none" : ""; ev.target.classList.toggle("off"); },
  })));
  box.append(s, legend, tip);
  return box;
}

async function loadCurves() {
  const c = await api(`/api/runs/${encodeURIComponent(state.run)}/curves`);
  const charts = $("#charts");
  charts.innerHTML = "";
  const rs = c.report_steps;
  if (rs.length) {
    const x = rs.map((s) => s.step);
    const ser = [{ name: "mean env reward", values: rs.map((s) => s.reward) }];
    if (c.eval.before !== null) ser.push({ name: "eval before", values: rs.map(() => c.eval.before), dash: "4 3", color: "#6b7280" });
    if (c.eval.after !== null) ser.push({ name: "eval after", values: rs.map(() => c.eval.after), dash: "4 3", color: "#16a34a" });
    charts.append(lineChart("reward per GRPO step (report)", x, ser, { min: 0, max: 1 }));
    charts.append(lineChart("rollout time per step, s", x, [{ name: "rollout", values: rs.map((s) => s.rollout_s) }, { name: "generation", values: rs.map((s) => s.generate_s) }]));
    charts.append(lineChart("prefix cache and speculation", x, [{ name: "hit rate", values: rs.map((s) => s.hit_rate) }, { name: "speculation accuracy", values: rs.map((s) => s.accuracy) }], { min: 0, max: 1 }));
    if (rs.some((s) => s.loss !== null)) charts.append(lineChart("loss", x, [{ name: "loss", values: rs.map((s) => s.loss) }]));
  }
  const ep = c.epochs;
  if (ep.length) {
    const x = ep.map((e) => e.epoch);
    charts.append(lineChart("mean final reward per epoch (step log)", x, [{ name: "reward", values: ep.map((e) => e.reward) }], { min: 0, max: 1 }));
    charts.append(lineChart("steps served per epoch (step log)", x, [{ name: "from prefix cache", values: ep.map((e) => e.cache) }, { name: "from speculation", values: ep.map((e) => e.speculation) }], { min: 0, max: 1 }));
    charts.append(lineChart("tool seconds per epoch (step log)", x, [{ name: "tool s", values: ep.map((e) => e.tool_s) }]));
  }
  if (!charts.children.length) charts.append(el("p", { text: "this run has no report and no step log yet" }));
}

// live workspaces ----------------------------------------------------------------------------
let wsTimer = null, screenTimer = null;

async function loadWorkspaces() {
  try {
    const [w, s] = await Promise.all([api("/api/workspaces"), api("/api/snapshots")]);
    const body = $("#ws-table tbody");
    body.innerHTML = "";
    for (const r of w.workspaces) {
      const m = r.memory || {};
      body.append(el("tr", { "data-ws": r.id },
        el("td", { text: r.id }), el("td", { text: r.image }), el("td", { text: r.state }), el("td", { text: r.owner }),
        el("td", { class: "num", text: r.pid ?? "–" }), el("td", { class: "num", text: m.processes ?? "–" }),
        el("td", { class: "num", text: mb(m.pss) }), el("td", { class: "num", text: mb(m.cgroup) }),
        el("td", { class: "num mem-private", text: mb(m.private) }), el("td", { class: "num mem-shared", text: mb(m.shared) }),
        el("td", { class: "num mem-written", title: "private copies of snapshot image pages: changed / rewritten with the same bytes",
          text: m.written ? `${mb(m.written.changed)} / ${mb(m.written.unchanged)}` : "–" }),
        el("td", { text: r.snapshot || "" }),
        el("td", {}, r.desktop ? el("button", { text: "view screen", onclick: () => openScreen(r.id) }) : null)));
    }
    if (!w.workspaces.length) body.append(el("tr", {}, el("td", { colspan: 13, text: "no workspaces" })));
    const sb = $("#snap-table tbody");
    sb.innerHTML = "";
    for (const x of s.snapshots) {
      const m = x.memory || {};
      sb.append(el("tr", { "data-snap": x.id }, el("td", { text: x.id }), el("td", { text: x.parent || "" }), el("td", { text: x.image || "" }),
        el("td", { class: "num", text: x.depth }), el("td", { class: "num", text: mb(x.bytes) }), el("td", { text: x.memory_mode || "" }),
        el("td", { class: "num mem-pages", text: mb(m.pages) }), el("td", { class: "num mem-mapped", text: mb(m.mapped) }),
        el("td", { class: "num mem-held", text: mb(m.held_only) }),
        el("td", { text: x.clones.join(" ") }), el("td", { text: (m.mapped_by || []).join(" ") })));
    }
    const ms = w.memory_survey || {};
    $("#ws-updated").textContent = "updated " + new Date().toLocaleTimeString()
      + (ms.taken ? `; memory counted at ${new Date(ms.taken * 1000).toLocaleTimeString()} in ${fmt(ms.seconds, 1)} s` : "");
  } catch (e) {
    $("#ws-updated").textContent = String(e);
  }
}

function openScreen(id) {
  $("#screen-view").hidden = false;
  $("#screen-id").textContent = id;
  const img = $("#screen-img");
  clearTimeout(screenTimer);
  // the next frame is asked for once this one arrived: never more than one capture in flight
  const next = () => { screenTimer = setTimeout(() => { if (!$("#screen-view").hidden && $("#screen-id").textContent === id) img.src = `/api/workspaces/${id}/screen.jpg?t=${Date.now()}`; }, 1000); };
  img.onload = () => { $("#screen-error").textContent = ""; next(); };
  img.onerror = () => { $("#screen-error").textContent = "the screen could not be read (stopped?)"; $("#screen-error").className = "error"; next(); };
  img.src = `/api/workspaces/${id}/screen.jpg?t=${Date.now()}`;
}

// wiring --------------------------------------------------------------------------------------
function showTab(name) {
  for (const b of document.querySelectorAll(".tab")) b.classList.toggle("active", b.dataset.tab === name);
  for (const p of document.querySelectorAll(".panel")) p.hidden = p.id !== name;
  clearInterval(wsTimer);
  if (name === "curves" && state.run) loadCurves();
  if (name === "workspaces") { loadWorkspaces(); wsTimer = setInterval(loadWorkspaces, 5000); }
}

document.addEventListener("DOMContentLoaded", () => {
  for (const b of document.querySelectorAll(".tab")) b.addEventListener("click", () => showTab(b.dataset.tab));
  $("#run").addEventListener("change", (e) => openRun(e.target.value));
  $("#filters").addEventListener("submit", (e) => { e.preventDefault(); state.page = 0; loadGroups(true); });
  $("#prev").addEventListener("click", () => { state.page--; loadGroups(false); });
  $("#next").addEventListener("click", () => { state.page++; loadGroups(false); });
  $("#screen-close").addEventListener("click", () => { $("#screen-view").hidden = true; clearTimeout(screenTimer); });
  loadRuns().catch((e) => { $("#tree-head").textContent = String(e); });
});
